"""Compiling ahead, measured: one point's exhaustive grid (or search) run twice, with
--compile-workers 0 and with N, each in a fresh process with an empty Triton cache and database.

Each run is `fusetune evaluate-search` (mode grid: every distinct feasible config, then a short
replay) or `fusetune search` (mode search: --trials configs) in a subprocess, with
TRITON_CACHE_DIR and the SQLite database in a new temporary directory, so that nothing compiled
by one run helps the other. Printed per run: its wall time, the configs it evaluated and their
rate, the seconds the timing process spent compiling and checking (summed from the stored
results), and the best time found (the two runs should agree: compile processes must not
disturb the timing). A run that exceeds --time-cap is interrupted (what it stored is kept) and
compared by its rate.

    python benchmarks/bench_compile_ahead.py                       # ffn, Llama-2-7B, b=1 s=1
    python benchmarks/bench_compile_ahead.py --kernel rmsnorm --mode search --trials 40
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.script_args import doc_summary

INTERRUPT_WAIT_S = 30.0  # after Ctrl-C at the time cap, before the run is killed


@dataclass
class Run:
    label: str
    workers: int | None  # None: fusetune's default
    wall_s: float = 0.0
    returncode: int | None = None
    capped: bool = False
    evaluated: int = 0  # configs that ran (pruned ones are not counted)
    ok: int = 0
    compile_s: float = 0.0  # in the timing process, summed over the stored results
    best_us: float | None = None  # fastest stored time
    winner_us: float | None = None  # the winner, re-timed
    summary: str = ""  # fusetune's line about compiling
    error: str = ""

    @property
    def rate(self) -> float | None:
        return self.evaluated / self.wall_s if self.wall_s > 0 and self.evaluated else None


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--mode", choices=("grid", "search"), default="grid")
    ap.add_argument("--kernel", default="ffn")
    ap.add_argument("--model", default=None, help="model preset (default: llama-2-7b unless "
                    "--dims or --dim is given)")
    ap.add_argument("--dims", default=None, help="name=value,... instead of --model")
    ap.add_argument("--dim", default=None, help="the width instead of --model")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--seq", default="1")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--gpu", default=None, help="GPU name (default: the first visible)")
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "interpreter"))
    ap.add_argument("--space", default=None, help="search-space YAML (default: the kernel's)")
    ap.add_argument("--trials", type=int, default=40, help="configs per search (mode search)")
    ap.add_argument("--workers", type=int, default=None,
                    help="compile processes of the second run (default: fusetune's default)")
    ap.add_argument("--time-cap", type=float, default=300.0,
                    help="seconds per run; a run still going then is interrupted")
    ap.add_argument("--in-process", action="store_true",
                    help="time configs in the search's own process (default: --isolate)")
    ap.add_argument("--trial-timeout", type=float, default=120.0)
    ap.add_argument("--keep", default=None,
                    help="keep each run's database, Triton cache and output under this folder")
    ap.add_argument("--markdown", help="write the table here too")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    if args.model is None and args.dims is None and args.dim is None:
        args.model = "llama-2-7b"
    return args


def command(args: argparse.Namespace, db: str, workers: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "fusetune.cli"]
    if args.mode == "grid":
        cmd += ["evaluate-search", "--seeds", "1", "--strategies", "random"]
    else:
        cmd += ["search", "--trials", str(args.trials), "--seed", "0"]
    cmd += ["--kernel", args.kernel, "--batch", args.batch, "--seq", args.seq, "--dtype",
            args.dtype, "--db", db, "--backend", args.backend,
            "--trial-timeout", str(args.trial_timeout)]
    for flag, value in (("--model", args.model), ("--dims", args.dims), ("--dim", args.dim),
                        ("--gpu", args.gpu), ("--space", args.space)):
        if value is not None:
            cmd += [flag, value]
    cmd.append("--in-process" if args.in_process else "--isolate")
    if workers is not None:
        cmd += ["--compile-workers", str(workers)]
    return cmd


def run_capped(cmd: list[str], env: dict[str, str], cap: float, log: Path
               ) -> tuple[int | None, bool, float]:
    """(return code, whether the cap interrupted it, wall seconds); output into `log`."""
    t0 = time.monotonic()
    with log.open("w") as out:
        # its own process group: at the cap, Ctrl-C goes to the run and its worker and compile
        # processes, and nothing else
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=cap), False, time.monotonic() - t0
        except subprocess.TimeoutExpired:
            wall = time.monotonic() - t0
            os.killpg(proc.pid, signal.SIGINT)  # stores what finished, as Ctrl-C does
            try:
                proc.wait(timeout=INTERRUPT_WAIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return proc.returncode, True, wall


def read_results(db_path: Path, run: Run) -> None:
    import sqlite3

    if not db_path.exists():
        return
    con = sqlite3.connect(str(db_path))
    try:
        rows = con.execute("SELECT status, compile_s, time_us FROM ft_results").fetchall()
        try:
            winners = con.execute("SELECT time_us FROM ft_winners").fetchall()
        except sqlite3.OperationalError:
            winners = []
    except sqlite3.OperationalError as e:  # the run died before making the tables
        run.error = run.error or f"no results: {e}"
        return
    finally:
        con.close()
    ran = [r for r in rows if r[0] != "infeasible"]
    run.evaluated = len(ran)
    run.ok = sum(1 for r in ran if r[0] == "ok")
    run.compile_s = sum(r[1] or 0.0 for r in ran)
    times = [r[2] for r in ran if r[0] == "ok" and r[2] is not None]
    run.best_us = min(times) if times else None
    run.winner_us = min((w[0] for w in winners), default=None)


def one_run(args: argparse.Namespace, label: str, workers: int | None, root: Path) -> Run:
    run = Run(label, workers)
    where = root / label
    where.mkdir(parents=True)
    env = dict(os.environ, TRITON_CACHE_DIR=str(where / "triton-cache"), PYTHONUNBUFFERED="1")
    db_path = where / "fusetune.db"
    log = where / "output.log"
    cmd = command(args, f"sqlite:///{db_path}", workers)
    print(f"[{label}] {' '.join(cmd[1:])}", flush=True)
    try:
        run.returncode, run.capped, run.wall_s = run_capped(cmd, env, args.time_cap, log)
    except OSError as e:
        run.error = f"could not run: {e}"
        return run
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if "Compiling and checking" in line]
    run.summary = " ".join(lines[-1].split()) if lines else ""
    if run.returncode not in (0, 130) and not run.capped:
        run.error = f"exit code {run.returncode}: " + " ".join(text[-1500:].split())
    read_results(db_path, run)
    print(f"[{label}] {run.wall_s:.1f} s, {run.evaluated} configs"
          + (" (capped)" if run.capped else "") + (f"; {run.error}" if run.error else ""),
          flush=True)
    return run


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(runs: list[Run]) -> list[str]:
    out = ["| run | compile workers | wall s | configs | configs/s | compiling in the timing "
           "process s | per config s | best µs | winner µs |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        per = r.compile_s / r.evaluated if r.evaluated else None
        out.append(f"| {r.label}{' (capped)' if r.capped else ''} | "
                   f"{'default' if r.workers is None else r.workers} | {r.wall_s:.1f} | "
                   f"{r.evaluated} | {fmt(r.rate, '.2f')} | {r.compile_s:.1f} | "
                   f"{fmt(per, '.3f')} | {fmt(r.best_us, '.2f')} | {fmt(r.winner_us, '.2f')} |")
    return out


def verdict(off: Run, on: Run) -> str:
    if off.error or on.error:
        return "no comparison: a run failed"
    if not off.capped and not on.capped and off.evaluated == on.evaluated and on.wall_s > 0:
        # The grid runs the same configs; a search samples its own in each run (the batched
        # asking changes the sampler's trajectory), as many of them.
        return (f"{off.evaluated} configs each: {off.wall_s:.1f} s without compiling ahead, "
                f"{on.wall_s:.1f} s with it ({off.wall_s / on.wall_s:.2f}× faster)")
    if off.rate and on.rate:
        return (f"configs per second: {off.rate:.2f} without compiling ahead, {on.rate:.2f} "
                f"with it ({on.rate / off.rate:.2f}×; a run was capped or they differ in size)")
    return "no comparison: a run evaluated nothing"


def main() -> int:
    args = parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ft-compile-ahead-"))
    if args.keep:
        if root.exists() and any(root.iterdir()):
            print(f"--keep {root}: the folder is not empty; give a new one", file=sys.stderr)
            return 2
        root.mkdir(parents=True, exist_ok=True)
    try:
        runs = [one_run(args, "off", 0, root), one_run(args, "on", args.workers, root)]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    point = (f"{args.kernel} {args.model or args.dims or f'dim={args.dim}'} b={args.batch} "
             f"s={args.seq} {args.dtype}")
    lines = [f"Compiling ahead, {args.mode} of {point} (time cap {args.time_cap:g} s per run, "
             f"{'in-process' if args.in_process else 'isolated'} timing)", "", *table(runs), "",
             verdict(*runs)]
    for r in runs:
        if r.summary:
            lines.append(f"- {r.label}: {r.summary}")
        if r.error:
            lines.append(f"- {r.label} failed: {r.error}")
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    if args.json:
        doc: dict[str, Any] = {"args": vars(args), "runs": [
            {**asdict(r), "rate": r.rate} for r in runs]}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if any(r.error for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
