#!/usr/bin/env bash
# GPU calls of the THREAD_SUM study (one-row GEMV: each thread adds up its 16-byte run of a
# weight row before accumulating; benchmarks/gemv_thread_sum.py). TS_STEPS names the steps, in
# order (default: all, more than one call's time):
#   diag                 benchmarks.gemv_thread_sum without tables: the shipped M = 1 configs
#                        with THREAD_SUM 0 and 1 beside the read-only kernel, 16-bit and e4m3
#   ffn qkv lola ffn_e4m3 qkv_e4m3 lola_e4m3
#                        exhaustive grids of benchmarks/grid_spaces/*_gemv_thread_sum.yaml at
#                        M = 1 (Llama-2-7B dims; lola 4096 -> 16384) into the grid database
#   export               the database's winners as a table (beside it: grid_tables.yaml)
#   diag_before          benchmarks.gemv_thread_sum with the tables shipped before THREAD_SUM
#                        (benchmarks/results/thread_sum_h100/shipped_before.yaml)
#   diag_tables          benchmarks.gemv_thread_sum with that table's winners too
#   decode               benchmarks.bench_decode on that table, 16-bit and e4m3
#   tests                the GEMV GPU tests (THREAD_SUM 0 and 1)
#   shipped              on the shipped tables: bench_decode (16-bit, e4m3) and the side-by-side
#                        benchmarks with their peers at one row (bench_ffn, bench_qkv, bench_lola
#                        4096 -> 16384, bench_fp8)
# TS_SPACE=gemv_warps: the grids of benchmarks/grid_spaces/*_gemv_warps.yaml instead (1 or 16
# warps a program). TS_DB: the grid database (default benchmarks/results/thread_sum_h100/grid.db, so that the
# calls add to one file). Everything lands in $OUT/thread_sum.tgz (TS_TAG=t: thread_sum_t.tgz;
# see gpu_steps.sh).
#   source .whl/setup.sh && TS_STEPS="diag ffn qkv" bash benchmarks/run_gpu_thread_sum.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" "thread_sum${TS_TAG:+_$TS_TAG}"
gpu=$(python3 -c "import torch; from fusetune.tables import gpu_for_device; \
print(gpu_for_device(torch.device('cuda')).name)")
dbfile=${TS_DB:-benchmarks/results/thread_sum_h100/grid.db}
mkdir -p "$(dirname "$dbfile")"
db=sqlite:///$dbfile
tables=${dbfile%.db}_tables.yaml
grid() {  # NAME KERNEL ARGS...: one point's grid (one replay seed: the grid is the point)
  local name=$1 kernel=$2; shift 2
  step "grid_$name" 180 python3 -m fusetune.cli evaluate-search --kernel "$kernel" --gpu "$gpu" \
    --db "$db" --isolate --trial-timeout 60 --seeds 1 --strategies random --dtype float16 \
    --batch 1 --seq 1 --space "benchmarks/grid_spaces/${kernel}_${TS_SPACE:-gemv_thread_sum}.yaml" "$@"
}
for s in ${TS_STEPS:-diag ffn qkv lola ffn_e4m3 qkv_e4m3 lola_e4m3 export diag_tables decode tests}; do
  case $s in
    diag) step diag 120 python3 -m benchmarks.gemv_thread_sum ;;
    ffn) grid ffn ffn --model llama-2-7b ;;
    qkv) grid qkv qkv --model llama-2-7b ;;
    lola) grid lola lola --dims dim=4096,out=16384 ;;
    ffn_e4m3) grid ffn_e4m3 ffn --model llama-2-7b --weights fp8-e4m3 ;;
    qkv_e4m3) grid qkv_e4m3 qkv --model llama-2-7b --weights fp8-e4m3 ;;
    lola_e4m3) grid lola_e4m3 lola --dims dim=4096,out=16384 --weights fp8-e4m3 ;;
    export) step export 60 python3 -m fusetune.cli export "$tables" --gpu "$gpu" --db "$db"
            cp "$tables" "$work/" ;;
    diag_before) step diag_before 150 python3 -m benchmarks.gemv_thread_sum \
                   --tables benchmarks/results/thread_sum_h100/shipped_before.yaml ;;
    diag_tables) step diag_tables 150 python3 -m benchmarks.gemv_thread_sum --tables "$tables" ;;
    decode) step decode 120 env FUSETUNE_TABLES="$tables" python3 -m benchmarks.bench_decode
            step decode_e4m3 120 env FUSETUNE_TABLES="$tables" python3 -m benchmarks.bench_decode \
              --weights fp8-e4m3 ;;
    tests) step tests 240 python3 -m pytest -q -m gpu -k "thread or gemv_structure or gemv_whole_rows" \
             tests/kernels/test_ffn.py tests/kernels/test_qkv.py tests/kernels/test_lola.py \
             tests/kernels/test_fp8.py ;;
    shipped) step decode_shipped 120 python3 -m benchmarks.bench_decode
             step decode_shipped_e4m3 120 python3 -m benchmarks.bench_decode --weights fp8-e4m3
             for b in ffn qkv; do
               step "bench_$b" 150 python3 -m benchmarks.bench_$b --rows 1 \
                 --markdown "$work/bench_$b.md" --json "$work/bench_$b.json"
             done
             step bench_lola 150 python3 -m benchmarks.bench_lola --shapes 1:4096:16384 \
               --markdown "$work/bench_lola.md" --json "$work/bench_lola.json"
             step bench_fp8 200 python3 -m benchmarks.bench_fp8 --kernels ffn,qkv,lola --rows 1 \
               --markdown "$work/bench_fp8.md" --json "$work/bench_fp8.json" ;;
    *) echo "unknown step $s (valid: diag ffn qkv lola ffn_e4m3 qkv_e4m3 lola_e4m3 export diag_before diag_tables decode
       tests shipped)"
       exit 2 ;;
  esac
done
cp "$dbfile" "$work/" 2>/dev/null; pack
