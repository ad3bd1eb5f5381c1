"""RMSNorm side by side on one GPU, in one process: tuned (lookup table) vs the default heuristic
vs torch eager vs torch.compile vs Liger Kernel (if installed) vs a device-to-device copy of the
same bytes (the memory ceiling at that size). Medians of triton.testing.do_bench (L2 flushed)
over CUDA-graph replays of each implementation, plus the Python-side cost of one call. The copy
is timed twice: as a plain call ("copy") and captured in a CUDA graph like the kernels
("copy graph"); the table gives the tuned kernel's bandwidth against each.

    python -m benchmarks.bench_rmsnorm --tables tables.yaml --dim 4096 \
        --rows 1,32,512,4096,16384 --dtype float16,bfloat16 --markdown out.md
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

import fusetune
from benchmarks.timing import compile_static, heading, parser, report, run, start
from fusetune.kernels.rmsnorm import SPEC
from fusetune.spec import Point

FLOOR_TBS = 3.0  # measured device-to-device copy ceiling of the H100 (bytes read + written)


def eager_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """Hugging Face Llama's RMSNorm, the way applications run it today; with `residual`, that
    added to the normalized rows (Gemma's norms before their residual adds)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = w * h.to(x.dtype)
    return y if residual is None else residual + y


def liger_rmsnorm() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:
        return None
    return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)


IMPLS = ("tuned", "default", "eager", "compile", "liger", "copy", "copy_graph")
COPIES = ("copy", "copy_graph")


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
    out = fusetune.rmsnorm(x, w, eps=1e-6)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < SPEC.tolerance[dtype_name], f"tuned rmsnorm wrong: rel err {err}"
    fns: dict[str, Callable[[], object] | None] = {
        # The application's call: the config comes from the lookup table (cached).
        "tuned": lambda: fusetune.rmsnorm(x, w, eps=1e-6),
        "default": lambda: fusetune.rmsnorm(x, w, eps=1e-6, config=default_cfg),
        "eager": lambda: eager_rmsnorm(x, w),
        "compile": lambda: compiled(x, w),
        "liger": (lambda: liger(x, w)) if liger else None,
        "copy": lambda: y.copy_(x),
        "copy_graph": lambda: y.copy_(x),  # the same copy, captured in a graph (not PLAIN)
    }
    return {"m": m, "d": d, "dtype": dtype_name, "fns": fns, "x": x, "w": w, "y": y,
            "tuned_cfg": tuned_cfg, "default_cfg": default_cfg, "rel_err": err,
            "bytes": 2 * m * d * x.element_size() + d * w.element_size(),
            "copy_bytes": 2 * m * d * x.element_size()}


def row(case: dict[str, object], t: dict[str, float | None]) -> tuple[str, dict[str, object]]:
    nbytes, copy_bytes = case["bytes"], case["copy_bytes"]

    def cell(k: str) -> str:
        v = t[k]
        if v is None:
            return "-"
        b = copy_bytes if k in COPIES else nbytes
        return f"{v:.1f} ({b / v / 1e6:.2f})"

    tuned_bw = nbytes / t["tuned"] if t["tuned"] else math.nan
    ratios = {k: tuned_bw / (copy_bytes / t[k]) if t[k] else math.nan for k in COPIES}
    floor = nbytes / (FLOOR_TBS * 1e6)
    cfg = "/".join(str(case["tuned_cfg"][k]) for k in SPEC.config_keys)
    line = (f"| {case['dtype']} | {case['m']} | {nbytes / 1e6:.1f} | {floor:.1f} | "
            + " | ".join(cell(k) for k in IMPLS)
            + "".join(f" | {100 * ratios[k]:.0f}%" for k in COPIES) + f" | {cfg} |")
    record = {k: case[k] for k in ("dtype", "m", "d", "bytes", "tuned_cfg", "default_cfg",
                                   "rel_err")}
    record.update(us=t, tuned_over_copy_bw=ratios["copy"],
                  tuned_over_copy_graph_bw=ratios["copy_graph"])
    return line, record


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, IMPLS)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--rows", default="1,32,512,4096,16384")
    ap.add_argument("--dtype", default="float16,bfloat16")
    args = ap.parse_args(argv)
    gpu = start(args)
    if gpu is None:
        return 2
    liger = liger_rmsnorm()
    compiled = compile_static(eager_rmsnorm)
    d = args.dim
    head = heading(gpu, f"D={d}; (TB/s) beside each time", graphs=not args.no_graph)
    cols = ["dtype", "M", "MB moved", "floor µs", "tuned", "default", "eager", "compile",
            "liger", "copy", "copy graph", "tuned/copy BW", "tuned/copy graph BW",
            "tuned BLOCK_D/ROWS/warps/stages"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    raw = []
    cases = [make_case(m, d, dt, gpu, compiled, liger) for dt in args.dtype.split(",")
             for m in (int(v) for v in args.rows.split(","))]
    medians, host = run(args, cases)
    for case, t in zip(cases, medians, strict=True):
        line, record = row(case, t)
        lines.append(line)
        raw.append(record)
    report(lines, raw, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
