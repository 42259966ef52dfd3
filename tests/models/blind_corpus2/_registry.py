"""The second blind batch reuses the first batch's registry type, sizes and deterministic initialiser."""

from __future__ import annotations

from tests.models.blind_corpus._registry import (
    EXPERTS,
    FFN,
    HIDDEN,
    STYLES,
    TOP_K,
    CorpusLayer,
    materialize,
    seeded_uniform_,
)

__all__ = ["EXPERTS", "FFN", "HIDDEN", "STYLES", "TOP_K", "CorpusLayer", "materialize", "seeded_uniform_"]
