"""Custom ops (``torch.ops.moe.*``) with CPU reference and Triton CUDA implementations."""

from moe_compile.ops._common import SUPPORTED_ALIGNMENTS, static_row_bound

__all__ = ["SUPPORTED_ALIGNMENTS", "static_row_bound"]
