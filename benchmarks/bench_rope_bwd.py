"""RoPE's backward (dx from dy) side by side on one GPU, in one process, at training sizes: the
tuned rope_bwd kernel (lookup table; what fusetune.rope's autograd launches) vs its default
heuristic vs torch eager's autograd backward (of Llama's complex-number code for interleaved
pairs, of Hugging Face's rotate_half for half-split) vs torch.compile's backward of the same
code vs Liger Kernel's rope backward (half-split only; it rotates dq and dk together, so its
row counts twice the bytes) vs a device-to-device copy of the same bytes, beside the roofline
floor (bytes / 3.0 TB/s). The tables are those of bench_rope ([1, S, D] cos/sin in x's dtype,
built once; their bytes are left out of "MB moved").

The autograd backwards (eager, compile, liger) rerun the graph of one forward
(retain_graph=True), as plain calls: autograd runs a backward on the streams of its forward,
so it cannot be captured in a CUDA graph apart from it. At these sizes their GPU time is far
above their launch cost. The fusetune kernels and the copy run as elsewhere (graph replays,
a copy as plain calls).

    python -m benchmarks.bench_rope_bwd --tables tables.yaml --shapes 4x2048x32x128,4x2048x8x128
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

import fusetune
from benchmarks.bench_rope import hf_rope, llama_rope, table, tables_for
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
from fusetune.kernels.rope_bwd import SPEC, rope_bwd
from fusetune.spec import Point

IMPLS = ("tuned", "default", "eager", "compile", "liger", "copy")
AUTOGRAD = frozenset({"eager", "compile", "liger"})  # backwards of a retained autograd graph


def backward_of(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                dy: torch.Tensor) -> Callable[[], Any]:
    """The autograd backward of `forward` at x (a leaf that requires grad): the forward runs
    once here, each call reruns its backward for dy."""
    y = forward(x)
    return lambda: torch.autograd.grad(y, x, dy, retain_graph=True)


def make_case(shape: tuple[int, int, int, int], interleaved: bool, dtype_name: str, gpu: Any,
              compiled: dict[str, Callable[..., Any]]) -> dict[str, Any]:
    b, s, h, d = shape
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    x = torch.randn(b, s, h, d, device="cuda", dtype=dtype).requires_grad_()
    dy = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    dx = torch.empty_like(dy)
    dims = {"heads": h, "head_dim": d, "interleaved": int(interleaved)}
    point = Point.make("rope_bwd", dims, b, s, dtype_name)
    tuned_cfg = fusetune.lookup("rope_bwd", dims, dtype_name, rows=b * s)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    freqs_cis, cos, sin = tables_for(s, d, 10000.0, dtype)
    ref = SPEC.reference({"dy": dy, "cos": cos, "sin": sin, "interleaved": interleaved})["dx"]
    out = rope_bwd(dy, cos, sin, interleaved=interleaved)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < SPEC.tolerance[dtype_name], f"tuned rope_bwd wrong: rel err {err}"
    # fusetune.rope's autograd hands the same dy to the same kernel.
    (grad,) = torch.autograd.grad(fusetune.rope(x, cos, sin, interleaved=interleaved), x, dy)
    assert torch.equal(grad, out), "fusetune.rope's backward differs from rope_bwd"
    if interleaved:
        eager = backward_of(lambda t: llama_rope(t, freqs_cis), x, dy)
        comp = backward_of(lambda t: compiled["llama"](t, freqs_cis), x, dy)
        liger = None
    else:
        cos4, sin4 = cos[:, :, None, :], sin[:, :, None, :]
        eager = backward_of(lambda t: hf_rope(t, cos4, sin4), x, dy)
        comp = backward_of(lambda t: compiled["hf"](t, cos4, sin4), x, dy)
        liger = _liger_backward(x, dy, cos, sin)
    fns = {
        "tuned": lambda: rope_bwd(dy, cos, sin, interleaved=interleaved),
        "default": lambda: rope_bwd(dy, cos, sin, interleaved=interleaved, config=default_cfg),
        "eager": eager, "compile": comp, "liger": liger,
        "copy": lambda: dx.copy_(dy),
    }
    nbytes = 2 * dy.numel() * dy.element_size()
    return {"shape": shape, "interleaved": interleaved, "dtype": dtype_name, "fns": fns,
            "tuned_cfg": tuned_cfg, "default_cfg": default_cfg, "rel_err": err,
            "bytes": nbytes}


def _liger_backward(x: torch.Tensor, dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> Callable[[], Any] | None:
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception:
        return None
    # Liger takes q, k as [B, H, S, D] views of [B, S, H, D] tensors and rotates both (in
    # place, forward and backward): q and k are two tensors of x's shape here, so it moves
    # twice the bytes of one. Its own leaves and gradients: it overwrites them.
    q = x.detach().clone().requires_grad_()
    k = x.detach().clone().requires_grad_()
    dq, dk = dy.clone().transpose(1, 2), dy.clone().transpose(1, 2)
    try:
        out = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        torch.autograd.grad((out[0], out[1]), (q, k), (dq, dk), retain_graph=True)
    except Exception as e:  # another Liger release's interface: leave the column out
        print(f"note: Liger's rope backward did not run ({e}); its column is left out",
              file=sys.stderr)
        return None
    return lambda: torch.autograd.grad((out[0], out[1]), (q, k), (dq, dk), retain_graph=True)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, IMPLS)
    ap.add_argument("--shapes", default="4x2048x32x128,4x2048x8x128",
                    help="BxSxHxD shapes, comma-separated (default: Llama-3-8B's q and k at "
                    "4 x 2048 tokens)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layouts", default="half,interleaved")
    args = ap.parse_args(argv)
    gpu = start(args)
    if gpu is None:
        return 2
    keep_saved_tensors()
    compiled = {"llama": compile_static(llama_rope), "hf": compile_static(hf_rope)}
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    cases = [make_case(shape, layout == "interleaved", dt, gpu, compiled)
             for dt in args.dtype.split(",") for layout in args.layouts.split(",")
             for shape in shapes]
    medians, host = run(args, cases, plain=PLAIN | AUTOGRAD)
    head = heading(gpu, "RoPE backward (dx from dy); (TB/s) beside each time; eager, compile "
                   "and liger: autograd backwards", graphs=not args.no_graph,
                   plain=PLAIN | AUTOGRAD)
    lines, raw = table(head, cases, medians, "liger (dq+dk)")
    report(lines, raw, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
