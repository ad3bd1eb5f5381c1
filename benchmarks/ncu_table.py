"""A table of one Nsight Compute run over benchmarks/decode_profile.py.

Reads ncu's raw page as CSV (`ncu --csv --page raw ... --log-file NCU.csv`) and the script's
standard output (whose lines "check NAME kernels=N" and "launch NAME kernels=N" say which
Triton kernels each step launched, in the order ncu saw them); prints, per profiled kernel of
the last launch of each name: duration, DRAM throughput and bytes, achieved and theoretical
occupancy, registers, waves, issue-slot use, L2 hit rate, the three largest warp stall
reasons (warps stalled per issued instruction) and, where the run collected them
(`--section ComputeWorkloadAnalysis`), the three busiest execution pipes (instructions issued
to each as % of its peak while the SM was active).

    python -m benchmarks.ncu_table NCU.csv PROFILE.log
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

COLUMNS = (  # (heading, metric, scale to the unit shown)
    ("µs", "gpu__time_duration.sum", None),
    ("DRAM % of peak", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    ("MB read", "dram__bytes_read.sum", None),
    ("occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1.0),
    ("theoretical %", "sm__maximum_warps_per_active_cycle_pct", 1.0),
    ("regs", "launch__registers_per_thread", 1.0),
    ("waves", "launch__waves_per_multiprocessor", 1.0),
    ("issue active %", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1.0),
    ("L2 hit %", "lts__t_sector_hit_rate.pct", 1.0),
)
_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(.+)_per_issue_active\.ratio$")
_PIPE = re.compile(r"^sm__inst_executed_pipe_(.+)\.avg\.pct_of_peak_sustained_active$")
_STEP = re.compile(r"^(check|launch) (.+) kernels=(\d+)$")
_TIME_SCALE = {"ns": 1e-3, "nsecond": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3,
               "ms": 1e3}
_BYTE_SCALE = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "KB": 1e-3, "MB": 1.0,
               "GB": 1e3, "B": 1e-6}


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_rows(path: Path) -> tuple[list[dict[str, str]], dict[str, str]]:
    """ncu's raw CSV: (rows, units by column); lines before the header are ncu's messages."""
    lines = path.read_text(errors="replace").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    reader = csv.reader(lines[start:])
    header = next(reader)
    units = dict(zip(header, next(reader), strict=False))
    return [dict(zip(header, r, strict=False)) for r in reader if len(r) == len(header)], units


def steps(log: Path) -> list[tuple[str, str, int]]:
    return [(m[1], m[2], int(m[3])) for line in log.read_text(errors="replace").splitlines()
            if (m := _STEP.match(line.strip()))]


def cell(row: dict[str, str], units: dict[str, str], metric: str, scale: float | None) -> str:
    v = number(row.get(metric, ""))
    if v is None:
        return "-"
    unit = units.get(metric, "")
    if scale is None:
        scale = (_TIME_SCALE if metric.startswith("gpu__time") else _BYTE_SCALE).get(unit, 1.0)
    v *= scale
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"


def top(row: dict[str, str], pattern: re.Pattern[str], n: int = 3) -> str:
    """The n largest metrics of `row` whose names match `pattern`, by the pattern's group."""
    found = [(number(v) or 0.0, m[1]) for k, v in row.items() if (m := pattern.match(k))]
    found.sort(reverse=True)
    return ", ".join(f"{name} {v:.1f}" for v, name in found[:n] if v > 0) or "-"


def table(rows: list[dict[str, str]], units: dict[str, str],
          labels: list[tuple[str, str, int]]) -> str:
    """Markdown, one line per kernel of each name's last launch."""
    named: dict[str, list[dict[str, str]]] = {}
    i = 0
    for what, name, n in labels:
        mine = rows[i:i + n]
        i += n
        if what == "launch":
            named[name] = mine
    if i != len(rows):
        print(f"note: {len(rows)} profiled kernels, {i} announced by the log", file=sys.stderr)
    head = ["step", "kernel", *(c[0] for c in COLUMNS), "top stalls (warps per issue)",
            "busiest pipes (% of peak)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, kernels in named.items():
        for row in kernels:
            cells = [cell(row, units, metric, scale) for _, metric, scale in COLUMNS]
            out.append(f"| {name} | {row.get('Kernel Name', '?')} | " + " | ".join(cells) +
                       f" | {top(row, _STALL)} | {top(row, _PIPE)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    rows, units = read_rows(Path(args[0]))
    print(table(rows, units, steps(Path(args[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
