"""The shared recogniser: the forms every pass reads, as tables and small matchers.

* :mod:`.ops`: op-name tables (casts, views, unary / binary / reduction ops, grouped GEMMs).
* :mod:`.counts`: per-expert counts of the routed ids (``histc``, ``bincount``, ``one_hot(...).sum``, ...).
* :mod:`.combine`: un-permute + top-k sum and accumulating combines (``index_add_``, ``scatter_add_``, ...).
* :mod:`.index_algebra`: index expressions as linear forms (offsets, destinations, ``perm // K``).
* :mod:`.accumulate`: which nodes accumulate (scatter-adds) and which library kernels are not reproducible.
* :mod:`.rowwise`: the row-wise proof of an expert region (no op mixes rows).

Extend a table here and every pass knows the new spelling.
"""
