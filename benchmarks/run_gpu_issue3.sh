#!/usr/bin/env bash
# One GPU call for the matmul kernels: GPU tests of qkv, ffn and lola, then each kernel's
# search, export and side-by-side benchmark (run_gpu_{qkv,ffn,lola}.sh), with TRIALS trials
# per point (default 30). The outputs go to $OUT/issue3.tgz (one file: the device tool returns
# at most 8), and the three benchmark tables to $OUT/*_bench.md.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
final=${OUT:-bench_out}
work=$(mktemp -d)
export TRIALS=${TRIALS:-30} OUT=$work
status=0
for k in qkv ffn lola; do
  echo "=== $k"
  bash "$here/run_gpu_$k.sh" || { echo "=== $k failed"; status=1; }
done
mkdir -p "$final"
tar czf "$final/issue3.tgz" -C "$work" .
cp "$work"/*_bench.md "$final"/ 2>/dev/null || true
exit $status
