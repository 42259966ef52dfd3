"""The model side: expert modules found, grouped, quantised and swapped before compiling.

* :mod:`.discovery`: where a model keeps its expert weights (:func:`~.discovery.find_expert_weights`).
* :mod:`.interface`: the fused experts forward and transformers' ``"moe_compile"`` experts implementation.
* :mod:`.swap`: expert-loop blocks swapped onto the fused forward over grouped views of their weights.
* :mod:`.quantize` and :mod:`.grouped_weight`: grouped (bf16, MXFP8, NVFP4) expert weights.
* :mod:`._grad_views` and :mod:`._storage_swap`: per-expert gradients as views of one grouped gradient.

The graph passes (:mod:`moe_compile.passes`) see what this side leaves in the graph; nothing here imports them.
"""
