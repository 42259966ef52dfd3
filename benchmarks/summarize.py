"""The performance tables of ``docs/benchmarks.md`` and the README, written from the results files
(``benchmarks/results/*.json``).

* The full table (:func:`table`, in ``docs/benchmarks.md``): one row per results file, what it measures, its headline
  numbers (picked from its rows by the function for its benchmark in :data:`FORMATTERS`), and where they come from
  (file, device, versions, commit, date of the run).
* The README's headline table (:func:`headline`): the training step of each ``train_determinism_*.json`` model and
  the MoE blocks of ``moe_block.json``, each number with its device.
* Plots (:func:`plot`, when matplotlib imports), one figure per device and kind in ``docs/img/``: the training step
  per model (``train_step_<device>.png``) and the dispatch ops against the copy floor (``dispatch_<device>.png``).

Usage, from the repository root:

* ``python -m benchmarks.summarize [FILE ...]`` prints the full table (``run_gpu.sh`` prints it last, for the files
  that run wrote); without files, for every file in ``benchmarks/results/``.
* ``python -m benchmarks.summarize --write`` (or ``--readme``) rewrites the block between :data:`BEGIN` and
  :data:`END` in ``docs/benchmarks.md`` and the one between :data:`HEADLINE_BEGIN` and :data:`HEADLINE_END` in
  ``README.md``, and redraws the plots (skipped, with a line saying so, without matplotlib: ``pip install
  matplotlib``); ``--check`` fails when either block is not what the files give (the plots are not checked).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs" / "benchmarks.md"
IMG_DIR = REPO_ROOT / "docs" / "img"
BEGIN = "<!-- results:begin (python -m benchmarks.summarize --write writes this table) -->"
END = "<!-- results:end -->"
HEADLINE_BEGIN = "<!-- headline:begin (python -m benchmarks.summarize --write writes this table) -->"
HEADLINE_END = "<!-- headline:end -->"

Row = dict[str, Any]

MODELS = {"mixtral": "Mixtral-like", "qwen3_moe": "Qwen3-MoE-like", "qwen3": "Qwen3-MoE-like",
          "deepseek_v3": "DeepSeek-V3-like", "gpt_oss": "GPT-OSS-like", "mixtral_loop": "Mixtral-like ModuleList loop",
          "qwen3_moe_loop": "Qwen3-MoE-like loop"}


def _num(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _find(rows: list[Row], **match: Any) -> Row | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _get(rows: list[Row], field: str, **match: Any) -> Any:
    row = _find(rows, **match)
    return None if row is None else row.get(field)


def _ordered(rows: list[Row], key: str) -> list[Any]:
    return list(dict.fromkeys(r[key] for r in rows if key in r))


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not b or any(isinstance(v, float) and math.isnan(v) for v in (a, b)):
        return None
    return a / b


def _span(values: list[float | None], digits: int = 2) -> str:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    if not kept:
        return "-"
    low, high = _num(min(kept), digits), _num(max(kept), digits)
    return low if low == high else f"{low}-{high}"


def _unmeasured(row: Row) -> bool:
    """A row the benchmark wrote without timing it (NaN times: its time budget ran out first)."""
    return all(isinstance(row.get(k), float) and math.isnan(row[k]) for k in ("fwd_ms", "fwd_bwd_ms"))


def moe_block(rows: list[Row]) -> tuple[str, str]:
    parts = []
    for model in _ordered(rows, "model"):
        mine = {v: _find(rows, model=model, variant=v) for v in ("moe", "inductor", "moe_unfused")}
        if mine["moe"] is None or _unmeasured(mine["moe"]):
            continue  # a model the run's time budget left out
        text = f"{MODELS.get(model, model)} {_num(mine['moe']['fwd_ms'])} / {_num(mine['moe']['fwd_bwd_ms'])}"
        if mine["inductor"]:
            text += f" vs Inductor {_num(mine['inductor']['fwd_ms'])} / {_num(mine['inductor']['fwd_bwd_ms'])}"
        if mine["moe_unfused"]:
            text += (f", without `fuse_expert_mlp` {_num(mine['moe_unfused']['fwd_ms'])} / "
                     f"{_num(mine['moe_unfused']['fwd_bwd_ms'])}")
        parts.append(text)
    ours = [r for r in rows if r.get("variant") == "moe" and not _unmeasured(r)]
    deterministic = all(r.get("deterministic_fwd") and r.get("deterministic_bwd") for r in ours)
    return ("HF MoE blocks, bf16, T 4096, fwd / fwd+bwd ms, moe_compile vs plain Inductor",
            "; ".join(parts) + f". moe_compile bitwise deterministic fwd and bwd: {'yes' if deterministic else 'no'}")


def loops(rows: list[Row]) -> tuple[str, str]:
    parts = []
    for model in _ordered(rows, "model"):
        moe, ref = _find(rows, model=model, variant="moe"), _find(rows, model=model, variant="grouped_mm_moe")
        if moe is None or ref is None:
            continue
        if moe.get("paired_fwd_ms") is not None and ref.get("paired_fwd_ms") is not None:
            prefix, how = "paired_", "interleaved"
        else:
            prefix, how = "", "separately"
        fwd, fb = moe[f"{prefix}fwd_ms"], moe[f"{prefix}fwd_bwd_ms"]
        rfwd, rfb = ref[f"{prefix}fwd_ms"], ref[f"{prefix}fwd_bwd_ms"]
        text = (f"{MODELS.get(model, model)} {_num(fwd, 3)} / {_num(fb, 3)} vs {_num(rfwd, 3)} / {_num(rfb, 3)} "
                f"({_num(_ratio(fwd, rfwd))}x / {_num(_ratio(fb, rfb))}x, timed {how})")
        if moe.get("paired_host_fwd_bwd_ms") is not None:
            text += (f", host time per fwd+bwd {_num(moe['paired_host_fwd_bwd_ms'])} vs "
                     f"{_num(ref.get('paired_host_fwd_bwd_ms'))}")
        text += (f", deterministic {moe.get('deterministic_fwd')}/{moe.get('deterministic_bwd')}, strict CUDA-graph "
                 f"capture {moe.get('cuda_graph') or '-'}")
        parts.append(text)
    what = "expert loops, T 4096, fwd / fwd+bwd ms: moe_compile vs the same block on transformers' grouped_mm path"
    return (what + " under moe_compile", "; ".join(parts))


def host_cost(rows: list[Row]) -> tuple[str, str]:
    parts = []
    for layer in _ordered(rows, "layer"):
        mine = [r for r in rows if r.get("layer") == layer]
        if layer == "permute_pad":
            for config in _ordered(mine, "config"):
                eager = next((r for r in mine if r["config"] == config and r["variant"].startswith("eager (")), None)
                if eager:
                    parts.append(f"{config}: eager {_num(eager['wall_us'], 1)} us vs a copy floor of "
                                 f"{_num(eager['floor_us'], 1)} ({_num(_ratio(eager['wall_us'], eager['floor_us']))}x)")
            continue
        ratios = []
        for config in _ordered(mine, "config"):
            ratio = _ratio(_get(mine, "wall_us", config=config, variant="moe"),
                           _get(mine, "wall_us", config=config, variant="inductor"))
            if ratio is not None:
                ratios.append(f"{config.removeprefix(layer + ' ')} {_num(ratio)}")
        if ratios:
            parts.append(f"{layer}: " + ", ".join(ratios))
    return ("host cost, default mode, wall per call: moe_compile / plain Inductor (median of interleaved rounds)",
            "; ".join(parts))


def dispatch(rows: list[Row]) -> tuple[str, str]:
    parts = []
    for op in _ordered(rows, "op"):
        for direction in _ordered([r for r in rows if r["op"] == op], "direction"):
            mine = [r for r in rows if r["op"] == op and r["direction"] == direction]
            floors = [r["x_floor"] for r in mine if r["impl"] == "ours_graph"]
            speedups = [_ratio(_get(mine, "time_us", config=c, impl="inductor"),
                               _get(mine, "time_us", config=c, impl="ours_graph")) for c in _ordered(mine, "config")]
            text = f"`{op}` {direction} {_span(floors)}x of the copy floor"
            if any(s is not None for s in speedups):
                text += f", {_span(speedups, 1)}x faster than plain Inductor"
            parts.append(text)
    configs = ", ".join(_ordered(rows, "config"))
    return (f"dispatch ops under CUDA graphs ({configs})", "; ".join(parts))


def decode(rows: list[Row]) -> tuple[str, str]:
    parts = []
    for model in _ordered(rows, "model"):
        for T in _ordered([r for r in rows if r["model"] == model], "T"):
            times = {v: _get(rows, "time_us", model=model, T=T, variant=v) for v in ("moe_ro", "eager", "inductor")}
            shown = [f"{name} {_num(times[v], 0)}" for v, name in (("eager", "eager"), ("inductor", "Inductor"))
                     if times[v] is not None and not math.isnan(times[v])]
            parts.append(f"{MODELS.get(model, model)} T{T} {_num(times['moe_ro'], 0)} us vs " + ", ".join(shown))
    return ("host-padded decode step, `mode=\"reduce-overhead\"`, us", "; ".join(parts))


def grouped_gemm(rows: list[Row]) -> tuple[str, str]:
    parts = []
    for shape in [s for s in _ordered(rows, "shape") if s in MODELS]:
        times = []
        for T in sorted({r["T"] for r in rows if r.get("shape") == shape and r.get("what") == "block_fwd_bwd"}):
            us = [
                _get(rows, "us", shape=shape, T=T, what="block_fwd_bwd", impl=i) for i in ("cutlass", "triton", "auto")
            ]
            times.append(f"T{T} " + " / ".join(_num(u / 1e3 if u is not None else None) for u in us))
        if times:
            parts.append(f"{MODELS[shape]} " + ", ".join(times))
    text = "fwd+bwd ms, CUTLASS block / forced Triton / `auto`: " + "; ".join(parts)
    quant = [r for r in rows if r.get("shape") == "qwen3_moe_quant"]
    if quant:
        per_T = []
        for T in _ordered(quant, "T"):
            us = [_get(quant, "us", T=T, impl=i) for i in ("cutlass_bf16", "triton_bf16", "mxfp8", "nvfp4")]
            per_T.append(f"T{T} " + " / ".join(_num(u, 0) for u in us))
        text += (". Quantised Qwen3-like block forward, us, CUTLASS bf16 / Triton bf16 / MXFP8 / NVFP4: "
                 + ", ".join(per_T))
    return ("expert-GEMM blocks (`ops/expert_gemm.py`) vs a CUTLASS `_grouped_mm` block, eager ops", text)


def grouped_gemm_sweep(rows: list[Row]) -> tuple[str, str]:
    parts = []
    first = rows[0]["shape"]  # the shape the sweep is about (the table's Qwen3-like block): the others are many
    for key in dict.fromkeys((r["shape"], r["T"], r["what"], r["impl"]) for r in rows
                             if r.get("T") == 4096 and r.get("shape") == first):
        mine = [r for r in rows if (r["shape"], r["T"], r["what"], r["impl"]) == key]
        tried = [r for r in mine if r["cfg"] not in ("shipped", "cutlass") and not math.isnan(r["us"])]
        if not tried:
            continue
        best = min(tried, key=lambda r: r["us"])
        what, impl = key[2:]
        parts.append(f"{what.removeprefix('sweep_')}{'' if impl == 'plain' else ' ' + impl}: shipped "
                     f"{_num(_get(mine, 'us', cfg='shipped'), 0)}, best {_num(best['us'], 0)} ({best['cfg']}), CUTLASS "
                     f"{_num(_get(mine, 'us', cfg='cutlass'), 0)}")
    return (f"expert-GEMM tile sweep (`--sweep`), {MODELS.get(first, first)} T 4096, us", "; ".join(parts))


def grouped_weight(rows: list[Row]) -> tuple[str, str]:
    parts = []
    for impl in ("mxfp8", "nvfp4"):
        speedups = [f"T{T} {_num(_get(rows, 'speedup_vs_bf16', T=T, impl=impl))}x" for T in _ordered(rows, "T")]
        parts.append(f"{impl.upper()} " + ", ".join(speedups))
    return ("weight-only grouped GEMM, E128 H2048 I768, both expert GEMMs, vs bf16 `_grouped_mm`", "; ".join(parts))


def quant_block(rows: list[Row]) -> tuple[str, str]:
    impls = ("bf16", "mxfp8", "mxfp8_unfused", "nvfp4", "nvfp4_unfused")
    per_T = []
    for T in _ordered(rows, "T"):
        per_T.append(f"T{T} " + " / ".join(_num(_get(rows, "kernel_us", T=T, impl=i), 0) for i in impls))
    modes = ", ".join(f"T{T} {_get(rows, 'mode', T=T)}" for T in _ordered(rows, "T"))
    return ("quantised Qwen3-MoE block in inference, kernel us per forward",
            f"{' / '.join(impls)}: " + "; ".join(per_T) + f" (mode: {modes})")


def train_determinism(rows: list[Row]) -> tuple[str, str]:
    model = rows[0].get("model", "qwen3_moe")
    ranks = rows[0].get("world_size", 1)
    parts = [f"{r['variant']} {_num(r['step_ms'])} ms (gradients differing {r['grads_differ']} / {r['params']}"
             + (f", after AdamW {r['adamw_params_differ']}" if "adamw_params_differ" in r else "") + ")"
             for r in rows]
    where = f", FSDP2 over {ranks} GPUs" if ranks > 1 else ""
    return (f"{MODELS.get(model, model)} CausalLM training step{where}: step time, and what differs from run to run",
            "; ".join(parts))


def validation_cost(rows: list[Row]) -> tuple[str, str]:
    ok = [r for r in rows if "fraction" in r]
    parts = [f"{r['model']} {_num(100 * r['fraction'], 1)}% "
             f"({_num(r['validate_s'], 1)} of {_num(r['compile_s_on'], 1)} s)" for r in ok]
    refused = sum(r["refused"] for r in ok)
    return ("translation validation: time inside it / first compiled training step (compile + step)",
            "; ".join(parts) + f"; refused {refused}, unchecked {sum(r['unchecked'] for r in ok)}")


def attention(rows: list[Row]) -> tuple[str, str]:
    parts = []
    for shape in _ordered(rows, "shape"):
        for mask in _ordered([r for r in rows if r["shape"] == shape], "mask"):
            got = {r["variant"]: r for r in rows if r["shape"] == shape and r["mask"] == mask and "plan" not in r}
            ours = got.get("moe_masked_attention_compiled") or got.get("moe_masked_attention")
            cells = [f"{name} {_num(got[key]['ms'])}" for key, name in (
                ("sdpa_masked", "SDPA"), ("sdpa_masked_deterministic", "SDPA det."),
                ("moe_masked_attention_compiled", "ours"), ("sdpa_flash_is_causal", "flash causal")) if key in got]
            repro = "reproducible" if ours and ours["bitwise_reproducible"] else "NOT reproducible"
            parts.append(f"{shape} {mask}: " + " / ".join(cells) + f" ({repro})")
    return "masked attention fwd+bwd ms, bf16: SDPA (mem-efficient) / with the deterministic flag / " \
           "moe.masked_attention / flash is_causal", "; ".join(parts)


def capacity(rows: list[Row]) -> tuple[str, str]:
    parts = []
    variants = ("eager", "inductor", "moe_compile", "moe_compile_graphs")
    for style in _ordered(rows, "style"):
        mine = [r for r in rows if r["style"] == style]
        for shape in dict.fromkeys((r["T"], r["H"], r["E"]) for r in mine):  # in the file's order
            got = {r["variant"]: r for r in mine if (r["T"], r["H"], r["E"]) == shape}
            cells = " / ".join(_num(got[v]["step_ms"]) for v in variants if v in got)
            parts.append(f"{style} T {shape[0]} H {shape[1]} E {shape[2]}: {cells}")
    return ("capacity-factor, expert-choice and host-loop layers, training step ms: eager / plain Inductor / "
            "moe_compile (/ moe_compile under CUDA graphs, where run)", "; ".join(parts))


def ep(rows: list[Row]) -> tuple[str, str]:
    parts = []
    for model in _ordered(rows, "model"):
        got = {r["variant"]: r for r in rows if r["model"] == model}
        cells = " / ".join(_num(got[v]["step_ms"]) if v in got else "-" for v in EP_VARIANTS)
        text = f"{MODELS.get(model, model)} {cells}"
        ours = [got[v] for v in EP_VARIANTS[2:] if v in got]
        if ours and ours[0].get("ep_rewrites") is not None:
            text += f" (expert_parallel rewrites: {ours[0]['ep_rewrites']}"
            bitwise = [r["bitwise_10_steps"] for r in ours if r.get("bitwise_10_steps") is not None]
            if bitwise:
                text += f"; 10 AdamW steps bitwise: {'yes' if all(bitwise) else 'no'} ({len(bitwise)} variants)"
            text += ")"
        parts.append(text)
    return (f"expert parallelism over {rows[0]['W']} GPUs (TitanStyleEP decoder, 2 layers, 2 x 2048 tokens per rank), "
            "training step ms: eager / plain Inductor / moe_compile / ep_capacity_factor 1.25 / CUDA graphs / "
            "CUDA graphs at 1.25 (moe_compile deterministic=True)", "; ".join(parts))


def ep_transport(rows: list[Row]) -> tuple[str, str]:
    parts = []
    for model in _ordered(rows, "model"):
        got = [r for r in rows if r["model"] == model]
        cells = ", ".join(f"{r['transport']} {_num(r['ms'], 3)}" for r in got if r.get("ms") is not None)
        vdev = next((r for r in got if r["transport"] == "symm_mem_vdev"), {})
        checks = (f"; vdev rows as NCCL's: {vdev.get('same_rows_as_nccl')}, captured replay: "
                  f"{vdev.get('captured_replay_correct')}") if vdev else ""
        parts.append(f"{MODELS.get(model, model)} ({got[0]['rows_per_rank']} rows): {cells}{checks}")
    return (f"expert-parallel exchange alone over {rows[0]['W']} GPUs, ms per call (rows of 2048 bf16 per rank, "
            "uniform destinations)", "; ".join(parts))


def quack_gemm(rows: list[Row]) -> tuple[str, str]:
    parts = []
    for model, T in dict.fromkeys((r["model"], r["T"]) for r in rows):
        gemms = [r for r in rows if r["part"] == "gemm" and r["model"] == model and r["T"] == T]
        cells = ", ".join(f"{r['kind']} {_num(r['quack_ms'], 3)}/{_num(r['grouped_mm_ms'], 3)}" for r in gemms)
        block = [_get(rows, "fwd_bwd_kernel_ms", part="block", model=model, T=T, variant=v)
                 for v in ("quack", "moe", "inductor", "eager")]
        text = f"{MODELS.get(model, model)} T{T}: " + (f"GEMMs QuACK/`_grouped_mm` {cells}; " if cells else "")
        parts.append(text + "block " + " / ".join(_num(v) for v in block))
    return ("QuACK expert MLP (`ops/quack_gemm.py`): GPU kernel ms per GEMM kind, QuACK / `_grouped_mm`; the HF block "
            "fwd+bwd kernel ms, QuACK / today's moe_compile / plain Inductor / eager", "; ".join(parts))


EP_VARIANTS = ("eager", "inductor", "moe_compile", "moe_compile_cf1.25", "moe_compile_graphs",
               "moe_compile_graphs_cf1.25")


FORMATTERS: dict[str, Callable[[list[Row]], tuple[str, str]]] = {
    "moe_block": moe_block, "loops": loops, "host_cost": host_cost, "dispatch": dispatch, "decode": decode,
    "grouped_gemm": grouped_gemm, "grouped_gemm_sweep": grouped_gemm_sweep, "grouped_weight": grouped_weight,
    "quant_block": quant_block, "attention": attention, "train_determinism": train_determinism,
    "validation_cost": validation_cost, "capacity": capacity, "ep": ep, "ep_transport": ep_transport,
    "quack_gemm": quack_gemm,
}


def split_stem(stem: str) -> tuple[str | None, str]:
    """``(benchmark, configuration)`` of a results file's stem ``<benchmark>[_<configuration>]``: the longest name
    in :data:`FORMATTERS` it starts with (``None`` when there is none), and the rest."""
    names = [n for n in FORMATTERS if stem == n or stem.startswith(n + "_")]
    if not names:
        return None, stem
    name = max(names, key=len)
    return name, stem[len(name) + 1 :]


def _device(name: str | None) -> str:
    found = re.search(r"\b([A-Z]+\d{2,4})\b", name or "")
    return found.group(1) if found else (name or "?")


def source(path: pathlib.Path, env: dict[str, Any]) -> str:
    """``file, device, torch, triton, commit, date`` of one results file."""
    commit = (env.get("commit") or "?")[:7] + ("+dirty" if env.get("dirty") else "")
    date = (env.get("date") or "?")[:10]
    return (f"`{path.name}`, {_device(env.get('device'))}, torch {env.get('torch')}, triton {env.get('triton')}, "
            f"{commit}, {date}")


def table(paths: list[pathlib.Path]) -> list[str]:
    lines = ["| what | result | file, device, versions, commit, date |", "| --- | --- | --- |"]
    order = list(FORMATTERS)

    def key(path: pathlib.Path) -> tuple[int, str]:
        benchmark = split_stem(path.stem)[0]
        return (order.index(benchmark) if benchmark else len(order), path.stem)

    for path in sorted(paths, key=key):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            lines.append(f"| {path.name} | unreadable: {exc} | |")
            continue
        benchmark, configuration = split_stem(path.stem)
        rows = data.get("rows") or []
        if benchmark is None or not rows:
            what, result = path.stem, f"{len(rows)} rows"
        else:
            what, result = FORMATTERS[benchmark](rows)
            if configuration:
                what += f" (configuration `{configuration}`)"
        lines.append(f"| {what} | {result} | {source(path, data.get('env', {}))} |")
    return lines


def rewrite_block(path: pathlib.Path, lines: list[str], begin: str = BEGIN, end: str = END) -> str:
    """The text of ``path`` with the lines between the markers ``begin`` and ``end`` replaced by ``lines``."""
    text = path.read_text()
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"{path}: no {begin} ... {end} block")
    return text[: start + len(begin)] + "\n" + "\n".join(lines) + "\n" + text[stop:]


# train_determinism's variants, in the order the headline table and the plots show them (eager where a file has it)
TRAIN_VARIANTS = {"eager": "eager", "inductor": "plain Inductor", "inductor_det": "Inductor + deterministic algorithms",
                  "moe": "moe_compile", "moe_deterministic": "`deterministic=True`"}


def _load(paths: list[pathlib.Path], benchmark: str) -> list[tuple[pathlib.Path, dict[str, Any]]]:
    """``(path, data)`` of each readable results file of ``benchmark``, in name order."""
    found = []
    for path in sorted(paths):
        if split_stem(path.stem)[0] != benchmark:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if data.get("rows"):
            found.append((path, data))
    return found


def _train_label(rows: list[Row]) -> str:
    model = rows[0].get("model", "?")
    ranks = rows[0].get("world_size", 1)
    return MODELS.get(model, model) + (f", FSDP2 over {ranks} GPUs" if ranks > 1 else "")


def headline(paths: list[pathlib.Path]) -> list[str]:
    """The README's short tables: the training step of every ``train_determinism`` file and the MoE blocks of
    ``moe_block`` (the device of every number in its row)."""
    lines = []
    train = _load(paths, "train_determinism")  # "AdamW differ": plain Inductor / deterministic=True
    if train:
        shown = [v for v in TRAIN_VARIANTS if any(_find(d["rows"], variant=v) for _, d in train)]
        lines += ["| training step, ms (2-layer CausalLM, bf16, 2 x 2048 tokens) | "
                  + " | ".join(TRAIN_VARIANTS[v] for v in shown) + " | AdamW differ | device, file |",
                  "| --- |" + " ---: |" * len(shown) + " --- | --- |"]
        for path, data in sorted(train, key=lambda item: (item[1]["rows"][0].get("world_size", 1), item[0].name)):
            rows = data["rows"]
            cells = [_num(_get(rows, "step_ms", variant=v)) for v in shown]
            det = _find(rows, variant="moe_deterministic")
            base = _get(rows, "step_ms", variant="inductor")
            if det is not None and base:
                cells[shown.index("moe_deterministic")] = f"**{_num(det['step_ms'])}** ({_num(det['step_ms'] / base)}x)"
            repro = " / ".join(str(_get(rows, "adamw_params_differ", variant=v)) if _find(rows, variant=v) else "-"
                               for v in ("inductor", "moe_deterministic"))
            lines.append(f"| {_train_label(rows)} | " + " | ".join(cells)
                         + f" | {repro} | {_device(data['env'].get('device'))}, `{path.name}` |")
    block = [(p, d) for p, d in _load(paths, "moe_block") if p.stem == "moe_block"]
    if block:
        path, data = block[0]
        if lines:
            lines.append("")
        lines += ["| MoE block alone, fwd+bwd ms (bf16, T 4096) | plain Inductor | moe_compile | device, file |",
                  "| --- | ---: | ---: | --- |"]
        for model in _ordered(data["rows"], "model"):
            ours, ref = _find(data["rows"], model=model, variant="moe"), _find(data["rows"], model=model,
                                                                               variant="inductor")
            if ours is None or ref is None or _unmeasured(ours):
                continue
            ratio = _ratio(ref["fwd_bwd_ms"], ours["fwd_bwd_ms"])
            lines.append(f"| {MODELS.get(model, model)} | {_num(ref['fwd_bwd_ms'])} | **{_num(ours['fwd_bwd_ms'])}** "
                         f"({_num(ratio)}x faster) | {_device(data['env'].get('device'))}, `{path.name}` |")
    return lines


def plot(paths: list[pathlib.Path], out_dir: pathlib.Path = IMG_DIR) -> list[pathlib.Path]:
    """The plots of ``docs/benchmarks.md``, one figure per device and kind (the device in its title and file name):

    * ``train_step_<device>.png``: the ``train_determinism`` files' step times, each model a group of bars, one per
      variant of :data:`TRAIN_VARIANTS` any file of that device ran (eager where a file has it);
    * ``dispatch_<device>.png``: ``dispatch.json``'s ops (``permute_pad`` / ``unpad_unpermute``, forward and
      backward), each implementation's time over the copy floor per shape, on a log scale (1 = the floor).

    Needs matplotlib (an optional dependency): without it, raises ImportError."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    return _plot_train_step(plt, paths, out_dir) + _plot_dispatch(plt, paths, out_dir)


Loaded = list[tuple[pathlib.Path, dict[str, Any]]]


def _by_device(found: Loaded) -> dict[str, Loaded]:
    """``found`` (:func:`_load`'s files) by device, devices in name order."""
    by_device: dict[str, Loaded] = {}
    for path, data in found:
        by_device.setdefault(_device(data["env"].get("device")), []).append((path, data))
    return dict(sorted(by_device.items()))


def _when(files: Loaded) -> str:
    dates = sorted({(d["env"].get("date") or "?")[:10] for _, d in files})
    return dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"


def _save(plt: Any, fig: Any, path: pathlib.Path) -> pathlib.Path:
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def _plot_train_step(plt: Any, paths: list[pathlib.Path], out_dir: pathlib.Path) -> list[pathlib.Path]:
    written = []
    for device, files in _by_device(_load(paths, "train_determinism")).items():
        files.sort(key=lambda item: (item[1]["rows"][0].get("world_size", 1), item[0].name))
        variants = [v for v in TRAIN_VARIANTS if any(_find(d["rows"], variant=v) for _, d in files)]
        fig, ax = plt.subplots(figsize=(1.9 * len(files) + 2, 3.6))
        width = 0.8 / len(variants)
        for i, variant in enumerate(variants):
            xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(files))]
            ys = [_get(d["rows"], "step_ms", variant=variant) or 0.0 for _, d in files]
            bars = ax.bar(xs, ys, width, label=TRAIN_VARIANTS[variant].strip("`"))
            ax.bar_label(bars, labels=[_num(y, 1) if y else "" for y in ys], fontsize=6, padding=1)
        ax.set_xticks(range(len(files)), [_train_label(d["rows"]).replace(", ", "\n") for _, d in files], fontsize=8)
        ax.set_ylabel("training step, ms (lower is better)")
        missing = [TRAIN_VARIANTS[v].strip("`") for v in TRAIN_VARIANTS if v not in variants]
        ax.set_title(f"2-layer CausalLMs, bf16, 2 x 2048 tokens, one step = forward + backward: {device}\n"
                     f"(benchmarks/results/train_determinism_*.json, {_when(files)}"
                     + (f"; not run: {', '.join(missing)}" if missing else "") + ")", fontsize=9)
        ax.legend(fontsize=7, ncols=len(variants), loc="upper left")
        ax.margins(y=0.15)
        fig.tight_layout()
        written.append(_save(plt, fig, out_dir / f"train_step_{device}.png"))
    return written


# bench_dispatch's implementations, in the order the dispatch plot shows them ("floor" is the line at 1)
DISPATCH_IMPLS = {"ours_graph": "moe_compile ops, CUDA graph", "ours_eager": "moe_compile ops, eager",
                  "inductor": "plain Inductor", "torch_eager": "PyTorch eager (argsort, index_add)"}


def _plot_dispatch(plt: Any, paths: list[pathlib.Path], out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Only ``dispatch.json`` itself: its configurations (``dispatch_ours_*``) time our ops alone, at other commits."""
    written = []
    for device, files in _by_device([(p, d) for p, d in _load(paths, "dispatch") if p.stem == "dispatch"]).items():
        rows = [r for _, d in files for r in d["rows"]]
        configs = _ordered(rows, "config")
        impls = [i for i in DISPATCH_IMPLS if any(r["impl"] == i for r in rows)]
        panels = [(op, direction) for op in _ordered(rows, "op")
                  for direction in _ordered([r for r in rows if r["op"] == op], "direction")]
        ncols = 2
        nrows = math.ceil(len(panels) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(10, 2.7 * nrows + 1.0), sharey=True, squeeze=False)
        width = 0.8 / len(impls)
        for ax, (op, direction) in zip(axes.flat, panels, strict=False):
            mine = [r for r in rows if r["op"] == op and r["direction"] == direction]
            for i, impl in enumerate(impls):
                xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(configs))]
                ys = [_get(mine, "x_floor", config=c, impl=impl) or float("nan") for c in configs]
                bars = ax.bar(xs, ys, width, label=DISPATCH_IMPLS[impl], color=f"C{i}")
                ax.bar_label(bars, labels=[_num(y, 2 if y < 2 else 1) for y in ys], fontsize=6, padding=1)
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            floors = [_get(mine, "time_us", config=c, impl="floor") for c in configs]
            ax.set_xticks(range(len(configs)), [f"{c.replace('_', ' ')}\nfloor {_num(f, 0)} us"
                                                for c, f in zip(configs, floors, strict=True)], fontsize=7)
            ax.set_yscale("log")
            ax.set_title(f"{op} {direction}", fontsize=9)
            ax.margins(y=0.2)
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax in axes[:, 0]:
            ax.set_ylabel("time / copy floor (log)", fontsize=8)
        bandwidth = files[0][1]["env"].get("copy_bandwidth_GBps")
        floor = f"{_num(bandwidth, 0)} GB/s" if bandwidth else "the measured copy bandwidth"
        fig.suptitle(f"Dispatch ops, bf16, time over the copy floor (bytes read + written at {floor}; "
                     f"dashed line = the floor, lower is better): {device}\n"
                     f"(benchmarks/results/dispatch.json, {_when(files)})", fontsize=9)
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, fontsize=7, ncols=len(impls), loc="lower center")
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        written.append(_save(plt, fig, out_dir / f"dispatch_{device}.png"))
    return written


def _rel(path: pathlib.Path) -> str:
    """``path`` from the repository root where it is inside it."""
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=pathlib.Path, help="results files (default: benchmarks/results)")
    parser.add_argument("--write", "--readme", action="store_true",
                        help="rewrite docs/benchmarks.md's full table and README.md's headline table, redraw the plots")
    parser.add_argument("--check", action="store_true", help="fail when either table is stale")
    args = parser.parse_args(argv)
    paths = args.files or sorted(RESULTS_DIR.glob("*.json"))
    lines = table(paths)
    if args.write or args.check:
        if args.files:
            raise SystemExit("--write and --check read every results file: give no files")
        blocks = ((DOCS, rewrite_block(DOCS, lines)),
                  (README, rewrite_block(README, headline(paths), HEADLINE_BEGIN, HEADLINE_END)))
        stale = [path for path, new in blocks if new != path.read_text()]
        if args.check:
            for path in stale:
                print(f"{_rel(path)}'s results table is stale: run python -m benchmarks.summarize "
                      "--write")
            return 1 if stale else 0
        for path, new in blocks:
            path.write_text(new)
            print(f"rewrote the results table of {_rel(path)}")
        try:
            for path in plot(paths):
                print(f"drew {_rel(path)}")
        except ImportError:
            print("matplotlib is not installed: plots skipped (pip install matplotlib)")
        return 0
    print("\n==== summary ====")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
