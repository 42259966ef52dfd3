"""``causal_mask`` (``deterministic=True``): a constant causal ``attn_mask`` becomes ``is_causal=True``.

Handwritten attention with masks built from ``arange`` (bool and additive: rewritten; a sliding window:
left alone, ``not_causal``), a mask from a graph input (left alone, ``mask_from_inputs``), the option off
(nothing), and a tiny transformers Qwen3-MoE with SDPA (its compiled causal mask is rewritten). Outputs and
gradients match eager within the derived bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_compile.config import make_config
from tests.passes._harness import assert_matches_eager, assert_report, compile_and_run

DETERMINISTIC = make_config(deterministic=True, strict=True)


class Attention(nn.Module):
    def __init__(self, mask: str, dim: int = 32, heads: int = 4):
        super().__init__()
        self.mask, self.heads = mask, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        i = torch.arange(S, device=x.device)
        allowed = i[None, :] <= i[:, None]
        if self.mask == "window":
            allowed = allowed & (i[:, None] - i[None, :] < 3)
        if keep is not None:  # a padding mask from an input
            allowed = allowed[None, None] & keep[:, None, None, :]
        else:
            allowed = allowed[None, None].expand(B, 1, S, S)
        mask = allowed
        if self.mask == "additive":
            mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(
                ~allowed, torch.finfo(x.dtype).min)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(B, S, D))


def _run(model, args, config=DETERMINISTIC):
    run = compile_and_run(model, args, train=True, config=config, fullgraph=True)
    assert_matches_eager(run, model, args, train=True)
    return run


@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_constant_causal_mask_becomes_is_causal(mask):
    torch.manual_seed(0)
    run = _run(Attention(mask), (torch.randn(2, 12, 32),))
    assert_report(run.report, {"causal_mask": 1})


def test_window_mask_is_not_causal():
    torch.manual_seed(0)
    run = _run(Attention("window"), (torch.randn(2, 12, 32),))
    assert_report(run.report, {"causal_mask": 0}, {"causal_mask": ["not_causal"]})


def test_mask_from_an_input_is_left_alone():
    torch.manual_seed(0)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, :3] = False
    run = _run(Attention("bool"), (torch.randn(2, 12, 32), keep))
    assert_report(run.report, {"causal_mask": 0}, {"causal_mask": ["mask_from_inputs"]})


def test_option_off_changes_nothing():
    torch.manual_seed(0)
    run = _run(Attention("bool"), (torch.randn(2, 12, 32),), config=make_config(strict=True))
    assert not [r for r in run.report.records if r.pass_name == "causal_mask"]


def tiny_qwen3_moe() -> torch.nn.Module:
    """A one-layer transformers Qwen3-MoE CausalLM with SDPA attention (vocab 128), seeded."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg)


def test_transformers_sdpa_mask_is_rewritten():
    model = tiny_qwen3_moe()
    ids = torch.randint(0, 128, (2, 16))
    run = compile_and_run(model, (), {"input_ids": ids, "labels": ids}, train=True, config=DETERMINISTIC,
                          fullgraph=True)
    assert_report(run.report, {"causal_mask": 1})
    assert_matches_eager(run, model, (), {"input_ids": ids, "labels": ids}, train=True)
