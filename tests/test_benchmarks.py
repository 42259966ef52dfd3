"""The benchmarks' results files and scripts (CPU, no benchmark is run): one schema for every results file, no
run-ordinal file names, no ``sys.path`` edits, and performance tables (docs/benchmarks.md's full one, the README's
headline) that match the files."""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = sorted((BENCHMARKS / "results").glob("*.json"))
ENV_KEYS = ("device", "torch", "triton", "commit", "dirty", "date", "command")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth", "eighteenth",
            "nineteenth", "twentieth", "repeat")
SCALAR = (str, int, float, bool, type(None))


def test_there_are_results():
    assert RESULTS, "benchmarks/results/ holds no results file"


def test_env_keys_match_the_writer():
    from benchmarks._bench_env import ENV_KEYS as written

    assert tuple(written) == ENV_KEYS


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_results_file_schema(path):
    data = json.loads(path.read_text())
    assert set(data) == {"env", "rows"}, f"{path.name}: top-level keys {sorted(data)}"
    env, rows = data["env"], data["rows"]
    assert isinstance(env, dict)
    assert [k for k in ENV_KEYS if k not in env] == [], f"{path.name}: env lacks keys"
    assert isinstance(env["device"], str) and env["device"]
    if env["commit"] is not None:
        assert re.fullmatch(r"[0-9a-f]{40}", env["commit"]), env["commit"]
    if env["date"] is not None:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}[+-]\d{2}:\d{2}", env["date"]), env["date"]
    assert isinstance(rows, list) and rows, f"{path.name}: rows must be a non-empty list"
    for row in rows:
        assert isinstance(row, dict) and row
        for key, value in row.items():
            values = value if isinstance(value, list) else [value]
            assert all(isinstance(v, SCALAR) for v in values), f"{path.name}: {key} is not flat"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_results_file_name_has_no_run_ordinal(path):
    words = path.stem.split("_")
    assert not set(words) & set(ORDINALS), f"{path.name}: name the configuration, not the run (git keeps history)"
    assert len(words[-1]) > 1, f"{path.name}: a one-letter suffix (_b) names a run, not a configuration"
    assert not re.search(r"\d+(st|nd|rd|th)$", path.stem)


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_benchmark_scripts_do_not_edit_sys_path(path):
    edits = re.findall(r"sys\.path\s*(?:\.\w+\(|\[|\+?=)", path.read_text())
    assert not edits, f"{path.name}: import through the benchmarks package instead of editing sys.path"


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_cite_only_current_results_files(path):
    cited = set(re.findall(r"`([\w]+\.json)`", path.read_text()))
    names = {p.name for p in RESULTS}
    assert cited <= names, f"{path.name} cites results files that do not exist: {sorted(cited - names)}"


def test_performance_tables_are_current():
    """docs/benchmarks.md's full table and the README's headline table are what ``benchmarks.summarize`` writes."""
    from benchmarks import summarize

    assert summarize.main(["--check"]) == 0


def test_stale_table_is_caught(tmp_path, monkeypatch):
    """``--check`` fails on a table that is not the files' (so a passing check means something)."""
    from benchmarks import summarize

    readme = tmp_path / "README.md"
    readme.write_text(summarize.README.read_text().replace("| Mixtral-like |", "| Mixtral-like (edited) |", 1))
    monkeypatch.setattr(summarize, "README", readme)
    assert summarize.main(["--check"]) == 1


def test_headline_names_the_device_of_every_number():
    """Each row of the README's headline tables ends with its device and results file."""
    from benchmarks import summarize

    rows = [line for line in summarize.headline(RESULTS) if line.startswith("| ") and "---" not in line]
    data = [line for line in rows if not line.startswith(("| training step", "| MoE block"))]
    assert len(data) >= 5, rows
    for line in data:
        device, name = re.search(r"\| (\S+), `([\w]+\.json)` \|$", line).groups()
        env = json.loads((BENCHMARKS / "results" / name).read_text())["env"]
        assert device in env["device"], (line, env["device"])


def test_plot_draws_one_figure_per_device(tmp_path):
    """The plots (matplotlib is optional: skipped without it), one PNG per device and kind, named after both: the
    training step of the ``train_determinism`` files, the dispatch ops of ``dispatch.json``; and the ones in docs/img
    are those, each linked from docs/benchmarks.md."""
    pytest.importorskip("matplotlib")
    from benchmarks import summarize

    written = summarize.plot(RESULTS, tmp_path)

    def devices(match):
        return {summarize._device(json.loads(p.read_text())["env"]["device"]) for p in RESULTS if match(p.stem)}

    expected = sorted([f"train_step_{d}.png" for d in devices(lambda s: s.startswith("train_determinism"))]
                      + [f"dispatch_{d}.png" for d in devices(lambda s: s == "dispatch")])
    assert sorted(p.name for p in written) == expected
    assert any(name.startswith("dispatch_") for name in expected)
    assert sorted(p.name for p in (ROOT / "docs" / "img").glob("*.png")) == expected
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert [name for name in expected if f"(img/{name})" not in docs] == []
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_write_results_round_trip(tmp_path):
    import argparse

    from benchmarks import _bench_env

    parser = argparse.ArgumentParser()
    _bench_env.add_results_args(parser)
    args = parser.parse_args(["--save", "--results-dir", str(tmp_path), "--tag", "small"])
    path = _bench_env.results_path(args, "loops", "cpu_smoke")
    assert path == tmp_path / "loops_cpu_smoke_small.json"
    env = _bench_env.device_env(device="cpu (test)", wall_s=1.0)
    _bench_env.write_results(path, [{"model": "m", "fwd_ms": math.nan, "rounds": [1.0, 2.0]}], env)
    data = json.loads(path.read_text())
    assert data["env"]["wall_s"] == 1.0 and data["env"]["command"]
    with pytest.raises(TypeError):
        _bench_env.write_results(path, [{"nested": {"a": 1}}], env)


def test_bench_commit_must_be_the_full_hash(monkeypatch):
    """A device run names its commit by ``BENCH_COMMIT``; a short hash is refused at once (the results schema wants
    40 hex digits: three results files of 2026-11-28 failed CI with ``f95ee66``)."""
    from benchmarks._bench_env import git_state

    monkeypatch.setenv("BENCH_COMMIT", "f95ee66")
    with pytest.raises(ValueError, match="BENCH_COMMIT='f95ee66'"):
        git_state()
    full = "f95ee6695f8d145507b5b58c34ac91d7c49fd05a"
    monkeypatch.setenv("BENCH_COMMIT", full)
    assert git_state() == (full, None)


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous n", "optimizer"),
    ("void at::native::(anonymous namespace)::fused_adamw_kernel", "optimizer"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<1", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1", "attention"),
    ("_masked_attention_dkdv_kernel", "attention"),
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13Ge", "gemm"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("_expert_gemm_kernel", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("triton_poi_fused_index_select_new_zeros_where_6", "other"),
    ("void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<at_cuda_detail", "other"),
])
def test_ep_kernel_kinds(name, kind):
    """``bench_ep`` splits a step's kernel time by kind from the kernels' names, as the profiler gives them."""
    from benchmarks.bench_ep import _kernel_kind

    assert _kernel_kind(name) == kind
