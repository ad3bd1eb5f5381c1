#!/usr/bin/env bash
# One GPU call: lola with the LayerNorm folded into the K loop (PASSES = 1) checked for exact,
# repeatable results (GPU tests, benchmarks/lola_fold_check.py), its shared-memory model against
# the compiler (benchmarks/lola_smem_check.py), and where lola's time goes at prefill sizes
# (benchmarks/lola_prefill_parts.py). Everything lands in $OUT/lola_fold.tgz (see gpu_steps.sh).
#   source .whl/setup.sh && bash benchmarks/run_gpu_lola_fold.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" lola_fold
STEP_TAIL=15 step pytest_gpu_lola 300 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/kernels/test_lola.py
STEP_TAIL=20 step fold_check 150 python3 -m benchmarks.lola_fold_check
STEP_TAIL=60 step prefill_parts_gpt2 150 python3 -m benchmarks.lola_prefill_parts
STEP_TAIL=60 step prefill_parts_16384 150 python3 -m benchmarks.lola_prefill_parts --dim 4096 \
  --out 16384
STEP_TAIL=12 step smem_check 240 python3 -m benchmarks.lola_smem_check --jobs 14
