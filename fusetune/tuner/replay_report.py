"""What `fusetune evaluate-search` reports: a point's grid, its optimum, and per strategy how many
evaluations it needed to come within 2% (5%, 10%) of that optimum; as rows, Markdown and JSON."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from fusetune.tuner.grid import StoredGrid, config_text
from fusetune.tuner.replay import THRESHOLDS, WITHIN_GRID_FRACTION, StrategySummary
from fusetune.tuner.space import config_key

COLUMNS = ("strategy", "runs", "median evals to 2%", "mean evals to 2%", "median % of grid",
           "2% within 10% of grid", "median evals to 5%", "median evals to 10%",
           "sampler s/ask", "≈ s to 2%")

LEGEND = ("evals: configs evaluated (compiled and timed; pruned ones are free) until the best so "
          "far is within 2% (5%, 10%) of the grid's optimum; '>N': more than half the runs did "
          "not get there within N; '≥': a mean counting such runs as N. ≈ s to 2%: those "
          "evaluations at the grid's mean seconds per config, plus the sampler's own time.")


@dataclass
class PointReport:
    """The replays of one point against its stored grid."""

    grid: StoredGrid
    summaries: list[StrategySummary]
    gpu: str
    backend: str
    skipped: dict[str, str] = field(default_factory=dict)  # strategy -> why it did not run


def _pct(t: float) -> str:
    return f"{t * 100:g}%"


def _evals(v: float | None, budget: int) -> str:
    return f">{budget}" if v is None else f"{v:g}"


def _seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _per_eval_s(grid: StoredGrid) -> float | None:
    wall, _ = grid.wall_s()
    n = grid.evaluated()
    return wall / n if wall is not None and n else None


def summary_row(s: StrategySummary, grid: StoredGrid) -> dict[str, str]:
    """One strategy's line of the table, by column."""
    t = min(THRESHOLDS)
    med = s.median(t)
    mean, censored = s.mean(t)
    per_eval = _per_eval_s(grid)
    return {
        "strategy": s.strategy.name,
        "runs": str(len(s.runs)),
        "median evals to 2%": _evals(med, s.budget),
        "mean evals to 2%": ("≥" if censored else "") + f"{mean:.1f}",
        "median % of grid": "-" if med is None else f"{100 * med / s.grid_size:.1f}%",
        "2% within 10% of grid": f"{s.within_grid_fraction * 100:.0f}%",
        "median evals to 5%": _evals(s.median(0.05), s.budget),
        "median evals to 10%": _evals(s.median(0.10), s.budget),
        "sampler s/ask": f"{s.sampler_s_per_ask:.2g}",
        "≈ s to 2%": _seconds(None if per_eval is None else s.median_seconds(t, per_eval)),
    }


def header_lines(r: PointReport) -> list[str]:
    """What the grid is and holds, one fact per line."""
    g = r.grid
    plan = g.plan
    opt_config, opt_us = g.optimum
    statuses = Counter(m.status for k, m in g.measured.items() if k in plan.representative
                       and k not in plan.infeasible)
    wall, estimated = g.wall_s()
    n, k = g.size, g.count_within(min(THRESHOLDS))
    where = r.gpu if r.backend == r.gpu else f"{r.gpu} ({r.backend})"
    lines = [
        f"{g.point.label} on {where}" + (f", {g.label}" if g.label else ""),
        f"grid: {n} distinct feasible configs ({len(plan.infeasible)} pruned by the GPU's limits; "
        f"{plan.raw_size} in the space before merging equivalent ones); results: "
        + " ".join(f"{s}:{c}" for s, c in sorted(statuses.items())),
        "grid wall time: " + (f"{wall:.0f} s" + (" (extrapolated from the configs grid runs "
                                                 "timed)" if estimated else "")
                              if wall is not None else "not recorded")
        + f"; compiling and checking: {g.compile_s():.0f} s",
        f"optimum: {opt_us:.2f} µs with {config_text(opt_config)}; configs within 2% of it: "
        f"{k} (trying the distinct configs in a uniformly random order needs "
        f"{(n + 1) / (k + 1):.1f} evaluations on average to hit one)",
    ]
    d_us = g.time_us(config_key(g.default))
    lines.append(f"default config: {config_text(g.default)}: "
                 + (f"{d_us:.2f} µs (+{100 * (d_us / opt_us - 1):.1f}%)" if d_us is not None
                    else "did not run correctly"))
    if g.neighbours:
        lines.append(f"neighbouring points' winners (fusetune's seeds): {len(g.neighbours)}")
    for name, why in r.skipped.items():
        lines.append(f"{name} skipped: {why}")
    return lines


def to_markdown(reports: Sequence[PointReport]) -> str:
    out = ["# Search strategies replayed against exhaustive grids", ""]
    for r in reports:
        head = header_lines(r)
        out += [f"## {head[0]}", ""] + [f"- {line}" for line in head[1:]] + [""]
        out.append("| " + " | ".join(COLUMNS) + " |")
        out.append("|" + "|".join("---" for _ in COLUMNS) + "|")
        for s in r.summaries:
            row = summary_row(s, r.grid)
            out.append("| " + " | ".join(row[c] for c in COLUMNS) + " |")
        out += ["", LEGEND, ""]
    return "\n".join(out)


def _finite(v: float) -> float | None:
    return None if math.isinf(v) or math.isnan(v) else v


def to_json(reports: Sequence[PointReport]) -> dict[str, Any]:
    points = []
    for r in reports:
        g = r.grid
        opt_config, opt_us = g.optimum
        wall, estimated = g.wall_s()
        points.append({
            "point": {"kernel": g.point.kernel, "dims": g.point.dim, "batch": g.point.batch,
                      "seq": g.point.seq, "dtype": g.point.dtype, "weights": g.point.weights,
                      "gpu": r.gpu, "backend": r.backend, "source": g.label},
            "grid": {
                "size": g.size, "pruned": len(g.plan.infeasible), "raw": g.plan.raw_size,
                "wall_s": wall, "wall_extrapolated": estimated, "compile_s": g.compile_s(),
                "evaluation_s": _per_eval_s(g),
                "optimum": {"config": opt_config, "time_us": opt_us},
                "default": {"config": g.default,
                            "time_us": g.time_us(config_key(g.default))},
                "within": {_pct(t): g.count_within(t) for t in THRESHOLDS},
                "neighbour_winners": g.neighbours,
            },
            "strategies": [{
                "name": s.strategy.name, "description": s.strategy.description,
                "budget": s.budget,
                "median": {_pct(t): s.median(t) for t in THRESHOLDS},
                "mean": {_pct(t): s.mean(t)[0] for t in THRESHOLDS},
                "mean_is_lower_bound": {_pct(t): s.mean(t)[1] for t in THRESHOLDS},
                f"reached_2%_within_{_pct(WITHIN_GRID_FRACTION)}_of_grid":
                    s.within_grid_fraction,
                "sampler_s_per_ask": s.sampler_s_per_ask,
                "runs": [{"seed": run.seed, "evaluations": run.evaluations, "asks": run.asks,
                          "sampler_s": run.sampler_s, "best_us": _finite(run.best_us),
                          "reached": {_pct(t): run.reached[t] for t in THRESHOLDS}}
                         for run in s.runs],
            } for s in r.summaries],
            "skipped": r.skipped,
        })
    return {"thresholds": [_pct(t) for t in THRESHOLDS], "points": points}


def rich_table(r: PointReport) -> Table:
    t = Table(title=f"Evaluations until the best config found is within 2% of the optimum "
                    f"({r.grid.size} configs in the grid)", caption=LEGEND)
    for col in COLUMNS:
        t.add_column(col)
    for s in r.summaries:
        row = summary_row(s, r.grid)
        t.add_row(*(row[c] for c in COLUMNS))
    return t


def write_reports(reports: Sequence[PointReport], markdown_path: str | None,
                  json_path: str | None) -> list[str]:
    """Writes the Markdown and/or JSON reports; returns the paths written."""
    written = []
    if markdown_path:
        Path(markdown_path).write_text(to_markdown(reports) + "\n")
        written.append(markdown_path)
    if json_path:
        Path(json_path).write_text(json.dumps(to_json(reports), indent=1) + "\n")
        written.append(json_path)
    return written
