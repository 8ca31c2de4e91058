#!/usr/bin/env bash
# A/B of one of this GPU's shipped tuned tables in the whole decode step: `execrt bench decode`
# with the table, without it (moved aside), and with it again, in one device call, so the
# table's entries are judged end to end on the GPU that reads them. TABLE=decode (default: the
# decode tile table, execrt/kernels/attention/decode_configs/) or linear (the skinny GEMM's,
# execrt/kernels/linear_configs/). CANDIDATE=<file>: the B run reads that table in the shipped
# one's place instead of none.
# Usage (device tool): OUT=$OUT [TABLE=linear] [CANDIDATE=f] bash benchmarks/table_ab.sh
# [bench decode args] (default: --model qwen3-0.6b --bs 1,8,16 --modes graph --no-hf --ttft
# none). Results: $OUT/with-1, $OUT/without (or $OUT/candidate), $OUT/with-2 (bench decode's
# JSON records).
set -u -o pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
name=$(python3 -c "import torch; from execrt.kernels._triton import tuned_table_name as t; \
print(t(torch.cuda.get_device_name(), torch.bfloat16))")
case "${TABLE:-decode}" in
  decode) table="execrt/kernels/attention/decode_configs/$name" ;;
  linear) table="execrt/kernels/linear_configs/$name" ;;
  *) echo "TABLE=${TABLE} unsupported (supported: decode, linear)"; exit 2 ;;
esac
args=${*:---model qwen3-0.6b --bs 1,8,16 --modes graph --no-hf --ttft none}
[ -f "$table" ] || { echo "no ${TABLE:-decode} table for this GPU ($table): nothing to A/B"; exit 0; }
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
