"""Ops (``torch.ops.moe.*``) with CPU references and Triton CUDA implementations that Inductor launches itself."""

from moe_compile.ops import (
    deterministic_flag,  # noqa: F401 - defines moe.deterministic_<op> (cached code calls them)
    # `expert_gemm` is the module (its wrapper is `expert_gemm.expert_gemm`), like `grouped_mm` below
    expert_gemm,
    # the module, imported to define moe.gather_rows, moe.ep_send_index, moe.ep_regroup_index
    expert_parallel,  # noqa: F401
    # `moe_compile.ops.grouped_mm` stays the module (its op wrapper is `grouped_mm.grouped_mm`): code across
    # the package imports it as `from moe_compile.ops import grouped_mm as gmm`.
    grouped_mm,
    # the module (its wrapper is `masked_attention.masked_attention`), imported to define moe.masked_attention
    masked_attention,  # noqa: F401
)
from moe_compile.ops._common import SUPPORTED_ALIGNMENTS, static_row_bound
from moe_compile.ops.expert_gemm import use_triton_grouped_gemm
from moe_compile.ops.grouped_mm import grouped_mm_mxfp8, grouped_mm_nvfp4, grouped_mm_reference
from moe_compile.ops.permute_pad import (
    PermutePadOut,
    permute_pad,
    permute_pad_backward_reference,
    permute_pad_reference,
)
from moe_compile.ops.segment_sum import (
    gather_segment_sum,
    gather_segment_sum_reference,
    segment_sum,
    segment_sum_reference,
)
from moe_compile.ops.unpad_unpermute import (
    unpad_unpermute,
    unpad_unpermute_backward_reference,
    unpad_unpermute_reference,
)

__all__ = [
    "SUPPORTED_ALIGNMENTS",
    "PermutePadOut",
    "expert_gemm",
    "gather_segment_sum",
    "gather_segment_sum_reference",
    "grouped_mm",
    "grouped_mm_mxfp8",
    "grouped_mm_nvfp4",
    "grouped_mm_reference",
    "permute_pad",
    "permute_pad_backward_reference",
    "permute_pad_reference",
    "segment_sum",
    "segment_sum_reference",
    "static_row_bound",
    "unpad_unpermute",
    "unpad_unpermute_backward_reference",
    "unpad_unpermute_reference",
    "use_triton_grouped_gemm",
]
