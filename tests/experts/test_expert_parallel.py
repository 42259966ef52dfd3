"""The expert-parallel swap's refusals (``moe_compile/experts/expert_parallel.py``) in one process over a fake process
group: the checks that refuse a block before the probe runs any collective, and the transformers expert-parallel
blocks that keep transformers' own implementation. ``tests/models/test_ep.py`` swaps the host-loop layer and
transformers' ``all_to_all`` implementation on 2 gloo ranks and compares them with eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_compile.experts.expert_parallel import (
    hf_ep_implementation,
    process_group_of,
    swap_ep_blocks,
    use_hf_expert_parallel,
)
from tests.models.ep_layers import AutogradAllToAllEP


class _WithBias(AutogradAllToAllEP):
    """The host-loop layer plus an output bias: state the fused path does not read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bias = nn.Parameter(torch.randn(self.router.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias


def _refused(layer: nn.Module, tag: str, words: str) -> None:
    forward = layer.forward
    (record,) = swap_ep_blocks(layer)
    assert record[:3] == ("<root>", "skip", tag) and words in record[3], record
    assert layer.forward == forward and not hasattr(layer, "_moe_compile_ep_plan")


def test_block_holding_other_state_is_left_alone(fake_group):
    _refused(_WithBias(hidden=32, inter=16, experts=8, top_k=2), "block_state_unused", "other parameters ['bias']")


def test_expert_weights_without_a_hidden_side_are_left_alone(fake_group):
    layer = AutogradAllToAllEP(hidden=32, inter=16, experts=8, top_k=2)
    layer.w_down = nn.Parameter(torch.randn(4, 16, 24))
    _refused(layer, "unknown_expert_mlp", "no side of the hidden size 32")


def test_experts_not_split_over_the_group_are_left_alone(fake_group):
    layer = AutogradAllToAllEP(hidden=32, inter=16, experts=8, top_k=2)
    layer.router = nn.Linear(32, 6, bias=False)  # 6 experts over 2 ranks: 3 per rank, the weights hold 4
    _refused(layer, "block_state_unused", "expected two [L=3, ., .] expert weights")


def test_a_block_without_a_process_group_is_not_expert_parallel():
    assert process_group_of(nn.Linear(2, 2)) is None


def _hf_ep_block(implementation: str, mesh_shape: tuple[int, int]) -> nn.Module:
    """A Qwen3-MoE block made expert-parallel by transformers over an ``(ep, tp)`` mesh of the fake group."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("ep", "tp"))
    block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8,
                                                  num_experts_per_tok=2))
    plan = {"experts.gate_up_proj": "grouped_gemm", "experts.down_proj": "grouped_gemm",
            "experts": "ep_dispatch_experts"}
    return apply_expert_parallelism(block, mesh["ep"], mesh["tp"], plan, ep_implementation=implementation)


def test_transformers_expert_parallel_with_tensor_parallel_is_left_alone(fake_group):
    """The ranks of a TP group share one batch (transformers' ``AllToAllEP`` slices it over TP first): not ours."""
    pytest.importorskip("transformers.distributed.expert_parallel")
    block = _hf_ep_block("all_to_all", (1, 2))
    (record,) = use_hf_expert_parallel(block)
    assert record[:3] == ("experts", "skip", "ep_unsupported") and "tp_size 2" in record[3], record
    assert type(hf_ep_implementation(block.experts)).__name__ == "AllToAllEP"
    with pytest.raises(ValueError, match="ep_implementation='moe_compile': .*tp_size 2"):
        _hf_ep_block("moe_compile", (1, 2))
