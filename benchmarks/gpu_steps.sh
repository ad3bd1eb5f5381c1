# Sourced by the benchmarks/run_gpu_*.sh scripts, after `set -uo pipefail`:
#   source "$(dirname "$0")/gpu_steps.sh" NAME      # packs into $OUT/NAME.tgz
# Sets $final ($OUT, or bench_out) and $work (a fresh directory the steps write into), and
# defines `step NAME SECONDS COMMAND...`: runs COMMAND with its output in $work/NAME.log, cut
# off like Ctrl-C past SECONDS, prints its last lines, then packs $work into $final/NAME.tgz so
# that a run stopped later still returns what finished. PACK_FILES: files (a database, say) copied
# into the pack each time, so that their latest state comes back too.
final=${OUT:-bench_out}
mkdir -p "$final"
work=$(mktemp -d)
_pack_name=$1
pack() {
  local f
  for f in ${PACK_FILES:-}; do cp "$f" "$work/" 2>/dev/null; done
  tar czf "$final/$_pack_name.tgz" -C "$work" .
}
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout -s INT "$limit" "$@" > "$work/$name.log" 2>&1
  echo "=== $name rc=$?"; tail -n "${STEP_TAIL:-25}" "$work/$name.log" | grep -v "━"; pack
}
