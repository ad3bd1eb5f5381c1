"""Shapes no table holds: the config the lookup gives them (carried over from the nearest tuned
dims, `nearby`, or the default heuristic), the default heuristic itself, and the winner of a
fresh search of the point, timed side by side on one GPU.

For each held-out shape and row count: `fusetune.resolve` says where the lookup's config comes
from (the shipped tables, or --tables); `fusetune search --points FILE --trials N` tunes
every point in one process into a scratch database (--db; the same one again resumes)
and `fusetune export` writes the winners; then the three configs are timed as the other
benchmarks time kernels (do_bench of CUDA-graph replays, L2 flushed, interleaved
rounds). Shapes: KERNEL:name=value,... separated by spaces, e.g.
`ffn:dim=5120,hidden=13824` (Llama-2-13B's and Qwen2.5-14B's feed-forward).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks.timing import heading, parser, run, start
from fusetune.kernels import get_spec
from fusetune.spec import Point

IMPLS = ("lookup", "default", "search")
# Held-out shapes: dims of models no shipped table holds.
SHAPES = ("ffn:dim=5120,hidden=13824 ffn:dim=3072,hidden=8192 ffn:dim=3584,hidden=14336 "
          "ffn:dim=5120,hidden=14336 ffn:dim=2048,hidden=11008 "
          "qkv:dim=5120,head_dim=128,interleaved=0,n_heads=40,n_kv_heads=8 "
          "qkv:dim=3072,head_dim=96,interleaved=0,n_heads=32,n_kv_heads=32 "
          "qkv:dim=3584,head_dim=256,interleaved=0,n_heads=16,n_kv_heads=8")


def parse_shape(text: str) -> tuple[str, dict[str, int]]:
    kernel, _, dims = text.partition(":")
    return kernel, {k: int(v) for k, v in (kv.split("=") for kv in dims.split(","))}


Key = tuple[str, tuple[tuple[str, int], ...], int]  # (kernel, sorted dims, rows)


def key(kernel: str, dims: dict[str, int], rows: int) -> Key:
    return kernel, tuple(sorted(dims.items())), rows


def searched(points: list[tuple[str, dict[str, int], int]], dtype: str, trials: int, db: str
             ) -> dict[Key, dict[str, int]]:
    """The winners of a fresh `fusetune search` of every (kernel, dims, rows) point, one
    process for all of them (`search --points`, as a user runs it), keyed by `key`."""
    with tempfile.TemporaryDirectory() as tmp:
        listed = Path(tmp) / "points.yaml"
        listed.write_text(yaml.safe_dump({"points": [
            {"kernel": k, "dims": d, "rows": r, "dtype": dtype} for k, d, r in points]}))
        subprocess.run([sys.executable, "-m", "fusetune.cli", "search", "--kernel", "all",
                        "--points", str(listed), "--trials", str(trials), "--db", db,
                        "--compile-workers", "8"], check=True, stdout=subprocess.DEVNULL)
        table = Path(tmp) / "winners.yaml"
        subprocess.run([sys.executable, "-m", "fusetune.cli", "export", str(table), "--db", db],
                       check=True, stdout=subprocess.DEVNULL)
        data = yaml.safe_load(table.read_text())
    won = {}
    for entries in data["gpus"].values():
        for kernel, es in entries.items():
            for e in es:
                if e["dtype"] == dtype and not e.get("weights"):
                    won[key(kernel, e["dims"], e["batch"] * e["seq"])] = dict(e["config"])
    missing = [f"{k} {d} at {r} rows" for k, d, r in points if key(k, d, r) not in won]
    if missing:
        raise RuntimeError(f"no winner in {db} for {'; '.join(missing)}")
    return won


def make_case(kernel: str, dims: dict[str, int], rows: int, dtype: str, gpu: Any,
              won: dict[Key, dict[str, int]] | None) -> dict[str, Any]:
    import fusetune

    spec = get_spec(kernel)
    point = Point.make(kernel, dims, rows, 1, dtype)
    resolution = fusetune.resolve(kernel, dims, dtype, rows=rows, warn=False)
    configs = {"lookup": resolution.config,
               "default": spec.canonical(spec.default_config(point, gpu), point),
               "search": None if won is None else won[key(kernel, dims, rows)]}
    inputs = spec.make_inputs(point, "cuda")
    outputs = spec.make_outputs(inputs)

    def launch(config: dict[str, int]) -> Any:
        return lambda: spec.launch(inputs, outputs, config)

    return {"name": f"{kernel} {','.join(f'{k}={v}' for k, v in dims.items())}, {rows} rows",
            "source": resolution.source + (" (marginal: default)" if resolution.marginal
                                           else ""), "configs": configs,
            "fns": {k: None if c is None else launch(c) for k, c in configs.items()}}


def main() -> int:
    ap = parser(__doc__ or "", IMPLS)
    ap.add_argument("--shapes", default=SHAPES, help="KERNEL:name=value,... separated by spaces")
    ap.add_argument("--rows", default="1", help="row counts, comma-separated")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--trials", type=int, default=40, help="trials of the fresh search (0: none)")
    ap.add_argument("--db", default="sqlite:///nearby.db", help="the fresh searches' database")
    args = ap.parse_args()
    gpu = start(args)
    if gpu is None:
        return 2
    points = [(k, d, int(r)) for k, d in map(parse_shape, args.shapes.split())
              for r in args.rows.split(",")]
    won = searched(points, args.dtype, args.trials, args.db) if args.trials else None
    cases = [make_case(k, d, r, args.dtype, gpu, won) for k, d, r in points]
    medians, _ = run(args, cases)
    print(heading(gpu, f"{args.dtype}; lookup: the config fusetune.resolve gives (its source), "
                       f"search: a fresh {args.trials}-trial search's winner"))
    print("| point | lookup source | lookup µs | default µs | search µs | lookup / search | "
          "lookup / default |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for case, m in zip(cases, medians, strict=True):
        look, default, search = m.get("lookup"), m.get("default"), m.get("search")

        def ratio(a: float | None, b: float | None) -> str:
            return "–" if a is None or b is None else f"{a / b:.2f}"

        def us(v: float | None) -> str:
            return "–" if v is None else f"{v:.1f}"

        print(f"| {case['name']} | {case['source']} | {us(look)} | {us(default)} | "
              f"{us(search)} | {ratio(look, search)} | {ratio(look, default)} |")
    return 0


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    sys.exit(main())
