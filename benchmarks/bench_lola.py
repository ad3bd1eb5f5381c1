"""LayerNorm -> Linear -> GELU side by side on one GPU, in one process: tuned (lookup table) vs
the default heuristic vs torch eager (F.layer_norm, F.linear, F.gelu) vs torch.compile of it vs
Liger Kernel's LayerNorm with torch's Linear and GELU vs the cuBLAS GEMM alone (x·Wᵀ, what the
fusion must not exceed).

    python -m benchmarks.bench_lola --tables tables.yaml --shapes 4096:768:3072,1:4096:16384
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

import fusetune
from benchmarks.timing import compile_static, gemm_report, heading, parser, run, start
from fusetune.kernels.lola import SPEC
from fusetune.spec import Point

IMPLS = ("tuned", "default", "eager", "compile", "liger", "gemm_alone")


def eager_lola(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-5
               ) -> torch.Tensor:
    return F.gelu(F.linear(F.layer_norm(x, (x.shape[-1],), eps=eps), w, b))


def liger_lola(d: int, dtype: torch.dtype) -> Any:
    """Liger Kernel's LayerNorm (weight 1, bias 0: no affine), then torch's Linear and GELU."""
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except Exception:
        return None
    ones = torch.ones(d, device="cuda", dtype=dtype)
    zeros = torch.zeros(d, device="cuda", dtype=dtype)
    return lambda x, w, b: F.gelu(F.linear(LigerLayerNormFunction.apply(x, ones, zeros, 1e-5),
                                           w, b))


def make_case(m: int, d: int, n: int, dtype_name: str, gpu: Any, compiled: Any
              ) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    x = torch.randn(m, d, device="cuda", dtype=dtype)
    w = (torch.randn(n, d, device="cuda") / d**0.5).to(dtype)
    b = (0.1 * torch.randn(n, device="cuda")).to(dtype)
    dims = {"dim": d, "out": n}
    point = Point.make("lola", dims, 1, m, dtype_name)
    tuned_cfg = fusetune.lookup("lola", dims, dtype_name, rows=m)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    ref = SPEC.reference({"x": x, "weight": w, "bias": b, "eps": 1e-5})["y"]
    out = fusetune.lola(x, w, b, eps=1e-5)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < SPEC.tolerance[dtype_name], f"tuned lola wrong: rel err {err}"
    liger = liger_lola(d, dtype)
    fns = {
        "tuned": lambda: fusetune.lola(x, w, b, eps=1e-5),
        "default": lambda: fusetune.lola(x, w, b, eps=1e-5, config=default_cfg),
        "eager": lambda: eager_lola(x, w, b),
        "compile": lambda: compiled(x, w, b),
        "liger": (lambda: liger(x, w, b)) if liger else None,
        "gemm_alone": lambda: x @ w.T,
    }
    cost = SPEC.cost(point)
    return {"label": f"{m}:{d}:{n}", "dtype": dtype_name, "fns": fns, "tuned_cfg": tuned_cfg,
            "default_cfg": default_cfg, "rel_err": err, "bytes": cost.bytes,
            "flops": cost.flops}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, IMPLS)
    ap.add_argument("--shapes", default="4096:768:3072,1:4096:16384,4096:4096:16384",
                    help="M:in:out triples, comma-separated")
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args(argv)
    gpu = start(args)
    if gpu is None:
        return 2
    compiled = compile_static(eager_lola)
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    cases = [make_case(m, d, n, dt, gpu, compiled) for dt in args.dtype.split(",")
             for m, d, n in shapes]
    medians, host = run(args, cases)
    head = heading(gpu, "LayerNorm -> Linear -> GELU", graphs=not args.no_graph)
    gemm_report(head, cases, medians, IMPLS, SPEC.config_keys, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
