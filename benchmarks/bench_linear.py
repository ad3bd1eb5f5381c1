"""Linear + residual add side by side on one GPU, in one process: tuned (lookup table) vs the
default heuristic vs torch eager (F.linear, then the residual add) vs torch.compile of it vs the
cuBLAS GEMM alone (x·Wᵀ without the residual, what the fusion must not exceed), at Llama-3-8B's
down_proj (14336 -> 4096) and o_proj (4096 -> 4096), with 16-bit and FP8 (e4m3, per-channel
scales) weights.

With FP8 weights, eager and compile dequantize the weights to x's dtype in every call and then
run the 16-bit layer; the GEMM alone stays the 16-bit weights' GEMM, and cuBLAS FP8
(torch._scaled_mm, activations already quantized to e4m3, rows padded to a multiple of 16)
stands beside it. "weights TB/s" is the tuned kernel's rate over the weight bytes alone (the
decode target: one row at 85% of 3.0 TB/s); "tuned/gemm" the prefill target (4096 rows at
most 1.05).

    python -m benchmarks.bench_linear --rows 1   # then --rows 16 and --rows 4096, each in
                                                 # a process of its own
    python -m benchmarks.bench_linear --rows 4096 --weights bf16 --tables tables.yaml
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fusetune
from benchmarks.timing import compile_static, gemm_report, heading, parser, run, start
from fusetune.kernels.linear import SPEC
from fusetune.spec import Point

IMPLS = ("tuned", "default", "eager", "compile", "gemm_alone", "scaled_mm")
# (in_features, out_features) of Llama-3-8B's projections that linear serves
PROJECTIONS = {"down_proj": (14336, 4096), "o_proj": (4096, 4096)}
# --weights: 16-bit weights in the activations' dtype, or FP8 with per-channel scales
WEIGHTS = {"bf16": "", "fp16": "", "fp8-e4m3": "fp8-e4m3", "fp8-e5m2": "fp8-e5m2"}


def eager_linear(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None,
                 scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """What the model runs: the projection (FP8 weights dequantized to x's dtype first, the
    bias where there is one), then the residual add (where there is one)."""
    if scale is not None:
        w = (w.to(x.dtype) * scale[:, None]).to(x.dtype)
    y = F.linear(x, w, bias)
    return y if r is None else r + y


def scaled_mm(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor) -> Callable[[], Any] | None:
    """cuBLAS FP8: x quantized to e4m3 ahead (one scale, rows padded to a multiple of 16) times
    the FP8 weights with their per-channel scales; None where torch._scaled_mm refuses them."""
    m = x.shape[0]
    xp = torch.zeros(-(-m // 16) * 16, x.shape[1], dtype=x.dtype, device=x.device)
    xp[:m] = x
    sx = (xp.float().abs().amax() / 448.0).clamp_min(1e-12)
    xq = (xp.float() / sx).to(torch.float8_e4m3fn)
    sx_rows = sx.expand(xp.shape[0], 1).contiguous()  # rowwise scaling wants one per row
    sw = scale.view(1, -1)

    def fn() -> torch.Tensor:
        # The second operand column-major: the transpose of the row-major [N, K] weight.
        return torch._scaled_mm(xq, wq.t(), scale_a=sx_rows, scale_b=sw, out_dtype=x.dtype)

    try:
        fn()
    except (RuntimeError, TypeError) as e:
        print(f"note: torch._scaled_mm {wq.dtype}: {' '.join(str(e).split())[:200]}",
              file=sys.stderr)
        return None
    return fn


def make_case(proj: str, m: int, weights: str, dtype_name: str, gpu: Any, compiled: Any
              ) -> dict[str, Any]:
    k, n = PROJECTIONS[proj]
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    r = torch.randn(m, n, device="cuda", dtype=dtype)
    w32 = torch.randn(n, k, device="cuda") / k**0.5
    w16 = w32.to(dtype)
    w, scale = w16, None
    if weights:
        w, scale = fusetune.quantize_fp8(w32, weights.removeprefix("fp8-"))
    del w32
    dims = {"dim": k, "out": n, "bias": 0, "residual": 1}
    point = Point.make("linear", dims, 1, m, dtype_name, weights)
    tuned_cfg = fusetune.lookup("linear", dims, dtype_name, rows=m, weights=weights)
    default_cfg = SPEC.default_config(point, gpu)
    inputs = {"x": x, "weight": w, "weight_scale": scale, "bias": None, "residual": r}
    ref = SPEC.reference(inputs)["y"]
    out = fusetune.linear(x, w, residual=r, weight_scale=scale)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < SPEC.tolerance[dtype_name], f"tuned linear wrong: rel err {err}"
    fns = {
        "tuned": lambda: fusetune.linear(x, w, residual=r, weight_scale=scale),
        "default": lambda: fusetune.linear(x, w, residual=r, weight_scale=scale,
                                           config=default_cfg),
        "eager": lambda: eager_linear(x, w, r, scale),
        "compile": lambda: compiled(x, w, r, scale),
        "gemm_alone": lambda: F.linear(x, w16),
        "scaled_mm": scaled_mm(x, w, scale) if weights else None,
    }
    cost = SPEC.cost(point)
    what = f", {weights} weights" if weights else ""
    return {"label": f"{proj} {m}: {k} → {n}{what}", "dtype": dtype_name, "fns": fns,
            "tuned_cfg": tuned_cfg, "default_cfg": default_cfg, "rel_err": err,
            "bytes": cost.bytes, "flops": cost.flops, "weight_bytes": w.numel() * w.element_size()}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, IMPLS)
    ap.add_argument("--projs", default=",".join(PROJECTIONS),
                    help=f"projections, comma-separated (valid: {','.join(PROJECTIONS)})")
    ap.add_argument("--rows", default="1,16,4096",
                    help="row counts (tokens), comma-separated; one process per row count "
                    "compares like with like (benchmarks/README.md)")
    ap.add_argument("--weights", default="bf16,fp8-e4m3",
                    help=f"weight formats, comma-separated (valid: {','.join(WEIGHTS)}; bf16 "
                    "and fp16 both mean the activations' dtype)")
    ap.add_argument("--dtype", default="bfloat16", help="activation dtypes, comma-separated")
    args = ap.parse_args(argv)
    projs, formats = args.projs.split(","), args.weights.split(",")
    bad = [p for p in projs if p not in PROJECTIONS] + [f for f in formats if f not in WEIGHTS]
    if bad:
        ap.error(f"unknown projection or weight format {','.join(bad)}; valid: "
                 f"{','.join(PROJECTIONS)} and {','.join(WEIGHTS)}")
    gpu = start(args)
    if gpu is None:
        return 2
    compiled = compile_static(eager_linear)
    keys = dict.fromkeys(WEIGHTS[f] for f in formats)  # bf16 and fp16 are one case
    cases = [make_case(proj, int(m), weights, dt, gpu, compiled)
             for dt in args.dtype.split(",") for weights in keys for proj in projs
             for m in args.rows.split(",")]
    medians, host = run(args, cases)
    head = heading(gpu, "Llama-3-8B projections + residual add", graphs=not args.no_graph)
    gemm_report(head, cases, medians, IMPLS, SPEC.config_keys, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
