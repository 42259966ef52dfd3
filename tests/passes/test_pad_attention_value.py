"""``pad_attention_value`` (``deterministic=True``): MLA-shaped attention (query/key head dim above the value's).

A handwritten MLA attention (q/k head dim 24 = 16 "nope" + 8 rope, value head dim 16, causal mask built from
``arange``; the same proportions as DeepSeek-V3's 192 / 128) is rewritten after ``causal_mask``; outputs and
every gradient match eager within the derived bound, and the rewritten SDPA takes a value as wide as the query.
Equal head dims, a mask from an input and the option off leave it alone; and a tiny transformers DeepSeek-V3
(the family's own MLA) is rewritten.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_compile.config import make_config
from tests.passes._harness import assert_matches_eager, assert_report, compile_and_run

DETERMINISTIC = make_config(deterministic=True, strict=True)


class MLAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, qk_dim: int = 24, v_dim: int = 16, dropout: float = 0.0):
        super().__init__()
        self.heads, self.qk_dim, self.v_dim, self.dropout = heads, qk_dim, v_dim, dropout
        self.q = nn.Linear(dim, heads * qk_dim)
        self.kv = nn.Linear(dim, heads * (qk_dim + v_dim))
        self.out = nn.Linear(heads * v_dim, dim)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.heads, self.qk_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, S, self.heads, -1).transpose(1, 2).split([self.qk_dim, self.v_dim], dim=-1)
        i = torch.arange(S, device=x.device)
        allowed = (i[None, :] <= i[:, None])[None, None]
        allowed = allowed & keep[:, None, None, :] if keep is not None else allowed.expand(B, 1, S, S)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=self.dropout,
                                           scale=self.qk_dim ** -0.5)
        return self.out(o.transpose(1, 2).reshape(B, S, self.heads * self.v_dim))


def _run(model, args, config=DETERMINISTIC):
    run = compile_and_run(model, args, train=True, config=config, fullgraph=True)
    assert_matches_eager(run, model, args, train=True)
    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_attention_value_is_padded(dtype):
    torch.manual_seed(0)
    model = MLAttention().to(dtype)
    run = _run(model, (torch.randn(2, 12, 32, dtype=dtype),))
    assert_report(run.report, {"causal_mask": 1, "pad_attention_value": 1})
    rewrite = next(r for r in run.report.records if r.pass_name == "pad_attention_value" and r.kind == "rewrite")
    assert "value head dim 16 < 24" in rewrite.what and "padded to 24" in rewrite.detail


def test_equal_head_dims_are_no_match():
    torch.manual_seed(0)
    run = _run(MLAttention(qk_dim=16, v_dim=16), (torch.randn(2, 12, 32),))
    assert_report(run.report, {"causal_mask": 1, "pad_attention_value": 0})
    assert not [r for r in run.report.records if r.pass_name == "pad_attention_value"]


def test_mask_from_an_input_is_left_alone():
    torch.manual_seed(0)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, :3] = False
    run = _run(MLAttention(), (torch.randn(2, 12, 32), keep))
    assert_report(run.report, {"pad_attention_value": 0}, {"pad_attention_value": ["masked"]})


def test_option_off_changes_nothing():
    torch.manual_seed(0)
    run = _run(MLAttention(), (torch.randn(2, 12, 32),), config=make_config(strict=True))
    assert not [r for r in run.report.records if r.pass_name == "pad_attention_value"]


def test_deepseek_v3_attention_is_padded():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=64, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 10))
    run = compile_and_run(model, (ids,), train=True, config=DETERMINISTIC, fullgraph=True,
                          loss_fn=lambda out: out.logits.float().square().mean())
    assert_matches_eager(run, model, (ids,), train=True, loss_fn=lambda out: out.logits.float().square().mean())
    assert_report(run.report, {"causal_mask": 1, "pad_attention_value": 1})
