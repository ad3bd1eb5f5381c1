#!/usr/bin/env bash
# One GPU call for the fused kernels: the GPU tests, the planted-bad-config search through the
# isolating worker, then for ffn, qkv and lola a search at the decode and prefill points
# (at most POINT_S seconds of sampling per point, default 20), export, and the side-by-side
# benchmark (plain calls; then tuned/default/GEMM as CUDA-graph replays at decode sizes, in a
# process of their own), and the RoPE and RMSNorm benchmarks on the shipped tables. Every step is cut off
# (like Ctrl-C) past its time limit; after each step everything so far is packed into
# $OUT/issue3.tgz, so a cut-off run still returns what finished.
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" issue3
gpu=${GPU:-h100}
ps=${POINT_S:-20}
step pytest_gpu 150 python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/kernels
step planted 90 python3 -m benchmarks.planted_search --db "sqlite:///$work/planted.db" --trials 30
for k in ffn qkv lola; do
  db="sqlite:///$work/$k.db"
  case $k in
    ffn) step ffn_search 100 python3 -m fusetune.cli search --kernel ffn --gpu "$gpu" \
           --model llama-2-7b --batch 1,4096 --seq 1 --dtype float16 --trials 200 \
           --time-budget "$ps" --db "$db" ;;
    qkv) step qkv_search 100 python3 -m fusetune.cli search --kernel qkv --gpu "$gpu" \
           --model llama-2-7b --batch 1 --seq 1,4096 --dtype float16 --trials 200 \
           --time-budget "$ps" --db "$db" ;;
    lola) step lola_search 200 bash -c "for d in dim=768,out=3072 dim=4096,out=16384; do
           python3 -m fusetune.cli search --kernel lola --gpu $gpu --dims \$d --batch 1,4096 \
           --seq 1 --dtype float16 --trials 200 --time-budget $ps --db $db; done" ;;
  esac
  python3 -m fusetune.cli export "$work/${k}_tables.yaml" --gpu "$gpu" --kernel "$k" --db "$db"
  case $k in
    lola) rows=(--shapes 4096:768:3072,1:4096:16384,4096:4096:16384)
          small=(--shapes 1:4096:16384) ;;
    *) rows=(--rows 1,4096); small=(--rows 1) ;;
  esac
  step "${k}_bench" 120 python3 -m benchmarks.bench_$k --tables "$work/${k}_tables.yaml" \
    "${rows[@]}" --no-graph --rounds 2 --markdown "$work/${k}_bench.md" \
    --json "$work/${k}_bench.json"
  step "${k}_bench_graph" 60 python3 -m benchmarks.bench_$k --tables "$work/${k}_tables.yaml" \
    "${small[@]}" --impls tuned,default,gemm_alone --rounds 2 \
    --markdown "$work/${k}_bench_graph.md"
done
step rope_bench 90 python3 -m benchmarks.bench_rope --no-graph --rounds 2 \
  --shapes 1x4096x32x128,8x4096x32x128 --markdown "$work/rope_bench.md" \
  --json "$work/rope_bench.json"
step rmsnorm_bench 60 python3 -m benchmarks.bench_rmsnorm --no-graph --rounds 2 \
  --rows 4096,16384 --markdown "$work/rmsnorm_bench.md" --json "$work/rmsnorm_bench.json"
cp "$work"/*_bench.md "$final"/ 2>/dev/null
pack
