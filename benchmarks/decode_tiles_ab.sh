#!/usr/bin/env bash
# A/B of this GPU's shipped decode tile table (execrt/kernels/attention/decode_configs/) in the
# whole decode step: `execrt bench decode` with the table, without it (moved aside), and with it
# again, in one device call, so the table's entries are judged end to end on the GPU that reads
# them. CANDIDATE=<file>: the B run reads that table in the shipped one's place instead.
# Usage (device tool): OUT=$OUT [CANDIDATE=f] bash benchmarks/decode_tiles_ab.sh [bench decode
# args] (default: --model qwen3-0.6b --bs 1,8,16 --modes graph --no-hf --ttft none). Results:
# $OUT/with-1, $OUT/without (or $OUT/candidate), $OUT/with-2 (bench decode's JSON records).
set -u -o pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
name=$(python3 -c "import torch; from execrt.kernels._triton import tuned_table_name as t; \
print(t(torch.cuda.get_device_name(), torch.bfloat16))")
table="execrt/kernels/attention/decode_configs/$name"
args=${*:---model qwen3-0.6b --bs 1,8,16 --modes graph --no-hf --ttft none}
[ -f "$table" ] || { echo "no decode tile table for this GPU ($name): nothing to A/B"; exit 0; }
run() {
  mkdir -p "$OUT/$1"
  echo "# $1"
  timeout "${AB_TIMEOUT:-170}" python3 -m execrt bench decode --out "$OUT/$1" $args 2>&1 | tail -"${AB_TAIL:-8}"
}
run with-1
aside=$(mktemp)
mv "$table" "$aside"
trap 'mv "$aside" "$table"' EXIT
if [ -n "${CANDIDATE:-}" ]; then
  cp "$CANDIDATE" "$table"
  run candidate
else
  run without
fi
mv "$aside" "$table"
trap - EXIT
run with-2
