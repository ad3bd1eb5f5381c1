"""Fused feed-forward gate side by side on one GPU, in one process: tuned (lookup table) vs the
default heuristic vs torch eager (Llama's RMSNorm, two nn.Linear, silu·mul) vs torch.compile of
it vs Liger Kernel's pieces (its RMSNorm, one GEMM, its fused SiLU·mul) vs the cuBLAS GEMM alone
on the stacked [W1; W3] weight (what the fusion must not exceed).

    python -m benchmarks.bench_ffn --tables tables.yaml --rows 1,16,128,1024,4096
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

import fusetune
from benchmarks.timing import compile_static, gemm_report, heading, parser, run, start
from fusetune.kernels.ffn import SPEC
from fusetune.spec import Point

IMPLS = ("tuned", "default", "eager", "compile", "liger", "gemm_alone")


def eager_ffn(x: torch.Tensor, g: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
              eps: float = 1e-6, activation: str = "silu") -> torch.Tensor:
    """Llama's RMSNorm then the MLP gate, as applications run it; `activation` "gelu_tanh"
    for Gemma's GeGLU gate."""
    h = x.float()
    xn = g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
    a = F.linear(xn, w1)
    gate = F.gelu(a, approximate="tanh") if activation == "gelu_tanh" else F.silu(a)
    return gate * F.linear(xn, w3)


def liger_ffn() -> Any:
    """Liger Kernel's pieces: its RMSNorm, one GEMM on [W1; W3], its fused gate·up SiLU."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction
    except Exception:
        return None

    def run(x: torch.Tensor, g: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
        xn = LigerRMSNormFunction.apply(x, g, 1e-6, 0.0, "llama", False)
        return LigerFusedGateUpSiLUMulFunction.apply(F.linear(xn, w13))

    return run


def make_case(m: int, d: int, hdim: int, dtype_name: str, gpu: Any,
              compiled: Any) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    x = torch.randn(m, d, device="cuda", dtype=dtype)
    g = (1 + 0.1 * torch.randn(d, device="cuda")).to(dtype)
    w1 = (torch.randn(hdim, d, device="cuda") / d**0.5).to(dtype)
    w3 = (torch.randn(hdim, d, device="cuda") / d**0.5).to(dtype)
    w13 = torch.cat([w1, w3])
    dims = {"dim": d, "hidden": hdim}
    point = Point.make("ffn", dims, 1, m, dtype_name)
    tuned_cfg = fusetune.lookup("ffn", dims, dtype_name, rows=m)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    ref = SPEC.reference({"x": x, "rms_weight": g, "w1": w1, "w3": w3, "eps": 1e-6})["h"]
    out = fusetune.ffn(x, g, w1, w3, eps=1e-6)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < SPEC.tolerance[dtype_name], f"tuned ffn wrong: rel err {err}"
    liger = liger_ffn()
    fns = {
        "tuned": lambda: fusetune.ffn(x, g, w1, w3, eps=1e-6),
        "default": lambda: fusetune.ffn(x, g, w1, w3, eps=1e-6, config=default_cfg),
        "eager": lambda: eager_ffn(x, g, w1, w3),
        "compile": lambda: compiled(x, g, w1, w3),
        "liger": (lambda: liger(x, g, w13)) if liger else None,
        "gemm_alone": lambda: F.linear(x, w13),
    }
    cost = SPEC.cost(point)
    return {"label": f"M={m}", "dtype": dtype_name, "fns": fns, "tuned_cfg": tuned_cfg,
            "default_cfg": default_cfg, "rel_err": err, "bytes": cost.bytes,
            "flops": cost.flops}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, IMPLS)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=11008)
    ap.add_argument("--rows", default="1,16,128,1024,4096")
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args(argv)
    gpu = start(args)
    if gpu is None:
        return 2
    compiled = compile_static(eager_ffn)
    cases = [make_case(int(m), args.dim, args.hidden, dt, gpu, compiled)
             for dt in args.dtype.split(",") for m in args.rows.split(",")]
    medians, host = run(args, cases)
    head = heading(gpu, f"dim {args.dim} -> hidden {args.hidden}", graphs=not args.no_graph)
    gemm_report(head, cases, medians, IMPLS, SPEC.config_keys, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
