"""RMSNorm backward side by side on one GPU, in one process: dx and dweight by fusetune's
rmsnorm_bwd, tuned (lookup table) vs the default heuristic, vs the backward pass of torch eager
autograd (Hugging Face's Llama RMSNorm), of torch.compile and of Liger Kernel's RMSNorm (if
installed), vs a device-to-device copy that reads and writes as many bytes as the kernel must
(read x and dy, write dx: the memory ceiling at that size).

Medians of triton.testing.do_bench (L2 flushed). fusetune's two columns, Liger's and the copy
are CUDA-graph replays: the GPU time of their kernels alone. A plain call would add its launch
path's Python wherever that takes longer than do_bench's flush between calls (at 4096 × 4096
a call's 60-240 µs of CPU against a 40-60 µs kernel: the plain-call times of every column
there moved with the machine's load). Liger is called through its backward function
(`rms_norm_backward`, with the row statistics its forward kept), as its autograd.Function
does. The eager and compiled columns stay plain calls of the backward (torch.autograd.grad on
the kept graph of one forward): autograd launches a backward's kernels on the streams its
forward ran on, which a graph captured on a stream of its own does not record; their times can
hold Python at the smaller sizes. The Python-side cost of one call is printed under the table.

    python -m benchmarks.bench_rmsnorm_bwd --tables tables.yaml \
        --shapes 4096x4096,16384x4096,8192x8192 --dtype bfloat16 --markdown out.md
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch

import fusetune
from benchmarks.bench_rmsnorm import eager_rmsnorm
from benchmarks.timing import (
    compile_static,
    heading,
    keep_saved_tensors,
    parser,
    report,
    run,
    start,
)
from fusetune.kernels.rmsnorm_bwd import SPEC
from fusetune.spec import Point

FLOOR_TBS = 3.0  # measured device-to-device copy ceiling of the H100 (bytes read + written)
EPS = 1e-6
IMPLS = ("tuned", "default", "eager", "compile", "liger", "copy")
PLAIN_BACKWARD = frozenset({"eager", "compile"})


def liger_backward(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
                   ) -> Callable[[], object] | None:
    """Liger Kernel's RMSNorm backward at (x, w) for dy, called as LigerRMSNormFunction.backward
    calls it (not in place, dweight asked for), after one forward for its saved row statistics;
    None without Liger Kernel."""
    try:
        from liger_kernel.ops.rms_norm import rms_norm_backward, rms_norm_forward
    except Exception:
        return None
    _, x2, rstd, block, warps, mode = rms_norm_forward(x, w, EPS, 0.0, "llama", None)
    return lambda: rms_norm_backward(dy, x2, w, rstd, 0.0, mode, block, warps, False, None,
                                     needs_dw=True)


def backward_of(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                w: torch.Tensor, dy: torch.Tensor) -> Callable[[], object]:
    """The backward pass of `forward` at (x, w) for the output gradient dy, as a callable: the
    forward runs once here and its graph is kept for every call."""
    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_()
    y = forward(xg, wg)
    return lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)


def make_case(m: int, d: int, dtype_name: str, gpu: Any, compiled: Callable[..., Any]
              ) -> dict[str, Any]:
    """Inputs and one callable per implementation at [m, d]; checks the tuned gradients
    against the spec's reference first."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    x = torch.randn(m, d, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(d, device="cuda")).to(dtype)
    dy = torch.randn(m, d, device="cuda", dtype=dtype)
    point = Point.make("rmsnorm_bwd", {"dim": d}, 1, m, dtype_name)
    tuned_cfg = fusetune.lookup("rmsnorm_bwd", {"dim": d}, dtype_name, rows=m)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    ref = SPEC.reference({"x": x, "weight": w, "dy": dy, "eps": EPS})
    dx, dw = fusetune.rmsnorm_bwd(x, w, dy, eps=EPS)
    err = max(float((out.float() - r).norm() / r.norm())
              for out, r in ((dx, ref["dx"]), (dw, ref["dw"])))
    assert err < SPEC.tolerance[dtype_name], f"tuned rmsnorm_bwd wrong: rel err {err}"
    del ref, dx, dw
    elt = x.element_size()
    # A flat copy that reads and writes 3·m·d elements in all, as the kernel does.
    src = torch.empty(3 * m * d // 2, device="cuda", dtype=dtype)
    dst = torch.empty_like(src)
    fns: dict[str, Callable[[], object] | None] = {
        # The application's call: the config comes from the lookup table (cached).
        "tuned": lambda: fusetune.rmsnorm_bwd(x, w, dy, eps=EPS),
        "default": lambda: fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, config=default_cfg),
        "eager": backward_of(lambda a, b: eager_rmsnorm(a, b, EPS), x, w, dy),
        "compile": backward_of(compiled, x, w, dy),
        "liger": liger_backward(x, w, dy),
        "copy": lambda: dst.copy_(src),
    }
    return {"m": m, "d": d, "dtype": dtype_name, "fns": fns, "tuned_cfg": tuned_cfg,
            "default_cfg": default_cfg, "rel_err": err,
            "bytes": SPEC.cost(point).bytes, "copy_bytes": 2 * src.numel() * elt}


def row(case: dict[str, Any], t: dict[str, float | None]) -> tuple[str, dict[str, Any]]:
    nbytes, copy_bytes = case["bytes"], case["copy_bytes"]

    def cell(k: str) -> str:
        v = t.get(k)
        if v is None:
            return "-"
        b = copy_bytes if k == "copy" else nbytes
        return f"{v:.1f} ({b / v / 1e6:.2f})"

    tuned, copy = t.get("tuned"), t.get("copy")
    ratio = (nbytes / tuned) / (copy_bytes / copy) if tuned and copy else math.nan
    floor = nbytes / (FLOOR_TBS * 1e6)
    cfg = "/".join(str(case["tuned_cfg"][k]) for k in SPEC.config_keys)
    line = (f"| {case['dtype']} | {case['m']}x{case['d']} | {nbytes / 1e6:.1f} | {floor:.1f} | "
            + " | ".join(cell(k) for k in IMPLS) + f" | {100 * ratio:.0f}% | {cfg} |")
    record = {k: case[k] for k in ("dtype", "m", "d", "bytes", "tuned_cfg", "default_cfg",
                                   "rel_err")}
    record.update(us=t, floor_us=floor, tuned_over_copy_bw=ratio)
    return line, record


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, IMPLS)
    ap.add_argument("--shapes", default="4096x4096,16384x4096,8192x8192",
                    help="comma-separated ROWSxDIM")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if any(len(s) != 2 for s in shapes):
        ap.error(f"--shapes {args.shapes}: expected ROWSxDIM,ROWSxDIM,...")
    gpu = start(args)
    if gpu is None:
        return 2
    keep_saved_tensors()
    compiled = compile_static(lambda a, b: eager_rmsnorm(a, b, EPS))
    head = heading(gpu, "dx and dweight; (TB/s) beside each time, counting x and dy read and "
                        "dx written", graphs=not args.no_graph, plain=PLAIN_BACKWARD)
    cols = ["dtype", "M x D", "MB moved", "floor µs", "tuned", "default", "eager", "compile",
            "liger", "copy", "tuned/copy BW", "tuned BLOCK_D/ROWS/PROGRAMS/warps/stages"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    raw = []
    cases = [make_case(m, d, dt, gpu, compiled) for dt in args.dtype.split(",")
             for m, d in shapes]
    # see the docstring: autograd's backward cannot be captured in a graph
    medians, host = run(args, cases, plain=PLAIN_BACKWARD)
    for case, t in zip(cases, medians, strict=True):
        line, record = row(case, t)
        lines.append(line)
        raw.append(record)
    report(lines, raw, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
