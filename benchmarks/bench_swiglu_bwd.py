"""SwiGLU's backward (da, db from a, b, dy) side by side on one GPU, in one process, at
training sizes: the tuned swiglu_bwd kernel (lookup table; what fusetune.swiglu's autograd
launches) vs its default heuristic vs torch eager's autograd backward of F.silu(a) * b vs
torch.compile's backward of it vs Liger Kernel's silu·mul backward (if installed; it writes da
and db over a and b, so it allocates nothing) vs a device-to-device copy of the same bytes,
beside the roofline floor (bytes / 3.0 TB/s).

The autograd backwards (eager, compile, liger) rerun the graph of one forward
(retain_graph=True), as plain calls (as in bench_rope_bwd: autograd runs a backward on the
streams of its forward, so it cannot be captured apart from it); the fusetune kernels run as
graph replays.

    python -m benchmarks.bench_swiglu_bwd --tables tables.yaml --rows 8192 --hidden 14336
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

import fusetune
from benchmarks.bench_rope_bwd import AUTOGRAD
from benchmarks.bench_swiglu import IMPLS, copy_of, eager_swiglu, gate_inputs, table
from benchmarks.timing import (
    PLAIN,
    compile_static,
    heading,
    keep_saved_tensors,
    parser,
    report,
    run,
    start,
)
from fusetune.kernels.swiglu_bwd import SPEC, swiglu_bwd
from fusetune.spec import Point


def backward_of(forward: Callable[..., torch.Tensor], a: torch.Tensor, b: torch.Tensor,
                dy: torch.Tensor) -> Callable[[], Any]:
    """The autograd backward of `forward` at leaves a, b that require grad: the forward runs
    once here, each call reruns its backward for dy."""
    y = forward(a, b)
    return lambda: torch.autograd.grad(y, (a, b), dy, retain_graph=True)


def make_case(m: int, h: int, dtype_name: str, gpu: Any, compiled: Callable[..., Any],
              liger: bool) -> dict[str, Any]:
    a, b, dy = gate_inputs(m, h, dtype_name, 3)
    point = Point.make("swiglu_bwd", {"hidden": h}, 1, m, dtype_name)
    tuned_cfg = fusetune.lookup("swiglu_bwd", {"hidden": h}, dtype_name, rows=m)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    ref = SPEC.reference({"a": a, "b": b, "dy": dy})
    da, db = swiglu_bwd(a, b, dy)
    err = max(float((out.float() - ref[k]).norm() / ref[k].norm())
              for k, out in (("da", da), ("db", db)))
    assert err < SPEC.tolerance[dtype_name], f"tuned swiglu_bwd wrong: rel err {err}"
    al, bl = a.detach().requires_grad_(), b.detach().requires_grad_()
    grads = torch.autograd.grad(fusetune.swiglu(al, bl), (al, bl), dy)
    assert torch.equal(grads[0], da) and torch.equal(grads[1], db), \
        "fusetune.swiglu's backward differs from swiglu_bwd"
    fns = {
        "tuned": lambda: swiglu_bwd(a, b, dy),
        "default": lambda: swiglu_bwd(a, b, dy, config=default_cfg),
        "eager": backward_of(eager_swiglu, al, bl, dy),
        "compile": backward_of(compiled, al, bl, dy),
        "liger": _liger_backward(a, b, dy) if liger else None,
        "copy": copy_of(SPEC.cost(point).bytes),
    }
    return {"label": f"{m}×{h}", "dtype": dtype_name, "fns": fns, "tuned_cfg": tuned_cfg,
            "default_cfg": default_cfg, "rel_err": err, "bytes": SPEC.cost(point).bytes}


def _liger_backward(a: torch.Tensor, b: torch.Tensor, dy: torch.Tensor
                    ) -> Callable[[], Any] | None:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    # Its own copies: its backward overwrites the a and b it saved with da and db.
    al, bl = a.clone().requires_grad_(), b.clone().requires_grad_()
    try:
        fn = backward_of(LigerSiLUMulFunction.apply, al, bl, dy)
        fn()
    except Exception as e:  # another Liger release's interface: leave the column out
        print(f"note: Liger's silu·mul backward did not run ({e}); its column is left out",
              file=sys.stderr)
        return None
    return fn


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, IMPLS)
    ap.add_argument("--rows", default="8192", help="rows (batch × seq), comma-separated "
                    "(default: 4 × 2048 tokens)")
    ap.add_argument("--hidden", type=int, default=14336, help="H (default: Llama-3-8B's)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    gpu = start(args)
    if gpu is None:
        return 2
    keep_saved_tensors()
    compiled = compile_static(eager_swiglu)
    try:
        import liger_kernel.ops.swiglu  # noqa: F401
        liger = True
    except Exception:
        liger = False
    cases = [make_case(m, args.hidden, dt, gpu, compiled, liger)
             for dt in args.dtype.split(",") for m in (int(v) for v in args.rows.split(","))]
    medians, host = run(args, cases, plain=PLAIN | AUTOGRAD)
    head = heading(gpu, "SwiGLU backward (da, db from a, b, dy); (TB/s) beside each time; "
                   "eager, compile and liger: autograd backwards",
                   graphs=not args.no_graph, plain=PLAIN | AUTOGRAD)
    lines, raw = table(head, cases, medians, SPEC.config_keys)
    report(lines, raw, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
