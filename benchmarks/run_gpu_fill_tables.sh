#!/usr/bin/env bash
# GPU calls that tune the points the shipped H100 tables did not have (bfloat16 activations,
# FP8 e5m2 weights, RoPE with interleaved pairs), plus the L2-state diagnostic. FILL_STEPS
# names the steps, in order (default: all, more than one call's time):
#   l2_state     benchmarks.l2_state: decode kernels and the read-only kernel after do_bench's
#                flush and after one that leaves the L2 clean (float16 and e4m3 weights)
#   bf16_decode  fusetune search at one row, bfloat16: ffn, qkv (both pair layouts), lola
#                4096 -> 16384 and 4096 -> 11008
#   e5m2_decode  the same with e5m2 weights, float16 activations: ffn, qkv, lola
#   e5m2_more    e5m2 ffn again (with FILL_TRIALS above the first run's, a resumed search that
#                now starts from the e4m3 winner too), e5m2 lola 4096 -> 11008
#   rope_fp16    RoPE with interleaved pairs, float16, batch 1,8 x seq 1,4096
#   rope_bf16    RoPE, both pair layouts, bfloat16, the same points
#   bf16_prefill fusetune search at 4096 rows, bfloat16: ffn, qkv, lola 768 -> 3072 and
#                4096 -> 16384
#   rows16_ffn_qkv, rows16_lola
#                fusetune search at 16 rows (batch 16) for the groups whose tables had a one-row
#                entry and 4096-row entries only: ffn and qkv with e4m3 weights and with
#                bfloat16; lola 4096 -> 16384 (float16, bfloat16) and 768 -> 3072 (float16)
#   rows_n       the same groups and ffn, qkv in float16, at FILL_BATCH rows (batch FILL_BATCH,
#                seq 1; default 64), so that no group's nearest tuned row count is 4x away
#   stale_decode fusetune search at one row, float16 activations, for the entries tuned before
#                THREAD_SUM and SPREAD were in the spaces: lola 4096 -> 11008 (float16 and
#                e4m3 weights), lola 768 -> 3072, qkv with half-split pairs; then
#                bench_decode on those cases with the export's table
#   fp8_prefill  fusetune search at 4096 rows (seq 4096) for the FP8 groups tuned at one row
#                only: ffn and qkv with e5m2 weights, lola 4096 -> 16384 with e4m3 and e5m2
#   fp8_rows_n   fusetune search at FILL_BATCH rows (default 64) for the groups of fp8_prefill
#   lookup_rows  benchmarks.lookup_rows: those groups at FILL_ROWS rows (default 2,8,16,64), the
#                log-nearest entry of any structure against the lookup now and the default
#                heuristic (with the export's table where there is one); FILL_CASES: the
#                groups by lookup_rows' names (default: its own)
#   export       the database's winners as a table (FILL_DB's name with _tables.yaml)
#   verify       on the shipped tables updated with that table: bench_decode (bfloat16, e5m2),
#                bench_rope (verify_decode, verify_rope: one of the two)
# Each search seeds its study from the nearest tuned points (the shipped float16 and e4m3
# entries among them). FILL_DB: the search database (default
# benchmarks/results/fill_tables_h100/search.db, so that the calls add to one file; carry it).
# FILL_TRIALS: configs per point (default 32). FILL_ARGS: more search options (--isolate
# --trial-timeout 60: a config that hangs is recorded as such, the search goes on).
# FILL_ONLY: the names of the searches to run (e.g. "rows64_lola_float16"; the step logs' names),
# the others of a step skipped. FILL_WORKERS: compile-ahead processes (default 0: on a fresh machine 8 of them took about 55 s
# to start, longer than a decode point's search).
# Everything lands in $OUT/fill_tables.tgz (FILL_TAG: a suffix of its name), the database's
# state after every step with it.
#   source .whl/setup.sh && FILL_STEPS="l2_state bf16_decode" bash benchmarks/run_gpu_fill_tables.sh
set -uo pipefail
dbfile=${FILL_DB:-benchmarks/results/fill_tables_h100/search.db}
PACK_FILES=$dbfile
source "$(dirname "$0")/gpu_steps.sh" "fill_tables${FILL_TAG:+_$FILL_TAG}"
mkdir -p "$(dirname "$dbfile")"
db=sqlite:///$dbfile
tables=${dbfile%.db}_tables.yaml
trials=${FILL_TRIALS:-32}
search() {  # NAME LIMIT_S ARGS...: fusetune search on this GPU into the database
  local name=$1 limit=$2; shift 2
  if [ -n "${FILL_ONLY:-}" ] && [[ " $FILL_ONLY " != *" $name "* ]]; then return; fi
  step "$name" "$limit" python3 -m fusetune.cli search --gpu h100 --db "$db" \
    --trials "$trials" --compile-workers "${FILL_WORKERS:-0}" ${FILL_ARGS:-} "$@"
}
verify_decode() {
  step decode_bf16 150 env FUSETUNE_TABLES="$tables" python3 -m benchmarks.bench_decode --dtype bfloat16
  step decode_e5m2 150 env FUSETUNE_TABLES="$tables" python3 -m benchmarks.bench_decode \
    --weights fp8-e5m2
}
verify_rope() {
  step bench_rope 150 python3 -m benchmarks.bench_rope --tables "$tables" \
    --markdown "$work/bench_rope.md"
}
for s in ${FILL_STEPS:-l2_state bf16_decode e5m2_decode rope_fp16 rope_bf16 bf16_prefill export verify}; do
  case $s in
    l2_state) step l2_state 120 python3 -m benchmarks.l2_state
              step l2_state_e4m3 90 python3 -m benchmarks.l2_state --weights fp8-e4m3 ;;
    bf16_decode)
      search bf16_ffn 75 --kernel ffn --model llama-2-7b --batch 1 --seq 1 --dtype bfloat16
      search bf16_qkv 75 --kernel qkv --model llama-2-7b --batch 1 --seq 1 --dtype bfloat16
      search bf16_qkv_half 75 --kernel qkv --dims dim=4096,head_dim=128,interleaved=0,n_heads=32,n_kv_heads=32 \
        --batch 1 --seq 1 --dtype bfloat16
      search bf16_lola 75 --kernel lola --dims dim=4096,out=16384 --batch 1 --seq 1 --dtype bfloat16
      search bf16_lola_11008 75 --kernel lola --dims dim=4096,out=11008 --batch 1 --seq 1 \
        --dtype bfloat16 ;;
    e5m2_decode)
      for k in ffn qkv; do
        search "e5m2_$k" 75 --kernel "$k" --model llama-2-7b --batch 1 --seq 1 --dtype float16 \
          --weights fp8-e5m2
      done
      search e5m2_lola 75 --kernel lola --dims dim=4096,out=16384 --batch 1 --seq 1 \
        --dtype float16 --weights fp8-e5m2 ;;
    e5m2_more)
      search e5m2_ffn_more 90 --kernel ffn --model llama-2-7b --batch 1 --seq 1 --dtype float16 \
        --weights fp8-e5m2
      search e5m2_lola_11008 90 --kernel lola --dims dim=4096,out=11008 --batch 1 --seq 1 \
        --dtype float16 --weights fp8-e5m2 ;;
    rope_fp16) search rope_fp16 100 --kernel rope --dims head_dim=128,heads=32,interleaved=1 \
                 --batch 1,8 --seq 1,4096 --dtype float16 ;;
    rope_bf16) for il in 1 0; do
                 search "rope_bf16_$il" 100 --kernel rope --dims "head_dim=128,heads=32,interleaved=$il" \
                   --batch 1,8 --seq 1,4096 --dtype bfloat16
               done ;;
    bf16_prefill)
      search bf16_ffn_4096 90 --kernel ffn --model llama-2-7b --batch 1 --seq 4096 --dtype bfloat16
      search bf16_qkv_4096 90 --kernel qkv --model llama-2-7b --batch 1 --seq 4096 --dtype bfloat16
      for d in 768,3072 4096,16384; do
        search "bf16_lola_${d%,*}_4096" 90 --kernel lola --dims "dim=${d%,*},out=${d#*,}" \
          --batch 1 --seq 4096 --dtype bfloat16
      done ;;
    rows16_ffn_qkv)
      search rows16_ffn_e4m3 150 --kernel ffn --model llama-2-7b --batch 16 --seq 1 \
        --dtype float16 --weights fp8-e4m3
      search rows16_ffn_bf16 150 --kernel ffn --model llama-2-7b --batch 16 --seq 1 --dtype bfloat16
      search rows16_qkv_e4m3 150 --kernel qkv --model llama-2-7b --batch 16 --seq 1 \
        --dtype float16 --weights fp8-e4m3
      search rows16_qkv_bf16 150 --kernel qkv --model llama-2-7b --batch 16 --seq 1 --dtype bfloat16 ;;
    rows16_lola)
      for dt in float16 bfloat16; do
        search "rows16_lola_$dt" 150 --kernel lola --dims dim=4096,out=16384 --batch 16 --seq 1 \
          --dtype "$dt"
      done
      search rows16_lola_768 150 --kernel lola --dims dim=768,out=3072 --batch 16 --seq 1 \
        --dtype float16 ;;
    stale_decode)
      search stale_lola_11008_fp16 80 --kernel lola --dims dim=4096,out=11008 --batch 1 --seq 1 \
        --dtype float16
      search stale_lola_11008_e4m3 80 --kernel lola --dims dim=4096,out=11008 --batch 1 --seq 1 \
        --dtype float16 --weights fp8-e4m3
      search stale_lola_768 60 --kernel lola --dims dim=768,out=3072 --batch 1 --seq 1 \
        --dtype float16
      search stale_qkv_half 80 --kernel qkv \
        --dims dim=4096,head_dim=128,interleaved=0,n_heads=32,n_kv_heads=32 --batch 1 --seq 1 \
        --dtype float16
      step export 60 python3 -m fusetune.cli export "$tables" --gpu h100 --db "$db"
      step decode_stale 90 env FUSETUNE_TABLES="$tables" python3 -m benchmarks.bench_decode \
        --cases lola_11008,lola_768,qkv_half
      step decode_stale_e4m3 60 env FUSETUNE_TABLES="$tables" python3 -m benchmarks.bench_decode \
        --cases lola_11008 --weights fp8-e4m3 ;;
    fp8_prefill)
      for k in ffn qkv; do
        search "e5m2_${k}_4096" 120 --kernel "$k" --model llama-2-7b --batch 1 --seq 4096 \
          --dtype float16 --weights fp8-e5m2
      done
      for w in e4m3 e5m2; do
        search "${w}_lola_4096" 120 --kernel lola --dims dim=4096,out=16384 --batch 1 --seq 4096 \
          --dtype float16 --weights "fp8-$w"
      done ;;
    fp8_rows_n)
      n=${FILL_BATCH:-64}
      for k in ffn qkv; do
        search "rows${n}_${k}_e5m2" 120 --kernel "$k" --model llama-2-7b --batch "$n" --seq 1 \
          --dtype float16 --weights fp8-e5m2
      done
      for w in e4m3 e5m2; do
        search "rows${n}_lola_$w" 120 --kernel lola --dims dim=4096,out=16384 --batch "$n" \
          --seq 1 --dtype float16 --weights "fp8-$w"
      done ;;
    rows_n)
      n=${FILL_BATCH:-64}
      for kw in "ffn float16 fp8-e4m3" "ffn bfloat16 -" "ffn float16 -" "qkv float16 fp8-e4m3" \
                "qkv bfloat16 -" "qkv float16 -"; do
        set -- $kw
        search "rows${n}_$1_$2_$3" 120 --kernel "$1" --model llama-2-7b --batch "$n" --seq 1 \
          --dtype "$2" $([ "$3" != - ] && echo "--weights $3")
      done
      for dt in float16 bfloat16; do
        search "rows${n}_lola_$dt" 120 --kernel lola --dims dim=4096,out=16384 --batch "$n" \
          --seq 1 --dtype "$dt"
      done
      search "rows${n}_lola_768" 120 --kernel lola --dims dim=768,out=3072 --batch "$n" --seq 1 \
        --dtype float16 ;;
    lookup_rows) step "lookup_rows${FILL_TAG:+_$FILL_TAG}" 300 python3 -m benchmarks.lookup_rows \
                   --rows "${FILL_ROWS:-2,8,16,64}" ${FILL_CASES:+--cases "$FILL_CASES"} \
                   $([ -f "$tables" ] && echo "--tables $tables") ;;
    export) step export 60 python3 -m fusetune.cli export "$tables" --gpu h100 --db "$db"
            cp "$tables" "$work/" ;;
    verify) verify_decode; verify_rope ;;
    verify_decode) verify_decode ;;
    verify_rope) verify_rope ;;
    *) echo "unknown step $s (valid: l2_state bf16_decode e5m2_decode e5m2_more rope_fp16 rope_bf16
       bf16_prefill rows16_ffn_qkv rows16_lola stale_decode fp8_prefill fp8_rows_n rows_n lookup_rows export verify verify_decode verify_rope)"
       exit 2 ;;
  esac
done
pack
