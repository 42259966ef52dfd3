#!/usr/bin/env bash
# Runs every GPU test and every benchmark (one device call), then prints a short table last.
# Usage on a CUDA machine, from the repo root:  bash benchmarks/run_gpu.sh [all|tests|bench] [--quick]
# ("tests" / "bench" split the work in two when one call has less than ~15 minutes; BENCHES="moe_block loops"
# runs only those benchmarks, BUDGET_S gives each a time budget; TEST_PATHS="tests/ops tests/passes" runs a part of
# the GPU tests, which take ~10 minutes in all on the H100 since the wider expert-GEMM tiles (their compiles): more
# than one 600 s device call, so split them, e.g. TEST_PATHS="tests/models tests/ops tests/passes" then the rest.)
# Optional wheels (torchao, expecttest, hypothesis) in .whl/ are installed into /tmp/site first.
# Each benchmark runs as a module (python -m benchmarks.bench_<stem> --save) and writes
# benchmarks/results/<benchmark>[_<configuration>].json ({"env", "rows"}; env records the commit: on a device copy
# of the tree pass BENCH_COMMIT=<full hash>, as its .git, if any, may be older than the tree); the files this run wrote
# are copied to $OUT (when set) and summarised last.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# QuACK (the optional expert MLP, docs/quack.md) installed with --target /tmp/quack: its .pth is not read from there
[ -d /tmp/quack/quack ] && export PYTHONPATH=/tmp/quack:/tmp/quack/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
export PYTHONUNBUFFERED=1
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p benchmarks/results "$OUT_DIR"
python3 -c "import torch, triton; print(f'device={torch.cuda.get_device_name()} torch={torch.__version__} triton={triton.__version__}')"
status=0
started=$(mktemp); trap 'rm -f "$started"' EXIT  # results files newer than this one are this run's
if [ "$what" != bench ]; then
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -ra -m gpu -p no:cacheprovider ${TEST_PATHS:-tests} 2>&1 | tee "$OUT_DIR/gpu_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed|skipped" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$what" != tests ]; then
  for bench in benchmarks/bench_*.py; do
    stem=$(basename "$bench" .py); stem=${stem#bench_}
    if [ -n "${BENCHES:-}" ] && [[ " $BENCHES " != *" $stem "* ]]; then continue; fi
    extra=(); limit=240
    [ "$stem" = decode ] && extra=(--budget-s 150)
    # grouped GEMM: 9 shapes x fwd / fwd+bwd / per GEMM + quantised; Triton compiles are most of the time
    [ "$stem" = grouped_gemm ] && { extra=(--budget-s 170); limit=260; }
    # host cost: eager vs Inductor vs moe_compile per layer; compiles of the E=128 block and Inductor's compile of
    # the host-padded layer (~60 s) are the long part
    [ "$stem" = host_cost ] && { extra=(--budget-s 420); limit=510; }
    # validation cost: the first compiled training step with moe.validate off and on, three families and the CausalLM
    [ "$stem" = validation_cost ] && { extra=(--causal-lm --families qwen3_moe,mixtral,deepseek_v3); limit=420; }
    # training steps of up to four CausalLMs x four variants (compiles and 20 AdamW steps each): --models picks them
    [ "$stem" = train_determinism ] && limit=${TRAIN_LIMIT_S:-560}
    # the QuACK expert MLP (needs quack-kernels; per-GEMM rows, then the blocks: their compiles are the long part)
    [ "$stem" = quack_gemm ] && { extra=(--budget-s 330); limit=420; }
    # capacity layers at T 16384: eager's one-hot [T, E, C] einsums and 9 compiles per shape
    [ "$stem" = capacity ] && limit=420
    # expert parallelism: launches one process per GPU itself (NCCL, NVLink multicast off) and writes ep_w<W>.json;
    # prints a skip and writes nothing below 2 GPUs. Its budget skips the second model when the compiles run long;
    # EP_WORLD=W runs W ranks of a larger machine (default: every GPU)
    [ "$stem" = ep ] && { extra=(--budget-s ${EP_BUDGET_S:-300}); limit=$((${EP_BUDGET_S:-300} + 160)); }
    if [ -n "${BUDGET_S:-}" ] && grep -q -- "--budget-s" "$bench"; then extra=(--budget-s "$BUDGET_S"); limit=$((BUDGET_S + 90)); fi
    echo "=== $bench"
    # the exchange alone: NCCL exact / padded vs symmetric-memory all_to_all_vdev (ep_transport_w<W>.json)
    [ "$stem" = ep_transport ] && { extra=(--budget-s 150); limit=200; }
    [[ "$stem" = ep* ]] && [ -n "${EP_WORLD:-}" ] && extra+=(--world "$EP_WORLD")
    timeout $limit python3 -m "benchmarks.bench_$stem" --save "${extra[@]}" "$@" > "/tmp/bench_$stem.log" 2>&1 || status=1
    grep -v Warning "/tmp/bench_$stem.log" | tail -4
  done
  written=$(find benchmarks/results -maxdepth 1 -name '*.json' -newer "$started" | sort)
  if [ -n "$written" ]; then
    # one path per word: results file names have no spaces
    [ "$OUT_DIR" != benchmarks/results ] && cp $written "$OUT_DIR/"
    python3 -m benchmarks.summarize $written
  fi
fi
exit $status
