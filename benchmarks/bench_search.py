"""Search efficiency: replays search strategies against every complete exhaustive grid in the
given databases (no GPU needed) and prints, per (kernel, point), each strategy's median
evaluations until the best config so far is within 2% of the grid's optimum, bold where that is
at most a tenth of the grid, and the count over all grids.

A grid is what `fusetune evaluate-search` times on the GPU (every distinct feasible config of
a point, stored like a search's results); `fusetune evaluate-search --no-grid` replays one
point with more detail. Grids of the full spaces take hours a point, so grids are usually
timed on sub-spaces (`--space FILE`): give their folder with --spaces, and each stored point is
replayed on the largest of them (or the kernel's own space) that its grid completes under the
current kernel's configs and default; points without one are left out and listed. To replay
with another version of fusetune, put that checkout first on PYTHONPATH and run this file by
its path.

    python -m benchmarks.bench_search --spaces SUBSPACES_DIR grid.db [grid2.db ...]
    PYTHONPATH=/tmp/old python benchmarks/bench_search.py --strategies fusetune DB ...
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import optuna

from benchmarks.script_args import doc_summary
from fusetune.db.models import PointRow
from fusetune.db.store import Store
from fusetune.kernels import get_spec
from fusetune.tuner.grid import GridError, StoredGrid, load_grid
from fusetune.tuner.replay import WITHIN_GRID_FRACTION, replay_once
from fusetune.tuner.sampling import STRATEGIES
from fusetune.tuner.search import open_storage
from fusetune.tuner.space import SearchSpace, SpaceError, load_space


def complete_grid(store: Store, storage: optuna.storages.BaseStorage, row: PointRow,
                  spaces: Path | None) -> tuple[str, SearchSpace, StoredGrid] | None:
    """(space name, space, grid) of the largest space the point's stored grid completes: the
    kernel's own or one of `spaces`/KERNEL_*.yaml."""
    spec = get_spec(row.kernel)
    best: tuple[str, SearchSpace, StoredGrid] | None = None
    subspaces = sorted(spaces.glob(f"{spec.name}_*.yaml")) if spaces else []
    paths: list[Path | None] = [None, *subspaces]
    for path in paths:
        try:
            space = load_space(spec, path)
            grid = load_grid(store, storage, row, spec, space)
            grid.require_complete()
        except (GridError, SpaceError, KeyError, ValueError):
            continue
        if best is None or grid.size > best[2].size:
            best = (path.stem if path else "full", space, grid)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("dbs", nargs="+", help="SQLite grid databases (files)")
    ap.add_argument("--spaces", type=Path,
                    help="folder of the sub-space YAMLs the grids were timed on "
                         "(KERNEL_NAME.yaml); default: the kernels' own spaces only")
    ap.add_argument("--strategies", default="fusetune,tpe",
                    help=f"comma-separated; valid: {', '.join(STRATEGIES)}")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--budget", type=int, default=30, help="evaluations per replay at most")
    ap.add_argument("--min-size", type=int, default=40, help="leave out smaller grids")
    args = ap.parse_args(argv)
    strategies = [STRATEGIES[s] for s in args.strategies.split(",")]
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    print("| grid database: kernel, point | space | configs | "
          + " | ".join(f"{s.name}: median evals to 2%" for s in strategies) + " |")
    print("|---|---|---:|" + "---:|" * len(strategies))
    met = dict.fromkeys(args.strategies.split(","), 0)
    counted, skipped = 0, []
    for db in args.dbs:
        url = f"sqlite:///{db}"
        store, storage = Store(url), open_storage(url)
        for row in store.points():
            found = complete_grid(store, storage, row, args.spaces)
            label = (f"{Path(db).stem}: {row.kernel} {row.dims} b={row.batch} s={row.seq} "
                     f"{row.dtype}{' ' + row.weights if row.weights else ''}")
            if found is None or found[2].size < args.min_size:
                skipped.append(label)
                continue
            name, space, grid = found
            counted += 1
            cells = []
            for s in strategies:
                runs = [replay_once(grid, space, get_spec(row.kernel), s, seed, args.budget)
                        for seed in range(args.seeds)]
                med = statistics.median(math.inf if r.reached[0.02] is None
                                        else r.reached[0.02] for r in runs)
                ok = med <= WITHIN_GRID_FRACTION * grid.size
                met[s.name] += ok
                cells.append(f">{args.budget}" if math.isinf(med)
                             else f"{'**' if ok else ''}{med:g}{'**' if ok else ''}")
            print(f"| {label} | {name} | {grid.size} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nWithin 2% in at most {WITHIN_GRID_FRACTION:.0%} of the grid (median of "
          f"{args.seeds} seeds, bold): " + ", ".join(f"{k} {v} of {counted}"
                                                       for k, v in met.items()))
    if skipped:
        print(f"Left out ({len(skipped)}: no complete grid under today's configs, or fewer than "
              f"{args.min_size} configs): " + "; ".join(skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
