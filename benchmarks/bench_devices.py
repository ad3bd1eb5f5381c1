"""Tuning throughput on one GPU and on every GPU of the host: `fusetune search --devices 0`
against `--devices all`, the same points, trials and seed, each into a fresh SQLite database and
with a cold Triton cache of its own (so that neither run compiles less because the other did).

Prints, for both runs: the wall time of the whole command, the configs evaluated on a device
(results with a device; pruned configs run nowhere) and the throughput, configs per second of
wall time; then the ratio of the throughputs and, point by point, whether the winners agree.

Winners agree at a point when they are the same config, or when their times are within 2% of
each other: a tie at the noise of this measurement. The two runs may sample different configs
(with several devices a point can start before its neighbours' winners, which seed its study,
exist), so a different config within 2% is not a disagreement; one more than 2% slower is
reported as such. The times compared are both winners re-timed here, after the searches, on one
device (--retime-device, default cuda:0) in interleaved rounds: each search's stored time is from
the GPU that tuned the point, which in the several-device run may be another one than in the
one-device run (GPUs of one model differ by a few percent). The stored times are shown too.

    python3 -m benchmarks.bench_devices --out bench_out            # ffn, 4 points, 24 trials

Each search is stopped (as with Ctrl-C) after --run-timeout seconds (default 110), so that the
whole comparison takes at most about four minutes; a stopped run is reported as failed.
    python3 -m benchmarks.bench_devices --kernel rmsnorm --batch 1,16,64 --seq 1,512 --trials 16

--retime-only DIR re-times an earlier comparison's winners (more --retime-rounds) without
searching again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

TIE = 0.02  # winners whose times differ by at most this fraction are a tie


@dataclass
class Run:
    devices: str
    wall_s: float
    returncode: int
    evaluated: int = 0  # configs run on a device
    by_device: dict[str, int] = field(default_factory=dict)
    # (batch, seq, dtype, weights) as "b=.. s=.. dtype" -> (config JSON, µs, results at the point)
    winners: dict[str, tuple[str, float, int]] = field(default_factory=dict)
    # the same labels -> (kernel, dims JSON, batch, seq, dtype, weights)
    points: dict[str, tuple[str, str, int, int, str, str]] = field(default_factory=dict)

    @property
    def per_s(self) -> float:
        return self.evaluated / self.wall_s if self.wall_s > 0 else 0.0


def read_db(path: Path, run: Run) -> None:
    con = sqlite3.connect(path)
    try:
        run.evaluated = con.execute(
            "SELECT COUNT(*) FROM ft_results WHERE device IS NOT NULL").fetchone()[0]
        run.by_device = dict(con.execute(
            "SELECT device, COUNT(*) FROM ft_results WHERE device IS NOT NULL GROUP BY device "
            "ORDER BY device").fetchall())
        for kernel, dims, batch, seq, dtype, weights, config, time_us, n in con.execute(
                "SELECT p.kernel, p.dims, p.batch, p.seq, p.dtype, p.weights, w.config, "
                "w.time_us, (SELECT COUNT(*) FROM ft_results r WHERE r.point_id = p.id) "
                "FROM ft_points p JOIN ft_winners w ON w.point_id = p.id"):
            label = f"b={batch} s={seq} {dtype}" + (f" w={weights}" if weights else "")
            config = json.dumps(json.loads(config), sort_keys=True, separators=(",", ":"))
            run.winners[label] = (config, float(time_us), int(n))
            run.points[label] = (kernel, dims, int(batch), int(seq), dtype, weights or "")
    finally:
        con.close()


def search(args: argparse.Namespace, devices: str, out: Path, name: str) -> Run:
    """One `fusetune search` into out/NAME.db, with a cold Triton cache of its own (in a
    temporary folder, removed after); its output in out/NAME.log."""
    db = out / f"{name}.db"
    for p in (db, out / f"{name}.db-wal", out / f"{name}.db-shm"):
        p.unlink(missing_ok=True)
    cache = Path(tempfile.mkdtemp(prefix=f"fusetune_{name}_triton_"))
    cmd = [sys.executable, "-m", "fusetune.cli", "search", "--kernel", args.kernel,
           "--batch", args.batch, "--seq", args.seq, "--dtype", args.dtype,
           "--trials", str(args.trials), "--seed", str(args.seed), "--devices", devices,
           "--trial-timeout", str(args.trial_timeout), "--db", f"sqlite:///{db}"]
    cmd += ["--model", args.model] if args.dims is None else ["--dims", args.dims]
    if args.gpu:
        cmd += ["--gpu", args.gpu]
    if args.compile_workers is not None:
        cmd += ["--compile-workers", str(args.compile_workers)]
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    env.pop("TRITON_INTERPRET", None)
    print(f"$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        with open(out / f"{name}.log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                proc.wait(timeout=args.run_timeout)
            except subprocess.TimeoutExpired:  # stop it as Ctrl-C does: its results stay
                print(f"stopping it at the --run-timeout of {args.run_timeout:g} s", flush=True)
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        wall_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    run = Run(devices, wall_s, proc.returncode)
    tail = (out / f"{name}.log").read_text(errors="replace").splitlines()[-12:]
    print("\n".join(tail), flush=True)
    if db.exists():
        read_db(db, run)
    return run


def retime(one: Run, many: Run, device: str, rounds: int) -> dict[str, tuple[float, float]]:
    """label -> (µs of the one-device run's winner, µs of the other's), both timed on `device`
    in `rounds` interleaved rounds (medians; the tuner's own timing: CUDA-graph replays where
    the point is short), for every point where the two winners are different configs."""
    import statistics

    from fusetune.kernels import get_spec
    from fusetune.spec import Point
    from fusetune.tuner.bench import Evaluator

    times: dict[str, tuple[float, float]] = {}
    for label in sorted(set(one.winners) & set(many.winners)):
        a, b = one.winners[label][0], many.winners[label][0]
        if a == b:
            continue
        kernel, dims, batch, seq, dtype, weights = one.points[label]
        spec = get_spec(kernel)
        ev = Evaluator(spec, Point.make(kernel, json.loads(dims), batch, seq, dtype, weights),
                       "cuda", device)
        configs = (json.loads(a), json.loads(b))
        for c in configs:
            if not (out := ev.check(c)).ok:
                print(f"{label}: winner {c} is {out.status} on {device}: {out.reason}")
                break
        else:
            samples: tuple[list[float], list[float]] = ([], [])
            for _ in range(rounds):
                for c, acc in zip(configs, samples, strict=True):
                    acc.append(ev.time(c)[1])
            times[label] = (statistics.median(samples[0]), statistics.median(samples[1]))
            print(f"{label}: re-timed on {device}: {times[label][0]:.2f} vs "
                  f"{times[label][1]:.2f} µs", flush=True)
        del ev
    return times


def agreement(one: Run, many: Run, retimed: dict[str, tuple[float, float]]
              ) -> list[dict[str, object]]:
    rows = []
    for label in sorted(set(one.winners) | set(many.winners)):
        a, b = one.winners.get(label), many.winners.get(label)
        if a is None or b is None:
            rows.append({"point": label, "verdict": "missing in " +
                         ("--devices 0" if a is None else f"--devices {many.devices}")})
            continue
        row: dict[str, object] = {"point": label, "one_us": a[1], "many_us": b[1],
                                  "one_results": a[2], "many_results": b[2],
                                  "one_config": a[0], "many_config": b[0]}
        if a[0] == b[0]:
            row |= {"agree": True, "verdict": "same config"}
        elif label in retimed:
            ta, tb = retimed[label]
            diff = abs(ta - tb) / min(ta, tb)
            faster = "--devices 0's" if ta < tb else f"--devices {many.devices}'s"
            row |= {"one_retimed_us": ta, "many_retimed_us": tb, "agree": diff <= TIE,
                    "verdict": (f"tie: other config within {100 * diff:.1f}%" if diff <= TIE
                                else f"differ: {faster} {100 * diff:.1f}% faster")}
        else:
            row |= {"agree": False, "verdict": "different configs, not re-timed"}
        rows.append(row)
    return rows


def report(one: Run, many: Run, rows: list[dict[str, object]]) -> str:
    lines = ["| run | exit | wall s | configs evaluated | configs/s | per device |",
             "|---|---|---|---|---|---|"]
    for r in (one, many):
        per = ", ".join(f"{d}: {n}" for d, n in r.by_device.items()) or "-"
        lines.append(f"| --devices {r.devices} | {r.returncode} | {r.wall_s:.1f} | "
                     f"{r.evaluated} | {r.per_s:.2f} | {per} |")
    ratio = many.per_s / one.per_s if one.per_s else float("nan")
    n = max(1, len(many.by_device))
    lines += ["", f"Throughput ratio (--devices {many.devices} / --devices 0): {ratio:.2f}× "
                  f"with {len(many.by_device)} devices ({100 * ratio / n:.0f}% of linear); wall "
                  f"time ratio {one.wall_s / many.wall_s:.2f}×.", "",
              "| point | --devices 0 µs | results | "
              f"--devices {many.devices} µs | results | both re-timed on one device µs | "
              "winners |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if "one_us" not in row:
            lines.append(f"| {row['point']} | - | - | - | - | - | {row['verdict']} |")
            continue
        again = (f"{row['one_retimed_us']:.2f} vs {row['many_retimed_us']:.2f}"
                 if "one_retimed_us" in row else "-")
        lines.append(f"| {row['point']} | {row['one_us']:.2f} | {row['one_results']} | "
                     f"{row['many_us']:.2f} | {row['many_results']} | {again} | "
                     f"{row['verdict']} |")
    agree = sum(1 for r in rows if r.get("agree"))
    lines += ["", f"Winners agree at {agree} of {len(rows)} points (same config, or within "
                  f"{100 * TIE:.0f}% of each other's time, both timed on one device)."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="ffn")
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--dims", default=None, help="name=N,... instead of --model")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--seq", default="1,512", help="1: decode; 512: prefill (with --batch 16: "
                                                   "8192 rows)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", default="all", help="the several-device run (default: all)")
    ap.add_argument("--gpu", default=None, help="--gpu for both runs (default: the devices')")
    ap.add_argument("--trial-timeout", type=float, default=60.0)
    ap.add_argument("--run-timeout", type=float, default=110.0,
                    help="seconds each search may take; then it is stopped as with Ctrl-C "
                         "(its stored results are counted, and the run reported as failed)")
    ap.add_argument("--compile-workers", type=int, default=None,
                    help="passed to both runs (default: the search's own default)")
    ap.add_argument("--retime-device", default="cuda:0",
                    help="where both runs' differing winners are timed again, side by side")
    ap.add_argument("--retime-rounds", type=int, default=3)
    ap.add_argument("--retime-only", metavar="DIR",
                    help="run no search: re-time the winners of an earlier comparison's "
                         "databases (DIR/devices_one.db, DIR/devices_all.db, DIR/bench_devices.json"
                         " for the wall times) and report into --out")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    if args.retime_only:
        earlier = Path(args.retime_only)
        runs = json.loads((earlier / "bench_devices.json").read_text())
        one = Run(runs["one"]["devices"], runs["one"]["wall_s"], runs["one"]["returncode"])
        many = Run(runs["many"]["devices"], runs["many"]["wall_s"], runs["many"]["returncode"])
        read_db(earlier / "devices_one.db", one)
        read_db(earlier / "devices_all.db", many)
    else:
        one = search(args, "0", out, "devices_one")
        many = search(args, args.devices, out, "devices_all")
    retimed = retime(one, many, args.retime_device, args.retime_rounds)
    rows = agreement(one, many, retimed)
    text = report(one, many, rows)
    print(text)
    (out / "bench_devices.md").write_text(text + "\n")
    (out / "bench_devices.json").write_text(json.dumps(
        {"args": vars(args), "one": asdict(one) | {"per_s": one.per_s},
         "many": asdict(many) | {"per_s": many.per_s}, "points": rows}, indent=1) + "\n")
    print(f"wrote {out / 'bench_devices.md'} and {out / 'bench_devices.json'}")
    return 0 if one.returncode == 0 and many.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
