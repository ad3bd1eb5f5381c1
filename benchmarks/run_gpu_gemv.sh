#!/usr/bin/env bash
# One GPU call: the one-row GEMV structure at decode after UNROLL_K and Triton's e4m3
# conversion. The GEMV GPU tests; exhaustive grids of the GEMV sub-spaces
# (benchmarks/grid_spaces/*_gemv.yaml) for ffn, qkv and lola 4096->16384 with 16-bit weights and
# ffn, qkv with e4m3 weights; their winners exported as tables; then benchmarks/bench_decode.py
# on those tables (kernel launches beside the read-only kernel of the same bytes), 16-bit and
# e4m3. Everything lands in $OUT/gemv.tgz (see gpu_steps.sh).
#   source .whl/setup.sh && bash benchmarks/run_gpu_gemv.sh
# GEMV_SPACE=gemv_wide: the grids of benchmarks/grid_spaces/*_gemv_wide.yaml instead (1-8 rows
# per program, K-steps up to a whole row); GEMV_SPACE=gemv_two_pass: the same after a separate
# norm pass (PASSES = 2; *_gemv_two_pass.yaml); GEMV_SPACE=gemv_spread: a program's rows adjacent
# or spread over the matrix (SPREAD; *_gemv_spread.yaml); GEMV_TESTS=0 leaves out the GPU tests;
# GEMV_GRIDS names the grids to run (default: ffn qkv lola ffn_e4m3 qkv_e4m3; also qkv_half,
# Hugging Face's half-split pairs, and lola_e4m3).
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" gemv
gpu=$(python3 -c "import torch; from fusetune.tables import gpu_for_device; \
print(gpu_for_device(torch.device('cuda')).name)")
db=sqlite:///$work/gemv_grid.db
spaces=benchmarks/grid_spaces
space=${GEMV_SPACE:-gemv}
grid() {  # NAME KERNEL ARGS...: one point's grid (one replay seed: the grid is the point)
  local name=$1 kernel=$2; shift 2
  step "grid_$name" 150 python3 -m fusetune.cli evaluate-search --kernel "$kernel" --gpu "$gpu" \
    --db "$db" --isolate --trial-timeout 60 --seeds 1 --strategies random --dtype float16 \
    --batch 1 --seq 1 --space "$spaces/${kernel}_$space.yaml" "$@"
}
[ "${GEMV_TESTS:-1}" = 0 ] || step gemv_tests 240 python3 -m pytest -q -m gpu -k "gemv" tests/kernels/test_ffn.py \
  tests/kernels/test_qkv.py tests/kernels/test_lola.py tests/kernels/test_fp8.py
# GEMV_GRIDS: which of the five grids to run (default: all).
for g in ${GEMV_GRIDS:-ffn qkv lola ffn_e4m3 qkv_e4m3}; do
  case $g in
    ffn) grid ffn ffn --model llama-2-7b ;;
    qkv) grid qkv qkv --model llama-2-7b ;;
    qkv_half) grid qkv_half qkv --dims dim=4096,head_dim=128,interleaved=0,n_heads=32,n_kv_heads=32 ;;
    lola) grid lola lola --dims dim=4096,out=16384 ;;
    ffn_e4m3) grid ffn_e4m3 ffn --model llama-2-7b --weights fp8-e4m3 ;;
    qkv_e4m3) grid qkv_e4m3 qkv --model llama-2-7b --weights fp8-e4m3 ;;
    lola_e4m3) grid lola_e4m3 lola --dims dim=4096,out=16384 --weights fp8-e4m3 ;;
    *) echo "unknown grid $g (valid: ffn qkv qkv_half lola ffn_e4m3 qkv_e4m3 lola_e4m3)"; exit 2 ;;
  esac
done
step export 60 python3 -m fusetune.cli export "$work/gemv_tables.yaml" --gpu "$gpu" --db "$db"
export FUSETUNE_TABLES=$work/gemv_tables.yaml
step decode 120 python3 -m benchmarks.bench_decode
case " ${GEMV_GRIDS:-ffn_e4m3} " in  # e4m3 decode only where an e4m3 grid ran
  *_e4m3*) step decode_e4m3 120 python3 -m benchmarks.bench_decode --weights fp8-e4m3 ;;
esac
