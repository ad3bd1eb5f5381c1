#!/usr/bin/env bash
# One GPU call: the K loop through TMA descriptors (TMA = 1) at prefill. TMA_SET=ffn (default):
# the GPU tests of the TMA and GEMV paths; exhaustive grids of
# benchmarks/grid_spaces/ffn_prefill_tma.yaml (every tile with TMA = 0 and 1) at 4096 and 512
# rows; their winners exported; benchmarks/bench_ffn.py on them beside eager, torch.compile,
# Liger and the cuBLAS GEMM alone (plain calls); then benchmarks/bench_decode.py on the shipped
# tables, 16-bit and e4m3 weights. TMA_SET=lola: lola's TMA GPU tests, grids of
# lola_prefill_tma.yaml at 4096 rows for GPT-2 768 -> 3072 and 4096 -> 16384, their winners,
# benchmarks/bench_lola.py on them. TMA_SET=qkv: qkv's TMA GPU tests (and the FP8 ones), the
# grid of qkv_prefill_tma.yaml at 4096 rows, its winners, benchmarks/bench_qkv.py on them.
# TMA_SET=fp8: FP8 by FP8 (ACT_FP8 = 1) with and without TMA: grids of
# {ffn,qkv}_prefill_fp8_tma.yaml at 4096 rows with e4m3 weights, their winners,
# benchmarks/bench_fp8.py on them beside cuBLAS FP8. Everything lands in $OUT/tma.tgz (see
# gpu_steps.sh).
#   source .whl/setup.sh && [TMA_SET=lola|qkv|fp8] bash benchmarks/run_gpu_tma.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" tma
gpu=$(python3 -c "import torch; from fusetune.tables import gpu_for_device; \
print(gpu_for_device(torch.device('cuda')).name)")
db=sqlite:///$work/tma_grid.db
grid() {  # NAME KERNEL ARGS...: one point's exhaustive grid of KERNEL's TMA sub-space
  local name=$1 kernel=$2; shift 2
  step "grid_$name" 200 python3 -m fusetune.cli evaluate-search --kernel "$kernel" \
    --gpu "$gpu" --db "$db" --isolate --trial-timeout 60 --seeds 1 --strategies random \
    --dtype float16 --batch 1 --space "benchmarks/grid_spaces/${kernel}_prefill${GRID_SUFFIX:-}_tma.yaml" "$@"
}
case ${TMA_SET:-ffn} in
  ffn)
    step tests 300 python3 -m pytest -q -m gpu -k "gemv or tma" tests/kernels/test_ffn.py \
      tests/kernels/test_qkv.py tests/kernels/test_lola.py tests/kernels/test_fp8.py
    grid 4096 ffn --model llama-2-7b --seq 4096
    grid 512 ffn --model llama-2-7b --seq 512
    step export 60 python3 -m fusetune.cli export "$work/tma_tables.yaml" --gpu "$gpu" --db "$db"
    step bench_ffn 200 python3 -m benchmarks.bench_ffn --tables "$work/tma_tables.yaml" \
      --rows 512,4096 --no-graph --rounds 2 --markdown "$work/ffn_bench.md" \
      --json "$work/ffn_bench.json"
    step decode 120 python3 -m benchmarks.bench_decode
    step decode_e4m3 120 python3 -m benchmarks.bench_decode --weights fp8-e4m3
    ;;
  lola)
    step tests 200 python3 -m pytest -q -m gpu tests/kernels/test_lola.py -k "tma or gpt_dims"
    grid gpt2 lola --model gpt2 --seq 4096
    grid 16384 lola --dims dim=4096,out=16384 --seq 4096
    step export 60 python3 -m fusetune.cli export "$work/tma_tables.yaml" --gpu "$gpu" --db "$db"
    step bench_lola 200 python3 -m benchmarks.bench_lola --tables "$work/tma_tables.yaml" \
      --shapes 4096:768:3072,4096:4096:16384 --no-graph --rounds 2 \
      --markdown "$work/lola_bench.md" --json "$work/lola_bench.json"
    ;;
  qkv)
    step tests 300 python3 -m pytest -q -m gpu -k "tma or smem" \
      tests/kernels/test_qkv.py tests/kernels/test_fp8.py
    grid 4096 qkv --model llama-2-7b --seq 4096
    step export 60 python3 -m fusetune.cli export "$work/tma_tables.yaml" --gpu "$gpu" --db "$db"
    step bench_qkv 200 python3 -m benchmarks.bench_qkv --tables "$work/tma_tables.yaml" \
      --rows 4096 --no-graph --rounds 2 --markdown "$work/qkv_bench.md" \
      --json "$work/qkv_bench.json"
    ;;
  fp8)
    GRID_SUFFIX=_fp8 grid ffn_fp8 ffn --model llama-2-7b --seq 4096 --weights fp8-e4m3
    GRID_SUFFIX=_fp8 grid qkv_fp8 qkv --model llama-2-7b --seq 4096 --weights fp8-e4m3
    step export 60 python3 -m fusetune.cli export "$work/tma_tables.yaml" --gpu "$gpu" --db "$db"
    step bench_fp8 300 python3 -m benchmarks.bench_fp8 --tables "$work/tma_tables.yaml" \
      --kernels ffn,qkv --rows 4096 --no-graph --rounds 2 --markdown "$work/fp8_bench.md" \
      --json "$work/fp8_bench.json"
    ;;
  *) echo "TMA_SET: ffn, lola, qkv or fp8, not ${TMA_SET}"; exit 2 ;;
esac
