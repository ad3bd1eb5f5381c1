#!/usr/bin/env bash
# One GPU call: lola at prefill sizes. The GPU tests of lola; where its time goes
# (benchmarks/lola_prefill_parts.py, GPT-2's 768 -> 3072 and 4096 -> 16384 at 4096 rows);
# exhaustive grids of benchmarks/grid_spaces/lola_prefill_tma.yaml at those two points (the
# tuner times the GPT-2 point as CUDA-graph replays, its floor being under 150 µs); their
# winners exported; benchmarks/bench_lola.py on them beside eager, torch.compile, Liger and the
# cuBLAS GEMM alone (graph replays). Everything lands in $OUT/lola_prefill.tgz (gpu_steps.sh).
# GRIDS=0: no grids, bench_lola on the shipped tables (graph replays, then plain calls);
# PARTS_ONLY=kinds: lola_prefill_parts.py's --only; TESTS: test files of the GPU tests.
#   source .whl/setup.sh && [GRIDS=0] bash benchmarks/run_gpu_lola_prefill.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" lola_prefill
gpu=$(python3 -c "import torch; from fusetune.tables import gpu_for_device; \
print(gpu_for_device(torch.device('cuda')).name)")
db=sqlite:///$work/lola_prefill_grid.db
STEP_TAIL=5 step pytest_gpu_lola 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
  ${TESTS:-tests/kernels/test_lola.py}
only=${PARTS_ONLY:+--only $PARTS_ONLY}
STEP_TAIL=70 step parts_gpt2 150 python3 -m benchmarks.lola_prefill_parts $only
STEP_TAIL=70 step parts_16384 150 python3 -m benchmarks.lola_prefill_parts --dim 4096 \
  --out 16384 $only
bench() {  # NAME ARGS...: bench_lola at the two prefill points and one row, 3 rounds
  local name=$1; shift
  STEP_TAIL=20 step "bench_$name" 200 python3 -m benchmarks.bench_lola \
    --shapes 4096:768:3072,4096:4096:16384,1:4096:16384 --rounds 3 \
    --markdown "$work/${name}.md" --json "$work/${name}.json" "$@"
}
if [ "${GRIDS:-1}" = 0 ]; then
  bench lola_shipped_graph
  bench lola_shipped_plain --no-graph
  exit 0
fi
grid() {  # NAME ARGS...: one point's exhaustive grid of lola's TMA sub-space at 4096 rows
  local name=$1; shift
  STEP_TAIL=30 step "grid_$name" 240 python3 -m fusetune.cli evaluate-search --kernel lola \
    --gpu "$gpu" --db "$db" --isolate --trial-timeout 60 --seeds 1 --strategies random \
    --dtype float16 --batch 1 --seq 4096 --space benchmarks/grid_spaces/lola_prefill_tma.yaml "$@"
}
grid gpt2 --model gpt2
grid 16384 --dims dim=4096,out=16384
step export 60 python3 -m fusetune.cli export "$work/lola_tables.yaml" --gpu "$gpu" --db "$db"
bench lola --tables "$work/lola_tables.yaml"
