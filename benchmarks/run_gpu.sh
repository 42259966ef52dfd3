#!/usr/bin/env bash
# Runs every GPU test and every benchmark in one go (one device call), then prints a short table.
# Usage on a CUDA machine, from the repo root:  bash benchmarks/run_gpu.sh [--quick]
# Optional wheels (torchao, expecttest, hypothesis) in .whl/ are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p benchmarks/results "$OUT_DIR"
python3 - <<'PY'
import torch, triton
print(f"device={torch.cuda.get_device_name()} torch={torch.__version__} triton={triton.__version__}")
PY
status=0
python3 -m pytest -q -ra -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
for bench in benchmarks/bench_*.py; do
  stem=$(basename "$bench" .py); stem=${stem#bench_}
  echo "=== $bench"
  timeout 300 python3 "$bench" --json "benchmarks/results/$stem.json" "$@" 2>&1 | tail -60 || status=1
  [ -f "benchmarks/results/$stem.json" ] && cp "benchmarks/results/$stem.json" "$OUT_DIR/" 2>/dev/null
done
python3 benchmarks/summarize.py benchmarks/results/*.json
exit $status
