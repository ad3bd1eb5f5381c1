#!/usr/bin/env bash
# One GPU call for the matmul kernels (ffn, qkv, lola): the read-bandwidth ceiling, then per
# kernel a search at its decode and prefill points (at most POINT_S seconds of sampling per
# point, default 12), export, and the side-by-side benchmark (plain calls), then the decode
# rows again as CUDA-graph replays (tuned, default, GEMM) in a process of their own. Every step
# is cut off (like Ctrl-C) past its time limit; after each step everything so far is packed into
# $OUT/matmul.tgz, so a cut-off run still returns what finished.
#   source .whl/setup.sh && bash benchmarks/run_gpu_matmul.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" matmul
gpu=${GPU:-h100}
ps=${POINT_S:-12}
cli() { python3 -m fusetune.cli "$@"; }
step read_bw 45 python3 -m benchmarks.bench_read_bw --mb 180,100,134
for k in ffn qkv lola; do
  db="sqlite:///$work/$k.db"
  case $k in
    ffn) step ffn_search 75 python3 -m fusetune.cli search --kernel ffn --gpu "$gpu" \
           --model llama-2-7b --batch 1,4096 --seq 1 --dtype float16 --trials 200 \
           --time-budget "$ps" --compile-workers 0 --db "$db" ;;
    qkv) step qkv_search 75 python3 -m fusetune.cli search --kernel qkv --gpu "$gpu" \
           --model llama-2-7b --batch 1 --seq 1,4096 --dtype float16 --trials 200 \
           --time-budget "$ps" --compile-workers 0 --db "$db" ;;
    lola) step lola_search 130 bash -c "for d in dim=768,out=3072 dim=4096,out=16384; do
           python3 -m fusetune.cli search --kernel lola --gpu $gpu --dims \$d --batch 1,4096 \
           --seq 1 --dtype float16 --trials 200 --time-budget $ps --compile-workers 0 --db $db; done" ;;
  esac
  cli export "$work/${k}_tables.yaml" --gpu "$gpu" --kernel "$k" --db "$db" > /dev/null
  case $k in
    lola) rows=(--shapes 4096:768:3072,1:4096:16384,4096:4096:16384)
          small=(--shapes 1:4096:16384) ;;
    *) rows=(--rows 1,4096); small=(--rows 1) ;;
  esac
  step "${k}_bench" 60 python3 -m benchmarks.bench_$k --tables "$work/${k}_tables.yaml" \
    "${rows[@]}" --no-graph --rounds 1 --markdown "$work/${k}_bench.md" \
    --json "$work/${k}_bench.json"
  step "${k}_bench_graph" 35 python3 -m benchmarks.bench_$k --tables "$work/${k}_tables.yaml" \
    "${small[@]}" --impls tuned,default,gemm_alone --rounds 1 \
    --markdown "$work/${k}_bench_graph.md"
done
cp "$work"/*_bench*.md "$final"/ 2>/dev/null
pack
