#!/usr/bin/env bash
# One GPU call: the GEMV decode path's GPU tests, then decode against the read-only ceiling
# (benchmarks/bench_decode.py). Everything lands in $OUT/decode.tgz (see gpu_steps.sh).
#   source .whl/setup.sh && bash benchmarks/run_gpu_decode.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" decode
step gemv_tests 200 python3 -m pytest -q -m gpu -k "gemv" tests/kernels/test_ffn.py \
  tests/kernels/test_qkv.py tests/kernels/test_lola.py
step decode 120 python3 -m benchmarks.bench_decode
