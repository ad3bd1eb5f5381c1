#!/usr/bin/env bash
# On the GPU machine: the `gpu` tests of the kernels' figures (registers, spills, shared memory)
# and of compiling ahead, then the compile-ahead benchmark: the exhaustive grid of ffn at
# Llama-2-7B, b=1 s=1, float16, without and with compile processes, each run with an empty
# Triton cache and database, each capped at CAP_S seconds (default 200). Everything lands in
# $OUT (default ./bench_out). PART=tests or PART=bench runs one half.
set -u
source .whl/setup.sh || exit 1
out=${OUT:-bench_out}
mkdir -p "$out"
nproc
if [ "${PART:-all}" != bench ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_launches.py \
    tests/test_compile_ahead.py 2>&1 | tee "$out/pytest_gpu_compile_ahead.log" | tail -15
fi
if [ "${PART:-all}" != tests ]; then
  python3 benchmarks/bench_compile_ahead.py --kernel "${KERNEL:-ffn}" --batch "${BATCH:-1}" \
    --seq "${SEQ:-1}" --dtype float16 --time-cap "${CAP_S:-200}" ${WORKERS:+--workers $WORKERS} \
    --markdown "$out/compile_ahead_h100.md" --json "$out/compile_ahead_h100.json" 2>&1 \
    | tee "$out/compile_ahead_h100.log"
fi
