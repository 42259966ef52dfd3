"""``masked_attention`` (``deterministic=True``): SDPA with a mask left -> ``moe.masked_attention``.

A padding mask from an input (bool and additive), a sliding window built in the graph, GQA through ``enable_gqa``
and MLA head dims are rewritten, and outputs and every gradient match eager within the derived bound; dropout, a
mask that needs a gradient and the option off leave it alone; a tiny transformers Qwen3-MoE with a padding
``attention_mask`` (the family's own SDPA call) is rewritten.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_compile.config import make_config
from tests.passes._harness import assert_matches_eager, assert_report, compile_and_run
from tests.passes.test_causal_mask import Attention, tiny_qwen3_moe
from tests.passes.test_pad_attention_value import MLAttention

DETERMINISTIC = make_config(deterministic=True, strict=True)


class GQAttention(nn.Module):
    """Grouped-query attention by ``enable_gqa`` (4 query heads, 2 key/value heads), a padding mask from an input."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, mask_grad: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.zeros(1)) if mask_grad else None

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q = self.q(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        mask = torch.zeros(B, 1, 1, S, dtype=x.dtype).masked_fill(~keep[:, None, None, :], float("-inf"))
        if self.bias is not None:
            mask = mask + self.bias
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.out(o.transpose(1, 2).reshape(B, S, D))


def _keep(B=2, S=12, left=True):
    """A padding mask: three padded tokens in the second sequence, on the left (with a causal mask its first query
    rows then allow nothing) or on the right."""
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, slice(0, 3) if left else slice(S - 3, S)] = False
    return keep


def _run(model, args, config=DETERMINISTIC):
    run = compile_and_run(model, args, train=True, config=config, fullgraph=True)
    assert_matches_eager(run, model, args, train=True)
    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_padding_mask_is_rewritten(dtype, mask):
    torch.manual_seed(0)
    model = Attention(mask).to(dtype)
    # right padding for the additive mask: left-padded rows would hold only finfo.min (next test)
    run = _run(model, (torch.randn(2, 12, 32, dtype=dtype), _keep(left=mask == "bool")))
    assert_report(run.report, {"causal_mask": 0, "masked_attention": 1}, {"causal_mask": ["mask_from_inputs"]})
    rewrite = next(r for r in run.report.records if r.pass_name == "masked_attention" and r.kind == "rewrite")
    assert "[2, 1, 12, 12]" in rewrite.what and "moe.masked_attention" in rewrite.detail


def test_rows_of_only_finfo_min_are_refused_on_cpu():
    """An additive mask whose rows hold only ``finfo.min`` (left padding under a causal mask): torch's CPU flash kernel
    attends uniformly over such a row, ``moe.masked_attention`` gives 0 there as the CUDA kernel it replaces does
    (NOTE [large finite mask values] (moe_compile/ops/triton/masked_attention.py)). Translation validation sees the
    difference and keeps SDPA."""
    torch.manual_seed(0)
    model, args = Attention("additive"), (torch.randn(2, 12, 32), _keep(left=True))
    run = compile_and_run(model, args, train=True, config=make_config(deterministic=True), fullgraph=True)
    assert_report(run.report, {"masked_attention": 0}, {"masked_attention": ["validation_failed"]})
    assert_matches_eager(run, model, args, train=True)


def test_sliding_window_is_rewritten():
    torch.manual_seed(0)
    run = _run(Attention("window"), (torch.randn(2, 12, 32),))
    assert_report(run.report, {"causal_mask": 0, "masked_attention": 1}, {"causal_mask": ["not_causal"]})


def test_grouped_query_attention_is_rewritten():
    torch.manual_seed(0)
    run = _run(GQAttention(), (torch.randn(2, 12, 32), _keep()))
    assert_report(run.report, {"masked_attention": 1})


def test_mla_head_dims_with_a_padding_mask_are_rewritten():
    torch.manual_seed(0)
    run = _run(MLAttention(), (torch.randn(2, 12, 32), _keep()))
    assert_report(run.report, {"pad_attention_value": 0, "masked_attention": 1},
                  {"pad_attention_value": ["masked"]})


def test_dropout_is_left_alone():
    torch.manual_seed(0)
    model = MLAttention(dropout=0.1).train()
    run = compile_and_run(model, (torch.randn(2, 12, 32), _keep()), train=True, config=DETERMINISTIC,
                          fullgraph=True)
    assert_report(run.report, {"masked_attention": 0}, {"masked_attention": ["dropout"]})


def test_mask_needing_a_gradient_is_left_alone():
    torch.manual_seed(0)
    run = _run(GQAttention(mask_grad=True), (torch.randn(2, 12, 32), _keep()))
    assert_report(run.report, {"masked_attention": 0}, {"masked_attention": ["mask_requires_grad"]})


def test_option_off_changes_nothing():
    torch.manual_seed(0)
    run = _run(Attention("bool"), (torch.randn(2, 12, 32), _keep()), config=make_config(strict=True))
    assert not [r for r in run.report.records if r.pass_name == "masked_attention"]


def test_transformers_padding_mask_is_rewritten():
    model = tiny_qwen3_moe()
    ids = torch.randint(0, 128, (2, 16))
    attention_mask = torch.ones(2, 16, dtype=torch.long)
    attention_mask[1, :5] = 0
    kwargs = {"input_ids": ids, "attention_mask": attention_mask, "labels": ids}
    run = compile_and_run(model, (), kwargs, train=True, config=DETERMINISTIC, fullgraph=True)
    assert_report(run.report, {"masked_attention": 1})
    assert_matches_eager(run, model, (), kwargs, train=True)
