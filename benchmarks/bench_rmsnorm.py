"""RMSNorm side by side on one GPU, in one process: tuned (lookup table) vs the default heuristic
vs torch eager vs torch.compile vs Liger Kernel (if installed) vs a device-to-device copy of the
same bytes (the memory ceiling at that size). Medians of triton.testing.do_bench (L2 flushed)
over CUDA-graph replays of each implementation, plus the Python-side cost of one call.

    python benchmarks/bench_rmsnorm.py --tables tables.yaml --dim 4096 \
        --rows 1,32,512,4096,16384 --dtype float16,bfloat16 --markdown out.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

import fusetune
from fusetune.kernels._spec import Point
from fusetune.kernels.rmsnorm import SPEC
from fusetune.tables import gpu_for_device

FLOOR_TBS = 3.0  # measured device-to-device copy ceiling of the H100 (bytes read + written)


def eager_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face Llama's RMSNorm, the way applications run it today."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _liger() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:
        return None
    return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)


def median_us(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def as_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` captured in a CUDA graph: replays cost the GPU time of its kernels only, so a slow
    Python launch path cannot leave the GPU idle inside the timed region (inference servers
    launch these kernels from graphs too)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def host_us_per_call(fn: Callable[[], object], n: int = 2000) -> float:
    """Python-side cost of one call (launch path, lookup included), without waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / n * 1e6


IMPLS = ("tuned", "default", "eager", "compile", "liger", "copy")


def make_case(m: int, d: int, dtype_name: str, gpu: object, compiled: Callable[..., object],
              liger: Callable[..., object] | None) -> dict[str, object]:
    """Inputs and one callable per implementation at [m, d]; checks the tuned output first."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    x = torch.randn(m, d, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(d, device="cuda")).to(dtype)
    y = torch.empty_like(x)
    point = Point.make("rmsnorm", {"dim": d}, 1, m, dtype_name)
    tuned_cfg = fusetune.lookup("rmsnorm", {"dim": d}, dtype_name, rows=m)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    ref = eager_rmsnorm(x.float(), w.float())
    out = fusetune.rmsnorm(x, w)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < SPEC.tolerance[dtype_name], f"tuned rmsnorm wrong: rel err {err}"
    fns: dict[str, Callable[[], object] | None] = {
        # The application's call: the config comes from the lookup table (cached).
        "tuned": lambda: fusetune.rmsnorm(x, w),
        "default": lambda: fusetune.rmsnorm(x, w, config=default_cfg),
        "eager": lambda: eager_rmsnorm(x, w),
        "compile": lambda: compiled(x, w),
        "liger": (lambda: liger(x, w)) if liger else None,
        "copy": lambda: y.copy_(x),
    }
    return {"m": m, "d": d, "dtype": dtype_name, "fns": fns, "tuned_cfg": tuned_cfg,
            "default_cfg": default_cfg, "rel_err": err,
            "bytes": 2 * m * d * x.element_size() + d * w.element_size(),
            "copy_bytes": 2 * m * d * x.element_size()}


def row(case: dict[str, object], t: dict[str, float | None]) -> tuple[str, dict[str, object]]:
    nbytes, copy_bytes = case["bytes"], case["copy_bytes"]

    def cell(k: str) -> str:
        v = t[k]
        if v is None:
            return "-"
        b = copy_bytes if k == "copy" else nbytes
        return f"{v:.1f} ({b / v / 1e6:.2f})"

    tuned_bw = nbytes / t["tuned"] if t["tuned"] else math.nan
    copy_bw = copy_bytes / t["copy"] if t["copy"] else math.nan
    floor = nbytes / (FLOOR_TBS * 1e6)
    cfg = "/".join(str(case["tuned_cfg"][k]) for k in SPEC.config_keys)
    line = (f"| {case['dtype']} | {case['m']} | {nbytes / 1e6:.1f} | {floor:.1f} | "
            + " | ".join(cell(k) for k in IMPLS)
            + f" | {100 * tuned_bw / copy_bw:.0f}% | {cfg} |")
    record = {k: case[k] for k in ("dtype", "m", "d", "bytes", "tuned_cfg", "default_cfg",
                                   "rel_err")}
    record.update(us=t, tuned_over_copy_bw=tuned_bw / copy_bw)
    return line, record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", help="lookup table (fusetune export); default: shipped tables")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--rows", default="1,32,512,4096,16384")
    ap.add_argument("--dtype", default="float16,bfloat16")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--impls", default=",".join(IMPLS), help="implementations to time")
    ap.add_argument("--no-graph", action="store_true",
                    help="time the plain Python calls instead of CUDA-graph replays")
    ap.add_argument("--markdown", help="write the table here too")
    ap.add_argument("--json", help="write raw numbers here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.tables:
        fusetune.load_tables(args.tables)
    gpu = gpu_for_device(torch.device("cuda"))
    liger = _liger()
    compiled = torch.compile(eager_rmsnorm)
    d = args.dim
    head = (f"GPU {torch.cuda.get_device_name()} ({gpu.name}), torch {torch.__version__}, "
            f"Triton {triton.__version__}, D={d}; GPU µs (TB/s): medians of do_bench (L2 flushed) "
            "over CUDA-graph replays, median of interleaved rounds")
    cols = ["dtype", "M", "MB moved", "floor µs", "tuned", "default", "eager", "compile",
            "liger", "copy", "tuned/copy BW", "tuned BLOCK_D/ROWS/warps/stages"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    raw = []
    cases = [make_case(m, d, dt, gpu, compiled, liger) for dt in args.dtype.split(",")
             for m in (int(v) for v in args.rows.split(","))]
    # Warm every implementation at every shape first (torch.compile recompiles per shape),
    # so no compilation or first-call work lands inside a timing; the host cost of each call
    # is measured at the smallest shape, then every implementation is captured in a graph.
    for case in cases:
        for fn in case["fns"].values():
            if fn is not None:
                fn()
                fn()
    torch.cuda.synchronize()
    host = {k: host_us_per_call(fn) for k, fn in cases[0]["fns"].items()
            if fn is not None and k in args.impls.split(",")}
    wanted = set(args.impls.split(","))
    for case in cases:
        for k, fn in case["fns"].items():
            if k not in wanted:
                case["fns"][k] = None
            # The copy is timed as a plain call: its memcpy node made graph replays fault on
            # the H100 machine, and its launch path is short enough not to starve the GPU.
            if case["fns"][k] is None or args.no_graph or k == "copy":
                continue
            try:
                case["fns"][k] = as_graph(fn)
            except Exception as e:  # time the plain call instead, and say so
                print(f"note: {k} at M={case['m']} could not be captured ({e}); timed "
                      "without a graph", file=sys.stderr)
    # Rounds interleave the implementations; each figure is the median over rounds of
    # do_bench's median.
    samples: list[dict[str, list[float]]] = [{k: [] for k in IMPLS} for _ in cases]
    for _ in range(args.rounds):
        for case, acc in zip(cases, samples, strict=True):
            for k, fn in case["fns"].items():
                if fn is not None:
                    acc[k].append(median_us(fn))
    for case, acc in zip(cases, samples, strict=True):
        t = {k: (statistics.median(v) if v else None) for k, v in acc.items()}
        line, record = row(case, t)
        lines.append(line)
        raw.append(record)
    c0 = cases[0]
    lines += ["", f"Python-side cost of one call at {c0['dtype']} M={c0['m']} (µs of CPU, no "
              "GPU wait; the GPU times above replay CUDA graphs, except the copy's, "
              "and exclude it): "
              + ", ".join(f"{k} {v:.1f}" for k, v in host.items())]
    text = "\n".join(lines)
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": raw, "host_us": host}, indent=1))
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
