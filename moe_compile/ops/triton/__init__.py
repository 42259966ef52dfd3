"""Triton kernels (``@triton.jit`` only, no allocation) for the ops in ``moe_compile.ops``.

Each module imports without CUDA, so the kernels run on CPU tensors under ``TRITON_INTERPRET=1``
(set before ``triton`` is first imported; the tests do this in a subprocess).
"""
