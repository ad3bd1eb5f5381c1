# Sourced by benchmarks/run_gpu_grids.sh (times the grids) and benchmarks/replay_grids.sh
# (replays samplers against them): `grid_pairs SET` prints one line per (kernel, point) pair of
# the set, "NAME evaluate-search arguments...", so that both scripts agree on what a set holds.
#   main      the six pairs of 2026-11-21 (Llama-2-7B, GPT-2), on which the search was designed
#   heldout   four more, timed after the strategy was fixed
#   heldout2  seven more on other models' dims (Llama-3-8B with grouped-query attention,
#             Llama-2-13B), on the sub-spaces that hold today's default configs (the one-row
#             GEMV at decode, TMA tiles at prefill)
#   heldout3  eight more on shapes no earlier grid had (Llama-2-13B's ffn and qkv, Llama-2-70B,
#             GPT-2 medium's lola), timed after the search's seeding from the lookup tables
#             and other dims was built on the grids above
#   spread    decode grids of the sub-space with SPREAD (*_gemv_spread.yaml) on other models'
#             shapes (Llama-3-8B, Llama-2-13B, Llama-2-70B), timed after SPREAD and the shipped
#             entries it gave (Llama-2-7B qkv) were chosen on the Llama-2-7B grids
grid_pairs() {
  local s=benchmarks/grid_spaces
  case $1 in
    main)
      echo "ffn_decode --kernel ffn --model llama-2-7b --batch 1 --seq 1 --space $s/ffn_decode.yaml"
      echo "qkv_decode --kernel qkv --model llama-2-7b --batch 1 --seq 1 --space $s/qkv_decode.yaml"
      echo "lola_prefill --kernel lola --model gpt2 --batch 1 --seq 4096 --space $s/lola_prefill.yaml"
      echo "ffn_prefill --kernel ffn --model llama-2-7b --batch 1 --seq 4096 --space $s/ffn_prefill.yaml"
      echo "qkv_prefill --kernel qkv --model llama-2-7b --batch 1 --seq 4096 --space $s/qkv_prefill.yaml"
      echo "rmsnorm_decode --kernel rmsnorm --model llama-2-7b --batch 1 --seq 1"
      ;;
    heldout)
      echo "ffn_batch16 --kernel ffn --model llama-2-7b --batch 16 --seq 1 --space $s/ffn_batch16.yaml"
      echo "lola_decode --kernel lola --model llama-2-7b --batch 1 --seq 1 --space $s/lola_decode.yaml"
      echo "ffn_seq512 --kernel ffn --model llama-2-7b --batch 1 --seq 512 --space $s/ffn_prefill.yaml"
      echo "qkv_batch16 --kernel qkv --model llama-2-7b --batch 16 --seq 1 --space $s/qkv_batch16.yaml"
      ;;
    heldout2)
      echo "ffn_l3_decode --kernel ffn --model llama-3-8b --batch 1 --seq 1 --space $s/ffn_gemv_wide.yaml"
      echo "qkv_l3_decode --kernel qkv --model llama-3-8b --batch 1 --seq 1 --space $s/qkv_gemv_wide.yaml"
      echo "ffn_l3_prefill --kernel ffn --model llama-3-8b --batch 1 --seq 4096 --space $s/ffn_prefill_tma.yaml"
      echo "qkv_l3_prefill --kernel qkv --model llama-3-8b --batch 1 --seq 4096 --space $s/qkv_prefill_tma.yaml"
      echo "lola_13b_decode --kernel lola --dims dim=5120,out=13824 --batch 1 --seq 1 --space $s/lola_gemv_wide.yaml"
      echo "lola_13b_prefill --kernel lola --dims dim=5120,out=13824 --batch 1 --seq 2048 --space $s/lola_prefill_tma.yaml"
      echo "rmsnorm_13b_prefill --kernel rmsnorm --model llama-2-13b --batch 1 --seq 4096"
      ;;
    heldout3)
      echo "ffn_13b_decode --kernel ffn --model llama-2-13b --batch 1 --seq 1 --space $s/ffn_gemv_wide.yaml"
      echo "ffn_70b_decode --kernel ffn --model llama-2-70b --batch 1 --seq 1 --space $s/ffn_gemv_wide.yaml"
      echo "qkv_70b_decode --kernel qkv --model llama-2-70b --batch 1 --seq 1 --space $s/qkv_gemv_wide.yaml"
      echo "ffn_13b_prefill --kernel ffn --model llama-2-13b --batch 1 --seq 2048 --space $s/ffn_prefill_tma.yaml"
      echo "qkv_13b_prefill --kernel qkv --model llama-2-13b --batch 1 --seq 4096 --space $s/qkv_prefill_tma.yaml"
      echo "lola_70b_decode --kernel lola --dims dim=8192,out=28672 --batch 1 --seq 1 --space $s/lola_gemv_wide.yaml"
      echo "lola_medium_prefill --kernel lola --dims dim=1024,out=4096 --batch 1 --seq 4096 --space $s/lola_prefill_tma.yaml"
      echo "rmsnorm_70b_batch16 --kernel rmsnorm --model llama-2-70b --batch 16 --seq 1"
      ;;
    spread)
      echo "qkv_l3_spread --kernel qkv --model llama-3-8b --batch 1 --seq 1 --space $s/qkv_gemv_spread.yaml"
      echo "qkv_13b_spread --kernel qkv --model llama-2-13b --batch 1 --seq 1 --space $s/qkv_gemv_spread.yaml"
      echo "qkv_70b_spread --kernel qkv --model llama-2-70b --batch 1 --seq 1 --space $s/qkv_gemv_spread.yaml"
      echo "ffn_l3_spread --kernel ffn --model llama-3-8b --batch 1 --seq 1 --space $s/ffn_gemv_spread.yaml"
      echo "lola_13b_spread --kernel lola --dims dim=5120,out=13824 --batch 1 --seq 1 --space $s/lola_gemv_spread.yaml"
      ;;
    *) echo "unknown grid set '$1' (valid: main, heldout, heldout2, heldout3, spread)" >&2; return 2 ;;
  esac
}
