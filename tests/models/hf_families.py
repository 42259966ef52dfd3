"""Every transformers MoE family, found in the installed package and built from a tiny config.

:func:`moe_families` lists the model types whose modeling file uses transformers' experts interface
(``use_experts_implementation``); :func:`build` makes a ``*ForCausalLM`` (for a multimodal family, the causal LM
or base model of its text config) from the family's config class with generic tiny overrides: every MoE attribute under
each of its names (experts 8, top-k 2, groups that divide them, every layer sparse), hidden 64, one layer. Families that
cannot be built or run from a config alone raise :class:`Unbuildable` with the reason.

:func:`outside_interface_families` lists the MoE families whose experts do not go through that interface (their
own dispatch code, :data:`OUTSIDE` says why per family); the same builder makes them, with per-family config
overrides, an encoder-decoder (``kind="seq2seq"``: ids in, labels to the decoder) or a vision backbone
(``kind="vision"``: images and a dataset index in, trained on its feature maps) where the family is one.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import pathlib
import re
from typing import Any

import torch
from torch._dynamo.utils import counters

HIDDEN, EXPERTS, TOP_K, VOCAB, LAYERS = 64, 8, 2, 128, 1

# attribute -> tiny value, set wherever a config has the attribute (several names for one idea)
TINY: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64, "moe_intermediate_size": 32,
    "expert_intermediate_size": 32, "shared_expert_intermediate_size": 32, "ffn_hidden_size": 64,
    "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
    "max_position_embeddings": 64, "num_experts": EXPERTS, "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_topk": TOP_K,
    "top_k": TOP_K, "moe_k": TOP_K, "n_group": 2, "topk_group": 1, "num_expert_group": 2, "topk_group_size": 1,
    "first_k_dense_replace": 0, "first_k_dense": 0, "decoder_sparse_step": 1, "moe_layer_freq": 1,
    "mlp_only_layers": [], "n_shared_experts": 1, "num_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": None,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "use_cache": False, "router_jitter_noise": 0.0,
    "num_dense_layers": 0, "moe_layer_start_index": 0, "moe_layer_interval": 1, "expert_layer_period": 1,
    "expert_layer_offset": 0, "num_experts_per_token": TOP_K, "moe_num_shared_experts": 1,
    "output_router_logits": True, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 64,
}


class Unbuildable(Exception):
    """A family that cannot be built or run from a config alone (the message says why)."""


class BuilderError(Unbuildable):
    """The tiny model was built but does not run eagerly: the tiny config broke it (a size the family derives
    from another, a dtype): the builder's failure, reported as a failure of the family, not a skip."""


@dataclasses.dataclass(frozen=True)
class Outside:
    """A family outside the experts interface: why, and how to build it where :data:`TINY` is not enough.

    Attributes:
        why: what its experts code is, in a few words (why the interface does not cover it).
        overrides: config attributes set after :data:`TINY` (a dotted name reaches into a sub-config): what makes
            the model tiny, makes its layers MoE, and turns dropout off (eager and compiled steps must agree).
        cls: the model class where the auto mappings name none for the config (``None``: look it up).
        kind: with ``cls``: ``"lm"``, ``"base"`` (the text base model on ``text_config``) or ``"vision"``.
        swapped: ``moe_compile.compile``'s expert-loop swap rewrites every experts layer (the matrix asserts it);
            False: each carries explain's reason tag instead.
        known_break: with ``swapped``, the graph break of the family's own code that Dynamo cannot capture whatever
            the swap does (a part of the break's developer context): the matrix then allows that break and no
            break inside the frames Dynamo traces; empty: the step is captured whole.
    """

    why: str
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    cls: str | None = None
    kind: str = "lm"
    swapped: bool = False
    known_break: str = ""


_NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "encoder_layerdrop": 0.0,
               "decoder_layerdrop": 0.0, "dropout_rate": 0.0}

OUTSIDE: dict[str, Outside] = {
    "dbrx": Outside(
        "DbrxExperts: w1/v1/w2 as 2-D [E*I, H] parameters, an eager one-hot + nonzero loop over the experts hit",
        # transformers 5.24's DbrxAttention reads attn_config.rope_theta, which the config class no longer has, and
        # clamps by clip_qkv even where it is None (the default; released checkpoints set 8)
        {"ffn_config.hidden_size": HIDDEN, "ffn_config.ffn_hidden_size": 32, "ffn_config.moe_num_experts": EXPERTS,
         "ffn_config.moe_top_k": TOP_K, "attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0,
         "max_seq_len": 64}, swapped=True),
    "jetmoe": Outside(
        "JetMoeParallelExperts: stacked [E, N, K] weights run by a split-by-counts loop (MLP), and a mixture of "
        "attention heads (MoA) whose experts are the query/output projections"),
    "llama4": Outside(
        "Llama4TextExperts: every token through every expert (bmm over [E, T, H] inputs scaled by the router "
        "scores, zero outside the top-k), no dispatch; plus a shared expert",
        {"interleave_moe_layer_step": 1, "no_rope_layers": [1]}, swapped=True),
    "longcat_flash": Outside(
        "LongcatFlashExperts (transformers <= 5.24): an eager per-expert loop that includes zero-compute (identity) "
        "experts; swapped: "
        "grouped GEMMs over the MLP experts, the identity experts' rows the tokens themselves "
        "(NOTE [identity experts] (moe_compile/experts/interface.py)); another form of them: zero_compute_experts",
        {"num_layers": 1, "expert_ffn_hidden_size": 32, "zero_expert_num": 2, "qk_head_dim": 32}, swapped=True),
    "nllb_moe": Outside(
        "NllbMoeSparseMLP: top-2 capacity routing (one-hot dispatch mask, a ModuleDict of dense experts run on "
        "masked tokens); left alone (capacity_eager_mismatch): transformers 5.24's NllbMoeExperts one-hots the "
        "one-hot top-1 mask again and runs expert_0 / expert_1 by its values, not the experts the router chose",
        {**_NO_DROPOUT, "d_model": HIDDEN, "encoder_layers": 1, "decoder_layers": 1, "encoder_ffn_dim": 64,
         "decoder_ffn_dim": 64, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "expert_capacity": 16,
         "encoder_sparse_step": 1, "decoder_sparse_step": 1, "moe_token_dropout": 0.0, "tie_word_embeddings": True}),
    "step3p7": Outside(
        "Step3p7Experts (transformers <= 5.24): an eager per-expert loop (not decorated), stacked [E, 2I, H] weights",
        {"share_expert_dim": 32, "intermediate_size": 64}, cls="Step3p7TextModel", kind="base", swapped=True),
    "switch_transformers": Outside(
        "SwitchTransformersExperts: top-1 capacity routing (cumsum positions), a ModuleDict of dense experts "
        "(swapped: NOTE [capacity swap] (moe_compile/experts/_swap_capacity.py); in bf16 its float32 router's "
        "gradient, computed from bf16 probabilities, is probed in bf16 ulps: "
        "NOTE [gradient precision] (moe_compile/experts/_probe.py); with the experts' dropout on, released configs' "
        "0.1: expert_dropout). Not captured whole without an attention mask: transformers 5.24's "
        "SwitchTransformersStack makes the all-ones mask only when not is_torchdynamo_compiling(), then its encoder "
        "subscripts the None mask (a TypeError that Dynamo sees, and runs that frame eagerly; "
        "test_hf_families.py::test_switch_graph_break_is_transformers_own)",
        {**_NO_DROPOUT, "d_model": HIDDEN, "d_kv": 16, "d_ff": 64, "num_heads": 4, "num_layers": 2,
         "num_decoder_layers": 2, "num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1,
         "expert_capacity": 16, "tie_word_embeddings": True, "decoder_start_token_id": 0}, swapped=True,
        known_break="""raised exception TypeError("'NoneType' object is not subscriptable")"""),
    "doge": Outside(
        "DogeCDMoE: product-key retrieval of single-neuron experts from nn.Embedding tables (16 experts, 4 keys)",
        {"is_moe": True, "num_experts": 16}),
    "vitpose_backbone": Outside(
        "VitPoseNaiveMoe: a ModuleList of per-dataset linears, every one run on every token and masked by the "
        "dataset index (ViTPose++)",
        {"num_experts": 2, "part_features": 16, "image_size": [32, 32], "patch_size": [8, 8], "mlp_ratio": 2,
         "out_indices": [1]}, cls="VitPoseBackbone", kind="vision"),
}


def outside_interface_families() -> tuple[str, ...]:
    """The MoE families of :data:`OUTSIDE` that the installed transformers has with experts of their own code, not
    transformers' experts interface (``use_experts_implementation``): :func:`moe_families` does not find them and the
    interface's fused path does not cover them; :attr:`Outside.why` says what each one's experts are. A family that a
    newer transformers moves onto the interface (LongCat-Flash and Step3p7 in 5.25) is one of :func:`moe_families`
    there, built with the same overrides."""
    from transformers import CONFIG_MAPPING

    installed = (f for f in OUTSIDE if f in CONFIG_MAPPING or f.replace("_", "-") in CONFIG_MAPPING)
    return tuple(f for f in installed if f not in moe_families())


@functools.cache
def moe_families() -> tuple[str, ...]:
    """Model types whose modeling file uses ``use_experts_implementation`` (installed transformers)."""
    import transformers

    root = pathlib.Path(transformers.__file__).parent / "models"
    found = set()
    for path in root.glob("*/modeling_*.py"):
        if "use_experts_implementation" in path.read_text(errors="ignore"):
            found.add(path.parent.name)
    return tuple(sorted(found))


def _model_type(family: str) -> str:
    from transformers import CONFIG_MAPPING

    model_type = next((n for n in (family, family.replace("_", "-")) if n in CONFIG_MAPPING), None)
    if model_type is None:
        raise Unbuildable(f"no config registered for model type {family!r}")
    return model_type


def _class(name: Any) -> Any:
    import transformers

    name = name if isinstance(name, str) or name is None else name[0]
    return getattr(transformers, name, None) if name else None


def _plan(family: str) -> tuple[Any, Any, str]:
    """``(model class, config, kind)``: the family's causal LM on its config; for a composite (multimodal)
    config, the text model on its ``text_config``: a causal LM if one is registered (``kind="lm"``), else
    the text base model (``kind="base"``, trained on a loss of its hidden states)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    model_type = _model_type(family)
    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception as exc:  # noqa: BLE001 - a config that needs arguments
        raise Unbuildable(f"config() fails: {type(exc).__name__}: {str(exc)[:120]}") from None
    spec = OUTSIDE.get(family)
    if spec is not None:
        cls, config, kind = _outside_plan(spec, config, model_type)
        return cls, _override(config, spec.overrides), kind
    text = getattr(config, "text_config", None)
    text_type = getattr(text, "model_type", None)
    if text_type:
        lm = _class(
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text_type) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        )
        if lm is not None:
            return lm, _override(_shrink(text), TINY_FIXES.get(family, {})), "lm"
        base = _class(MODEL_MAPPING_NAMES.get(text_type))
        if base is not None:
            return base, _override(_shrink(text), TINY_FIXES.get(family, {})), "base"
        raise Unbuildable(f"no causal LM or text model class for {text_type!r}")
    lm = _class(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type))
    if lm is None:
        raise Unbuildable("no causal LM class and no text config (encoder-only or multimodal family)")
    return lm, _override(_shrink(config), TINY_FIXES.get(family, {})), "lm"


# family -> config attributes (dotted) set after TINY where a size derived from another no longer fits
TINY_FIXES: dict[str, dict[str, Any]] = {
    # multimodal rope sections must sum to half the rotary dim: head_dim 16 x partial_rotary_factor 0.5 / 2
    "glm4v_moe": {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default",
                                      "mrope_section": [2, 1, 1]}},
}


def _outside_plan(spec: Outside, config: Any, model_type: str) -> tuple[Any, Any, str]:
    """:func:`_plan` for a family of :data:`OUTSIDE`: its named class, else its causal LM, else its seq2seq LM."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    if getattr(config, "text_config", None) is not None:  # a multimodal family: its text model
        config = config.text_config
        model_type = config.model_type
    if spec.cls is not None:
        cls = _class(spec.cls)
        if cls is None:
            raise Unbuildable(f"transformers has no {spec.cls}")
        return cls, _shrink(config), spec.kind
    for mapping, kind in ((MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "lm"), (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                                                                      "seq2seq")):
        cls = _class(mapping.get(model_type))
        if cls is not None:
            return cls, _shrink(config), kind
    raise Unbuildable("no causal or seq2seq LM class")


def _override(config: Any, overrides: dict[str, Any]) -> Any:
    for dotted, value in overrides.items():
        *path, attr = dotted.split(".")
        target = functools.reduce(getattr, path, config)
        try:
            setattr(target, attr, value)
        except Exception as exc:  # noqa: BLE001 - an override the config refuses: the spec is wrong
            raise Unbuildable(f"config refuses {dotted}={value!r}: {_first_line(exc)}") from None
    return config


def tiny_config(family: str):
    """The config :func:`build` builds ``family`` from (its text config for composite families)."""
    return _plan(family)[1]


def _shrink(config: Any) -> Any:
    if hasattr(config, "per_layer_attributes"):
        # transformers >= 5.24 heterogeneous configs refuse global reads of per-layer attributes; the tiny config
        # sets one value for every layer, so reading and writing the global value is what it means
        config.allow_global_per_layer_attribute_access = True
    for attr, value in TINY.items():
        if hasattr(config, attr):
            try:
                setattr(config, attr, value)
            except Exception:  # noqa: BLE001 - a validated field that refuses this value: keep the default
                pass
    if isinstance(getattr(config, "moe_layer_end_index", None), int):
        config.moe_layer_end_index = LAYERS - 1
    for attr in ("layer_types", "mlp_layer_types"):
        value = getattr(config, attr, None)
        if isinstance(value, (list, tuple)) and value and len(value) != LAYERS:
            # attention kinds: the first ones; MLP kinds: the last one (deep layers are the sparse ones)
            new = list(value[:LAYERS]) if attr == "layer_types" else [value[-1]] * LAYERS
            try:
                setattr(config, attr, new)
            except Exception:  # noqa: BLE001
                pass
    return config


class _HiddenStateLoss(torch.nn.Module):
    """A model without a head trained on ``mean(out ** 2)``: a text base model (composite families without a text
    LM head) on its last hidden state, a vision backbone on its last feature map."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, labels: torch.Tensor | None = None, **inputs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutput

        dtype = next(self.model.parameters()).dtype  # images in the model's precision (the fp32 copy's too)
        out = self.model(**{k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()})
        hidden = out.last_hidden_state if "last_hidden_state" in out else out.feature_maps[-1]
        return CausalLMOutput(loss=hidden.float().pow(2).mean())


def build(family: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``(model, inputs)`` for one training step of ``family``'s tiny causal LM (labels included)."""
    from tests.models.hf_models import init_params_

    cls, config, kind = _plan(family)
    try:
        model = cls(config)
    except Exception as exc:  # noqa: BLE001 - families needing more than a config
        raise Unbuildable(f"{cls.__name__}(config) fails: {type(exc).__name__}: {_first_line(exc)}") from None
    # (a family of OUTSIDE is MoE by its overrides: whether its experts are found is the test's question)
    if family not in OUTSIDE and not any(type(m).__name__.endswith("Experts") for m in model.modules()):
        raise Unbuildable("no experts module after the tiny config (MoE layers not enabled by any known attribute)")
    init_params_(model, seed)
    model = model.to(dtype)
    if kind in ("base", "vision"):
        model = _HiddenStateLoss(model)
    gen = torch.Generator().manual_seed(seed)
    if kind == "vision":  # images of the config's size, each from one dataset (ViTPose++ picks experts by it)
        size = tuple(config.image_size)
        inputs = {"pixel_values": torch.randn(2, config.num_channels, *size, generator=gen),
                  "dataset_index": torch.arange(2) % config.num_experts}
    else:  # causal LM: labels are the ids; seq2seq: the model shifts the labels into the decoder's inputs
        ids = torch.randint(3, VOCAB, (2, 8), generator=gen)
        inputs = {"input_ids": ids, "labels": ids.clone()}
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as exc:  # noqa: BLE001
        raise BuilderError(f"eager forward fails: {type(exc).__name__}: {_first_line(exc)}") from None
    return model, inputs


def _first_line(exc: Exception) -> str:
    return re.sub(r"\s+", " ", str(exc))[:160]


def _loss_and_grads(model: torch.nn.Module, inputs: dict[str, Any], fn: Any = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and parameter grads of one step of ``fn`` (default ``model``; a compiled ``model``)."""
    model.zero_grad(set_to_none=True)
    loss = (fn if fn is not None else model)(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def records_of(rep: Any) -> list[list[str]]:
    """The distinct ``[pass, stage, kind, layer, what]`` of a report, sorted: what two commits must agree on."""
    return [list(r) for r in sorted({(r.pass_name, r.stage, r.kind, r.layer, r.what) for r in rep.records})]


def check_family(family: str, backend: str = "moe_compile") -> dict[str, Any]:
    """One training step of ``family`` through ``torch.compile(backend=backend, fullgraph=True)``.

    Returns ``{"family", "status", "rewritten", "left", "numerics", "refused", "unchecked", "worst", "noise",
    "unjudged"}``: ``refused`` / ``unchecked`` the rewrites translation validation refused / could not check,
    ``rewritten`` the experts layers the dispatch passes rewrote, ``left`` the audit's findings outside the
    token embedding, ``numerics`` whether loss and every gradient are as close to a float32 eager run as
    bf16 eager is (:func:`tests._tolerance.within_eager_bound` states the bound), ``worst`` the tensor closest
    to failing it. Where that fails, plain Inductor's own distance from fp32 is added to the bound (``noise``
    says so), and ``unjudged`` names the tensors left out as noise (NOTE [cancelling sums] (tests/_tolerance.py)).
    A family outside the interface that Dynamo cannot capture whole runs with graph breaks: ``graph_breaks`` and
    ``break_context`` are the first line and the developer context of the break ``fullgraph`` stopped at,
    ``breaks_in_frames`` the reasons of the breaks inside the frames Dynamo then traced.
    """
    import copy

    try:
        model, inputs = build(family)
    except BuilderError as exc:
        return {"family": family, "status": f"fail: the tiny build does not run: {exc}"}
    except Unbuildable as exc:
        return {"family": family, "status": f"skip: {exc}"}
    model.train()
    ref32 = _loss_and_grads(copy.deepcopy(model).float(), inputs)
    eager = _loss_and_grads(model, inputs)
    outside = family in OUTSIDE and backend == "moe_compile"
    plain = copy.deepcopy(model) if outside else model  # moe_compile.compile may swap the model's expert loops
    breaks, context, in_frames = "", "", []
    try:
        try:
            compiled, rep = _compiled_step(model, inputs, backend, outside, fullgraph=True)
        # Dynamo cannot capture the model whole: a graph break, or (fullgraph captures host reads) a guard on a
        # data-dependent value, e.g. a loop over `nonzero()`'s rows
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
            user_error = isinstance(exc, torch._dynamo.exc.UserError)
            if user_error and (not outside or "data-dependent" not in str(exc)):
                raise  # the backend fails (below)
            if not outside:  # the interface families must be captured whole: no backend sees a model Dynamo breaks
                return {"family": family, "status": f"skip: Dynamo cannot capture it (fullgraph): {_first_line(exc)}"}
            breaks = _first_line(exc)
            context = next(iter(re.findall(r"Developer debug context: (.*)", str(exc))), "").strip()
            before = collections.Counter(counters["graph_break"])
            compiled, rep = _compiled_step(model, inputs, backend, outside, fullgraph=False)
            # breaks inside the frames Dynamo traced (a frame it cannot trace at all runs eagerly, not counted here)
            in_frames = sorted({_first_line(reason) for reason in counters["graph_break"] - before})
    except Exception as exc:  # noqa: BLE001 - the backend fails
        return {"family": family, "status": f"compile fails: {type(exc).__name__}: {_first_line(exc)}"}
    finally:
        torch._dynamo.reset()
    layers = {}
    if outside:  # every experts layer: rewritten, or the reason explain gives
        from moe_compile.api import account_expert_layers

        layers = account_expert_layers(model, rep)
    rewritten = sorted({r.layer for r in rep.rewrites if r.pass_name in ("fuse_dispatch", "strip_host_padding")})
    left = sorted({f"{r.layer}: {r.what} @ {r.detail}" for r in rep.left if "(embedding)" not in r.what})
    ok, worst, unjudged = _within_bound(compiled, eager, ref32)
    noise = "bf16 eager"
    if not ok and backend != "inductor":
        # plain Inductor computes the same graph with its own upcasts and fusions: where it is as far from
        # fp32 as we are, that distance is this model's compile noise, not the rewrite's error. A family outside
        # the interface may break where moe_compile's swapped model does not (DBRX's loop over `nonzero()`)
        torch._dynamo.reset()
        try:
            inductor = _loss_and_grads(plain, inputs, torch.compile(plain, fullgraph=not (breaks or outside)))
        finally:
            torch._dynamo.reset()
        ok, worst, unjudged = _within_bound(compiled, eager, ref32, inductor)
        noise = "bf16 eager + plain Inductor"
    # translation validation is on (the default): a refusal is a wrong rewrite or a wrong judge, both ours
    refused = sorted({f"{r.pass_name} {r.layer}: {r.detail}" for r in rep.skips if r.what == "validation_failed"})
    unchecked = sorted({f"{r.pass_name} {r.layer}: {r.detail}" for r in rep.unchecked})
    return {"family": family, "status": "ok", "rewritten": rewritten, "left": left, "numerics": ok,
            "refused": refused, "unchecked": unchecked,
            "worst": f"{worst[0]} ({worst[1]:.2f} of bound)", "noise": noise, "unjudged": unjudged,
            "records": records_of(rep), "layers": layers, "graph_breaks": breaks, "break_context": context,
            "breaks_in_frames": in_frames}


def _compiled_step(model: torch.nn.Module, inputs: dict[str, Any], backend: str, outside: bool, fullgraph: bool
                   ) -> tuple[tuple[torch.Tensor, dict[str, torch.Tensor]], Any]:
    """One step of ``model`` compiled by ``backend`` and the report of its compile. A family outside the experts
    interface goes through ``moe_compile.compile`` (as a user's would: expert loops Dynamo cannot capture are
    swapped first), the others through ``torch.compile(backend=...)``."""
    import moe_compile
    from moe_compile import report

    torch._dynamo.reset()
    fn = moe_compile.compile(model, fullgraph=fullgraph) if outside else \
        torch.compile(model, backend=backend, fullgraph=fullgraph)
    with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
        return _loss_and_grads(model, inputs, fn), rep


def _within_bound(compiled: Any, eager: Any, ref32: Any, inductor: Any = None
                  ) -> tuple[bool, tuple[str, float], list[str]]:
    """:func:`tests._tolerance.within_eager_bound` on ``(loss, grads)`` steps in bf16 (the loss always judged)."""
    from tests._tolerance import within_eager_bound

    def named(step: Any) -> dict[str, torch.Tensor]:
        return {"loss": step[0], **step[1]}

    return within_eager_bound(named(compiled), named(eager), named(ref32), named(inductor) if inductor else None)


# The path each family takes through moe_compile, as the supported-models table names it (NOTE [supported models])
PATHS = {
    "interface": "experts interface: the FX passes rewrite its dispatch",
    "swapped": "own experts code: swapped by `moe_compile.compile`",
    "left": "own experts code: left to Inductor, with a reason tag",
}


def _default_cpu_families() -> set[str]:
    """The families whose training step the default (not ``slow``) CPU run compiles, from the tests' own lists."""
    from tests.models import hf_models, test_deterministic, test_hf_families

    return {*test_hf_families.DEFAULT_FAMILIES, *test_hf_families.DEFAULT_OUTSIDE, *hf_models.FAMILIES,
            *(f for f in test_deterministic.FAMILIES if f not in test_deterministic.SLOW)}


def _gpu_tested() -> dict[str, list[str]]:
    """family -> how a GPU runs its training step: the bitwise-reproducible training of
    ``tests/models/test_deterministic_gpu.py``, and the devices of its timed step in
    ``benchmarks/results/train_determinism_*.json``."""
    import json

    root = pathlib.Path(__file__).resolve().parents[2]
    found: dict[str, list[str]] = collections.defaultdict(list)
    text = (root / "tests" / "models" / "test_deterministic_gpu.py").read_text()
    for family in re.findall(r'"(\w+)"', re.search(r'parametrize\("family", \[([^]]*)\]', text).group(1)):
        found[family].append("bitwise training")
    timed: dict[str, set[str]] = collections.defaultdict(set)
    for path in sorted((root / "benchmarks" / "results").glob("train_determinism_*.json")):
        data = json.loads(path.read_text())
        device = re.search(r"\b([A-Z]+\d{2,4})\b", data["env"]["device"])
        for row in data["rows"]:
            timed[row["model"]].add(device.group(1) if device else data["env"]["device"])
    for family, devices in timed.items():
        found[family].append("step timed on " + ", ".join(sorted(devices)))
    return dict(found)


def support_table() -> list[str]:
    """NOTE [supported models]: the README's supported-models table, family -> path taken -> tested on CPU / GPU,
    from what the installed transformers has (:func:`moe_families`, :func:`outside_interface_families`) and what the
    suite runs: :data:`PATHS` names the path (:data:`OUTSIDE`'s ``swapped`` decides between the two of a family
    outside the interface), "default run" the families of the tests' default lists (the rest run with ``-m slow``),
    :func:`_gpu_tested` the GPU column. Families that share all three are one row. ``tests/docs_tables.py`` writes it
    into the README; ``tests/test_docs.py`` checks the README's copy against this function (at the transformers that
    ``constraints.txt`` pins: another release has other families)."""
    default, gpu = _default_cpu_families(), _gpu_tested()
    groups: dict[tuple[str, str, str], list[str]] = {}
    for family in (*moe_families(), *outside_interface_families()):
        path = "interface" if family in moe_families() else "swapped" if OUTSIDE[family].swapped else "left"
        cpu = "default run" if family in default else "`-m slow`"
        groups.setdefault((path, cpu, "; ".join(gpu.get(family, [])) or "-"), []).append(family)
    order = list(PATHS)
    rows = sorted(groups.items(), key=lambda item: (order.index(item[0][0]), item[0][2] == "-",
                                                    item[0][1] != "default run", item[1]))
    lines = ["| families (transformers model type) | path taken | tested on CPU | tested on GPU |",
             "| --- | --- | --- | --- |"]
    for (path, cpu, on_gpu), families in rows:
        lines.append(f"| {', '.join(f'`{f}`' for f in sorted(families))} | {PATHS[path]} | {cpu} | {on_gpu} |")
    return lines


def main() -> None:
    """``python -m tests.models.hf_families [--json PATH] [family ...]``: the family table (one compiled training
    step per family); ``--support``: the README's supported-models table (:func:`support_table`, nothing run)."""
    import argparse
    import json
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("MOE_COMPILE_VALIDATE_ALL", "1")  # the matrix validates every rewrite, as the suite does
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("families", nargs="*")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--support", action="store_true", help="print the README's supported-models table")
    args = parser.parse_args()
    if args.support:
        print("\n".join(support_table()))
        return
    rows = []
    for family in args.families or (*moe_families(), *outside_interface_families()):
        row = check_family(family)
        rows.append(row)
        print(f"{family:24s} {row['status'][:70]:70s} rewritten={len(row.get('rewritten', []))} "
              f"left={len(row.get('left', []))} numerics={row.get('numerics')} {row.get('worst', '')} "
              f"refused={len(row.get('refused', []))} unchecked={len(row.get('unchecked', []))} "
              f"[noise: {row.get('noise', '-')}; unjudged: {', '.join(row.get('unjudged', [])) or '-'}]", flush=True)
        for item in row.get("left", []):
            print(f"    left: {item[:200]}", flush=True)
        for layer, outcome in row.get("layers", {}).items():
            print(f"    experts {layer}: {outcome or 'NO REASON'}", flush=True)
        if row.get("graph_breaks"):
            print(f"    graph breaks (fullgraph=False): {row['graph_breaks'][:200]} ({row['break_context']})",
                  flush=True)
        for reason in row.get("breaks_in_frames", []):
            print(f"    graph break in a traced frame: {reason}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        import transformers

        args.json.write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
