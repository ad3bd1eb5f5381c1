#!/usr/bin/env bash
# One GPU call: what holds the decode (M = 1) matmul kernels above the read-only ceiling.
# benchmarks/decode_profile.py (shipped configs, the same tiles after a norm pass, and the
# read-only kernel of the same bytes) runs once plainly (registers, spills, load widths), then
# under Nsight Compute (clocks left alone); benchmarks/ncu_table.py makes the table. Everything
# lands in $OUT/decode_profile.tgz (see gpu_steps.sh). PROFILE_ARGS (default --two-pass) go to
# decode_profile.py, e.g. PROFILE_ARGS="--weights fp8-e4m3" for the FP8-weight kernels.
#   source .whl/setup.sh && bash benchmarks/run_gpu_decode_profile.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" decode_profile
ncu=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | tail -n 1)}
args=${PROFILE_ARGS:---two-pass}
# shellcheck disable=SC2086  # PROFILE_ARGS: words on purpose
step kernels 240 python3 -m benchmarks.decode_profile $args
if [ -z "$ncu" ]; then echo "no ncu found"; exit 1; fi
step ncu 400 "$ncu" --clock-control none -k 'regex:_(ffn|qkv|lola|read|layernorm|rmsnorm)_kernel' \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section ComputeWorkloadAnalysis \
  --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct,smsp__issue_active.avg.pct_of_peak_sustained_active \
  --csv --page raw --log-file "$work/ncu.csv" \
  python3 -m benchmarks.decode_profile $args --launches 1
STEP_TAIL=60 step table 60 python3 -m benchmarks.ncu_table "$work/ncu.csv" "$work/ncu.log"
