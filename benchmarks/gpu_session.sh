#!/usr/bin/env bash
# One GPU-machine session: install the carried wheels, run the GPU tests, the attention
# benchmark and (optionally) the Triton tuning sweep. Logs and results go under $OUT.
# Usage (device tool): bash benchmarks/gpu_session.sh [tests] [bench] [tune] [conformance]
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export FLASHINFER_WORKSPACE_BASE="$PWD/.fi-cache"
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || true
for step in "$@"; do
  case "$step" in
    tests)
      python3 -m pytest -q -p no:cacheprovider tests/backends/attention 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    conformance)
      for b in ${CONF_BACKENDS:-triton flashinfer torch_native}; do
        python3 -m execrt conformance attention "$b" --json "$OUT/conformance-attention-$b.json" \
          2>&1 | tee "$OUT/conformance-$b.log" | grep -v " passed \| skipped " | tail -15
      done ;;
    bench)
      python3 -m execrt bench attention --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -30 ;;
    tune)
      timeout 300 python3 benchmarks/tune_triton_decode.py "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | tail -40 ;;
  esac
done
# Bring the FlashInfer JIT cache home so the next session can carry it instead of compiling.
tar -C "$FLASHINFER_WORKSPACE_BASE" -czf "$OUT/fi-cache.tgz" . 2>/dev/null || true
