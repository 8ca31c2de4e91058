#!/usr/bin/env bash
# One GPU-machine session, in steps run in the order given. Logs and results go under $OUT;
# a short table per step is printed last. Usage (device tool):
#   bash benchmarks/gpu_session.sh [tests] [tests2] [conformance] [bench-attention] [bench-extend]
#        [bench-moe] [bench-decode] [bench-prefix] [bench-serve] [serve-frontend] [bench-throughput] [bench-sampling] [diag-sampling] [bench-fp8] [gemv-chain]
#        [gemv-apply] [table-old] [table-new]
#        [harness] [step-phases] [profile-extend] [fi-precompile] [fi-start-times] [tune-moe] [tune-linear] [tune-extend]
#        [tune-decode] [probe-nccl-ep]
# Environment: TESTS (pytest selection, default tests/ and the example plugin), TESTS2, WORKERS
#   (TESTS_SKIP_DONE: tests-done.txt files earlier calls brought back, or files of node ids such
#   as benchmarks/results/gpu-tests-done-<date>.txt, ':'-separated; what they list as passed or
#   skipped is deselected; never re-archive $OUT yourself: the logs.tgz below carries the list)
#   (pytest-xdist, default 8), TESTS_TIMEOUT (s, default 420), DECODE_MODELS (default
#   "qwen3-0.6b qwen3-8b qwen3-30b-a3b:4"), DECODE_ARGS / MOE_ARGS / EXTEND_ARGS / TUNE_ARGS,
#   TESTS_ORDER=reverse (collection back to front), TESTS_K (a -k expression for the tests step),
#   TUNE_DECODE_ARGS ("short": the split policy on short contexts; "tiles": the stage-1 tiles per
#   KV dtype at bs 1/32/128 x ctx 512/8192, tables for execrt/kernels/attention/decode_configs/),
#   TUNE_LINEAR_ARGS, TUNE_EXTEND_ARGS, CONF_S (s per conformance run, default 560: the call's rest)
#   (e.g. "--head-dim 64; --head-dim 256 --dtype float16": one sweep per ';'-separated set; each
#   merges its entry into the tuned table, which comes back as extend-table-<GPU>.json), TESTS_FAILLOG.
set -u -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# WHEELS: the carried folder of wheels (.whl; a smaller one leaves room for the JIT cache parts).
WHEELS=${WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
# The two plugin distributions the tests discover through entry points (as CI installs them).
python3 -m pip install -q --no-deps --no-build-isolation --no-index \
  -e tests/entrypoint_plugin -e examples/execrt-example-plugin >/dev/null 2>&1 || echo "plugin install failed"
export FLASHINFER_WORKSPACE_BASE="$PWD/.fi-cache"
# FlashInfer's JIT runs `ninja` from PATH: benchmarks/bin/ninja keeps each module's build log
# beside it (one shared log, rewritten by parallel builds, lost records and rebuilt modules).
export PATH="$PWD/benchmarks/bin:$PATH"
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
if [ -f .fi-cache.tgz ]; then tar -C "$FLASHINFER_WORKSPACE_BASE" -xzf .fi-cache.tgz || true; fi
# A cache brought back in parts (see the end): carry .fi-cache-parts/, holding them in order.
if ls .fi-cache-parts/fi-cache.part*.tgz >/dev/null 2>&1; then
  cat .fi-cache-parts/fi-cache.part*.tgz | tar -C "$FLASHINFER_WORKSPACE_BASE" -xz || true
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || true
summary="$OUT/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
# Every step is cut to what is left of BUDGET_S (default 560 s: a device call allows 600).
deadline=$(( $(date +%s) + ${BUDGET_S:-560} ))
cap() { local left=$(( deadline - $(date +%s) - 10 )); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
# This GPU's bf16 skinny-GEMM table, as the kernels look it up (gemv-apply, table-old/new).
linear_table() {
  echo "execrt/kernels/linear_configs/$(python3 -c "import torch; from execrt.kernels._triton import tuned_table_name as t; print(t(torch.cuda.get_device_name(0), torch.bfloat16))")"
}
for step in "$@"; do
  start=$(date +%s)
  case "$step" in
    tests|tests2)  # tests2: a second selection (TESTS2), e.g. what a first one did not reach
      sel=${TESTS:-tests examples/execrt-example-plugin/tests}
      limit=${TESTS_TIMEOUT:-420}
      [ "$step" = tests2 ] && sel=${TESTS2:?TESTS2 names the second selection} && limit=${TESTS2_TIMEOUT:-$limit}
      # TESTS_K: a -k expression with spaces ("gqa5 or gqa7"), which $sel's word splitting breaks
      kexpr=()
      [ -n "${TESTS_K:-}" ] && [ "$step" = tests ] && kexpr=(-k "$TESTS_K")
      # SIGINT at the limit: pytest still prints its summary and slowest tests; the time log
      # lists every finished test, and TESTS_SKIP_DONE=<that log> runs only the rest next call.
      TESTS_FAILLOG="$OUT/test-failures.log" TESTS_TIMELOG="$OUT/tests-done.txt" \
        timeout -s INT -k 30 "$(cap "$limit")" \
        python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" -rfEs --durations=25 \
        $sel "${kexpr[@]}" 2>&1 | tee "$OUT/$step.log" | tail -40
      note "$step: $(tail -1 "$OUT/$step.log")" ;;
    conformance)
      for kb in ${CONF:-attention:triton attention:flashinfer attention:torch_native moe_dispatch:allreduce moe_dispatch:all_to_all moe_dispatch:all_to_all_fixed graph:full_cuda_graph}; do
        k=${kb%%:*}; b=${kb#*:}
        # cut to the call's budget (a cold FlashInfer JIT cache compiles for minutes), so the
        # steps after it and the cache archive at the end still run
        timeout -s INT -k 20 "$(cap ${CONF_S:-560})" \
          python3 -m execrt conformance "$k" "$b" --json "$OUT/conformance-$k-$b.json" -p no:cacheprovider \
          > "$OUT/conformance-$k-$b.log" 2>&1
        note "conformance $k $b: $(tail -1 "$OUT/conformance-$k-$b.log")"
      done ;;
    bench-attention)
      timeout "$(cap 200)" python3 -m execrt bench attention --out "$OUT" 2>&1 | tee "$OUT/bench-attention.log" | tail -12 ;;
    bench-extend)
      timeout "$(cap 240)" python3 -m execrt bench extend --out "$OUT" ${EXTEND_ARGS:-} 2>&1 | tee "$OUT/bench-extend.log" | tail -12 ;;
    bench-moe)
      timeout "$(cap 240)" python3 -m execrt bench moe --out "$OUT" ${MOE_ARGS:-} 2>&1 | tee "$OUT/bench-moe.log" | tail -16 ;;
    bench-decode)  # DECODE_ENVS: ';'-separated environment settings, one run of each model per
      # set (an A/B of one RuntimeConfig key, e.g. "EXECRT_TRITON_DECODE_MERGE=separate;EXECRT_TRITON_DECODE_MERGE=fused")
      IFS=';' read -ra envs <<< "${DECODE_ENVS:-}"
      [ "${#envs[@]}" -eq 0 ] && envs=("")
      for e in "${envs[@]}"; do
        for m in ${DECODE_MODELS:-qwen3-0.6b qwen3-8b qwen3-30b-a3b:4}; do
          name=${m%%:*}; layers=""
          [ "$name" != "$m" ] && layers="--layers ${m#*:}"
          echo "# bench decode $name ${e:-(environment as is)}" | tee -a "$OUT/bench-decode-$name.log"
          timeout "$(cap 400)" env $e python3 -m execrt bench decode --model "$name" $layers --out "$OUT" ${DECODE_ARGS:-} \
            2>&1 | tee -a "$OUT/bench-decode-$name.log" | tail -14
        done
      done ;;
    tune-moe)
      timeout "$(cap 330)" python3 benchmarks/tune_fused_moe.py --out "$OUT" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune-moe.log" | tail -20
      # The table's name (E=..,N=..) has characters the device tool does not bring back.
      for f in "$OUT"/E=*.json; do [ -f "$f" ] && mv "$f" "$OUT/tune-moe-$(basename "$f" | tr -c 'A-Za-z0-9_.\n-' _)"; done ;;
    tune-linear)
      timeout "$(cap 330)" python3 benchmarks/tune_skinny_linear.py --out "$OUT" ${TUNE_LINEAR_ARGS:-} 2>&1 | tee "$OUT/tune-linear.log" | tail -80
      for f in "$OUT"/device_name=*.json; do [ -f "$f" ] && mv "$f" "$OUT/tune-linear-$(basename "$f" | tr -c 'A-Za-z0-9_.\n-' _)"; done ;;
    tune-extend)  # TUNE_EXTEND_ARGS: argument sets separated by ';', one sweep each
      IFS=';' read -ra sets <<< "${TUNE_EXTEND_ARGS:- }"
      for args in "${sets[@]}"; do
        tag=$(echo "$args" | tr -c 'A-Za-z0-9\n' _ | sed 's/^_*//; s/_*$//')
        timeout "$(cap 300)" python3 benchmarks/tune_triton_extend.py "$OUT/tune-extend${tag:+-$tag}.json" $args \
          2>&1 | tee "$OUT/tune-extend${tag:+-$tag}.log" | tail -14
      done
      # The tuned table the kernels now read (a later bench-extend step in this call uses it);
      # commit it as execrt/kernels/attention/extend_configs/<its name without the prefix>.
      for f in execrt/kernels/attention/extend_configs/*.json; do
        [ -f "$f" ] && cp "$f" "$OUT/extend-table-$(basename "$f")"
      done ;;
    tune-decode)  # TUNE_DECODE_ARGS: "short", or "tiles [--kv-dtypes fp8_e4m3,auto]" (tile tables)
      timeout "$(cap 300)" python3 benchmarks/tune_triton_decode.py "$OUT/tune-decode.json" ${TUNE_DECODE_ARGS:-} 2>&1 | tee "$OUT/tune-decode.log" | tail -40
      # Installed for the later steps of this call (bench-fp8 reads them), then renamed to come back.
      for f in "$OUT"/device_name=*.json; do
        [ -f "$f" ] || continue
        mkdir -p execrt/kernels/attention/decode_configs && cp "$f" execrt/kernels/attention/decode_configs/
        mv "$f" "$OUT/tune-decode-$(basename "$f" | tr -c 'A-Za-z0-9_.\n-' _)"
      done ;;
    bench-prefix)  # PREFIX_ARGS, e.g. "--caches on,off --layers 12"
      timeout "$(cap ${PREFIX_S:-240})" python3 -m execrt bench prefix --out "$OUT" ${PREFIX_ARGS:-} 2>&1 | tee "$OUT/bench-prefix.log" | tail -24 ;;
    bench-serve)  # SERVE_ARGS, e.g. "--model qwen3-0.6b --max-concurrency 1,32,256"
      timeout "$(cap ${SERVE_S:-200})" python3 -m execrt bench serve --out "$OUT" ${SERVE_ARGS:-} 2>&1 | tee "$OUT/bench-serve.log" | tail -16 ;;
    serve-frontend)  # FRONTEND_ARGS, e.g. "--streams 1,32,256 --engine thread" (CPU only)
      timeout "$(cap ${FRONTEND_S:-90})" python3 benchmarks/serve_frontend.py ${FRONTEND_ARGS:-} 2>&1 | tee "$OUT/serve-frontend.log" | tail -8 ;;
    diag-sampling)  # DIAG_SAMPLING_ARGS, e.g. "--batch 256 --race-regs 0,80": race vs finish per knob
      (cd benchmarks && timeout "$(cap ${DIAG_SAMPLING_S:-150})" python3 diag_sampling_stages.py \
        --out "$OUT/sampling-stages-$(date -u +%Y%m%d-%H%M%S).json" ${DIAG_SAMPLING_ARGS:-}) 2>&1 \
        | tee "$OUT/diag-sampling.log" | tail -60 ;;
    bench-sampling)  # SAMPLING_ARGS, e.g. "--batches 1,256 --logits flat": the fused draw vs torch
      timeout "$(cap ${SAMPLING_S:-240})" python3 benchmarks/bench_sampling.py --out "$OUT/sampling-$(date -u +%Y%m%d-%H%M%S).json" ${SAMPLING_ARGS:-} 2>&1 | tee "$OUT/bench-sampling.log" | tail -40 ;;
    gemv-chain)  # GEMV_CHAIN_ARGS: benchmarks/gemv_chain.py argument sets, ';'-separated (e.g.
      # "--model qwen3-0.6b; --rows 8 --shapes qkv,down"); GEMV_CHAIN_S: seconds per set (its
      # tiles compile first: ~200 s for a one-row set of the 0.6B). JSON per set under $OUT.
      IFS=';' read -ra sets <<< "${GEMV_CHAIN_ARGS:---model qwen3-0.6b}"
      n=0
      for args in "${sets[@]}"; do
        n=$((n + 1))
        timeout "$(cap ${GEMV_CHAIN_S:-240})" python3 benchmarks/gemv_chain.py $args \
          --json "$OUT/gemv-chain-$n.json" 2>&1 | tee -a "$OUT/gemv-chain.log" | tail -40
      done
      note "gemv-chain: ${#sets[@]} set(s), JSON in $OUT/gemv-chain-N.json" ;;
    gemv-apply)  # the one-row winners of this call's gemv-chain step into this GPU's table (in the
      # tree: the steps after it run with it); it comes back as linear-table-<GPU>.json, and
      # table-old / table-new steps switch between the two for an A/B in the same call
      table=$(linear_table)
      cp "$table" /tmp/linear-table-old.json
      python3 benchmarks/apply_gemv_chain.py "$OUT"/gemv-chain-*.json --table "$table" 2>&1 | tee "$OUT/gemv-apply.log"
      cp "$table" /tmp/linear-table-new.json
      cp "$table" "$OUT/linear-table-$(basename "$table" | tr -c 'A-Za-z0-9_.\n-' _)" ;;
    table-old|table-new)
      cp "/tmp/linear-${step}.json" "$(linear_table)" ;;
    bench-throughput)  # THROUGHPUT_ARGS, e.g. "--configs defaults --temperatures 0.6,0"
      timeout "$(cap ${THROUGHPUT_S:-300})" python3 -m execrt bench throughput --out "$OUT" ${THROUGHPUT_ARGS:-} 2>&1 | tee "$OUT/bench-throughput.log" | tail -12 ;;
    bench-fp8)  # FP8_ARGS: bench decode arguments, sets separated by ';' (one run each, e.g. one
      # per context length); auto and the fp8 dtype are timed in each run. FP8_S: seconds per run.
      IFS=';' read -ra sets <<< "${FP8_ARGS:---model qwen3-8b --bs 1,128 --ctx 512}"
      for args in "${sets[@]}"; do
        timeout "$(cap ${FP8_S:-200})" python3 -m execrt bench decode --kv-dtype fp8_e4m3 --modes graph --no-hf --ttft none --out "$OUT" $args 2>&1 | tee -a "$OUT/bench-fp8.log" | tail -16
      done ;;
    harness)  # HARNESS_ARGS: benchmarks/harness_generate.py argument sets, ';'-separated (issue 29's
      # second harness: a transformers checkpoint on disk, Engine(path) with its defaults)
      IFS=';' read -ra sets <<< "${HARNESS_ARGS:-throughput --temperature 0.6,0 --repeats 2;decode}"
      for args in "${sets[@]}"; do
        read -r what _ <<< "$args"
        timeout "$(cap ${HARNESS_S:-240})" python3 benchmarks/harness_generate.py $args \
          --out "$OUT/harness-$what-$(date -u +%Y%m%d-%H%M%S).json" 2>&1 | tee -a "$OUT/harness.log" | grep -v "^Writing" | tail -12
      done ;;
    step-phases)  # PHASES_ARGS, e.g. "--model qwen3-0.6b --bs 1 8 128 --sync-debug": host phases per decode step
      timeout "$(cap ${PHASES_S:-200})" python3 benchmarks/engine_step_phases.py ${PHASES_ARGS:-} 2>&1 | tee -a "$OUT/step-phases.log" | tail -60 ;;
    profile-extend)  # PROFILE_EXTEND_ARGS, e.g. "--model qwen3-0.6b --lens 32,418,2048": host vs GPU per prefill
      timeout "$(cap ${PROFILE_EXTEND_S:-120})" python3 benchmarks/profile_extend.py ${PROFILE_EXTEND_ARGS:-} 2>&1 | tee "$OUT/profile-extend.log" | tail -30 ;;
    fi-precompile)  # FI_PRECOMPILE_ARGS: FlashInfer modules built in parallel before the tests load them
      # (';'-separated sets run side by side, e.g. fp8 head dims next to one bf16 shape)
      IFS=';' read -ra sets <<< "${FI_PRECOMPILE_ARGS:-}"
      [ "${#sets[@]}" -eq 0 ] && sets=("")
      limit=$(cap ${FI_PRECOMPILE_S:-420})
      for args in "${sets[@]}"; do
        timeout "$limit" python3 benchmarks/fi_precompile.py $args 2>&1 | tee -a "$OUT/fi-precompile.log" | tail -30 &
      done
      wait ;;
    fi-start-times)  # issue 28: the flashinfer backend's first start (empty JIT cache: compiles)
      # and warm start (the cache it left), per prefill variant (FI_START_VARIANTS, default
      # "auto fa2"); a one-shape bench extend, the whole process timed (docs/kernels.md)
      for v in ${FI_START_VARIANTS:-auto fa2}; do
        base=$(mktemp -d)
        for run in first warm; do
          t0=$(date +%s%N)
          timeout "$(cap ${FI_START_S:-400})" env FLASHINFER_WORKSPACE_BASE="$base" python3 -m execrt bench extend \
            --backends flashinfer --variants "$v" --shapes 1:512:0 --iters 1 --out '' \
            > "$OUT/fi-start-$v-$run.log" 2>&1
          rc=$?
          note "fi-start-times $v $run start: $(( ($(date +%s%N) - t0) / 1000000 )) ms (rc $rc)"
        done
      done ;;
    probe-nccl-ep)
      python3 -m execrt backends --kind moe_dispatch 2>&1 | tee "$OUT/probe-nccl-ep.log" | tail -20 ;;
    *) echo "unknown step $step" ;;
  esac
  note "step $step: $(( $(date +%s) - start )) s"
done
echo "===== summary ====="
cat "$summary"
# At most 8 files come back: results stay as JSON; logs, the summary and profiler traces travel
# in two archives; the FlashInfer JIT cache comes home so the next session can carry it.
# A file over 16 MiB does not come back, so a larger cache comes in 15 MiB parts
# (fi-cache.partNN.tgz: put them in .fi-cache-parts/ and carry that folder next time).
if [ "${FI_CACHE_BACK:-1}" = 1 ]; then
  # A module benchmarks/bin/ninja marked built loads without its object files: drop them
  # (about half the cache), so the cache and the wheels fit one call's carry.
  find "$FLASHINFER_WORKSPACE_BASE" -name .execrt-built -printf '%h\n' 2>/dev/null \
    | while read -r built; do find "$built" -maxdepth 1 -name '*.o' -delete; done
  tar -C "$FLASHINFER_WORKSPACE_BASE" -czf "$OUT/fi-cache.tgz" . 2>/dev/null || true
  if [ -f "$OUT/fi-cache.tgz" ] && [ "$(stat -c %s "$OUT/fi-cache.tgz")" -gt $((15 << 20)) ]; then
    split -b 15m -d -a 2 --additional-suffix=.tgz "$OUT/fi-cache.tgz" "$OUT/fi-cache.part" \
      && rm "$OUT/fi-cache.tgz"
  fi
fi
cd "$OUT" || exit 0
# Several runs in one call may share $OUT: each run's archives get names of their own
# (logs.tgz, logs-2.tgz, ...) instead of replacing the last run's.
fresh() { local n=2; [ -e "$1.tgz" ] || { echo "$1.tgz"; return; }; while [ -e "$1-$n.tgz" ]; do n=$((n + 1)); done; echo "$1-$n.tgz"; }
traces=$(ls decode-trace-*.json 2>/dev/null)
[ -n "$traces" ] && tar -czf "$(fresh traces)" --remove-files $traces
logs=$(ls | grep -v -e '\.json$' -e '\.tgz$')
[ -n "$logs" ] && tar -czf "$(fresh logs)" --remove-files $logs
ls -la "$OUT"
