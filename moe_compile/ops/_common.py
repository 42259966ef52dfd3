"""Helpers shared by the dispatch ops: the static row bound and argument checks.

Shape suffixes used across ``moe_compile.ops``: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k,
``N = T*K`` routed rows, ``M`` the static padded row bound, ``I`` expert intermediate size.
"""

from __future__ import annotations

SUPPORTED_ALIGNMENTS = (1, 8, 16, 32, 64, 128, 256)


def static_row_bound(num_routed: int, num_experts: int, align: int) -> int:
    """Rows of the padded permuted buffer: ``floor((N + E*(a-1)) / a) * a`` (``N`` when ``a == 1``).

    Tight worst case (TransformerEngine-JAX): every expert's segment is rounded up to a multiple of
    ``a`` and at most ``min(E, N)`` experts are non-empty, so ``E`` could be ``min(E, N)``; we keep
    ``E`` as the contract states it. Works with SymInts.
    """
    if align == 1:
        return num_routed
    return (num_routed + num_experts * (align - 1)) // align * align


def check_alignment(align: int, arg: str = "align") -> None:
    if not isinstance(align, int) or align not in SUPPORTED_ALIGNMENTS:
        raise ValueError(f"{arg}={align!r} is not supported; use one of {SUPPORTED_ALIGNMENTS}")
