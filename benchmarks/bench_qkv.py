"""Fused QKV projection side by side on one GPU, in one process: tuned (lookup table) vs the
default heuristic vs torch eager (Llama's RMSNorm, three nn.Linear, complex-number RoPE on q and
k) vs torch.compile of it vs Liger Kernel's pieces (its RMSNorm, one GEMM, its RoPE) vs the
cuBLAS GEMM alone on the stacked [Wq; Wk; Wv] weight.

    python -m benchmarks.bench_qkv --tables tables.yaml --rows 1,16,4096
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

import fusetune
from benchmarks.timing import gemm_report, heading, parser, run, start
from fusetune.kernels._spec import Point
from fusetune.kernels.qkv import SPEC
from fusetune.models import preset

IMPLS = ("tuned", "default", "eager", "compile", "liger", "gemm_alone")


def eager_qkv(x: torch.Tensor, g: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
              wv: torch.Tensor, freqs_cis: torch.Tensor, head_dim: int, eps: float = 1e-6
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Llama's attention input: RMSNorm, three projections, RoPE on q and k."""
    h = x.float()
    xn = g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
    b, s, _ = x.shape
    q, k, v = (F.linear(xn, w).view(b, s, -1, head_dim) for w in (wq, wk, wv))

    def rot(t: torch.Tensor) -> torch.Tensor:
        tc = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(tc * freqs_cis).flatten(3).type_as(t)

    return rot(q), rot(k), v


def liger_qkv(hd: int, dims: dict[str, int], m: int, dtype: torch.dtype) -> Any:
    """Liger Kernel's RMSNorm, one GEMM on [Wq; Wk; Wv], Liger's RoPE on q and k (Liger has
    only the half-split layout)."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception:
        return None
    nq, nkv = dims["n_heads"] * hd, dims["n_kv_heads"] * hd
    freqs = 10000.0 ** (-torch.arange(0, hd, 2, device="cuda", dtype=torch.float32) / hd)
    ang = torch.outer(torch.arange(m, device="cuda", dtype=torch.float32), freqs)
    emb = torch.cat((ang, ang), dim=-1)[None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def run(x: torch.Tensor, g: torch.Tensor, wqkv: torch.Tensor) -> Any:
        b, s, _ = x.shape
        y = F.linear(LigerRMSNormFunction.apply(x, g, 1e-6, 0.0, "llama", False), wqkv)
        q, k, v = y.split([nq, nkv, nkv], dim=-1)
        q = q.reshape(b, s, -1, hd).transpose(1, 2)
        k = k.reshape(b, s, -1, hd).transpose(1, 2)
        return (*LigerRopeFunction.apply(q, k, cos, sin), v)

    return run


def make_case(m: int, dims: dict[str, int], dtype_name: str, gpu: Any, compiled: Any
              ) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    d, hd = dims["dim"], dims["head_dim"]
    torch.manual_seed(0)
    x = torch.randn(1, m, d, device="cuda", dtype=dtype)
    g = (1 + 0.1 * torch.randn(d, device="cuda")).to(dtype)
    wq, wk, wv = ((torch.randn(n * hd, d, device="cuda") / d**0.5).to(dtype)
                  for n in (dims["n_heads"], dims["n_kv_heads"], dims["n_kv_heads"]))
    wqkv = torch.cat([wq, wk, wv])
    freqs = 10000.0 ** (-torch.arange(0, hd, 2, device="cuda", dtype=torch.float32) / hd)
    ang = torch.outer(torch.arange(m, device="cuda", dtype=torch.float32), freqs)
    freqs_cis = torch.polar(torch.ones_like(ang), ang)[None, :, None, :]
    point = Point.make("qkv", dims, 1, m, dtype_name)
    tuned_cfg = fusetune.lookup("qkv", dims, dtype_name, rows=m)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    inputs = {"x": x, "rms_weight": g, "wq": wq, "wk": wk, "wv": wv, "start_pos": 0,
              "theta": 10000.0, "eps": 1e-6, "head_dim": hd, "interleaved": True}
    ref = SPEC.reference(inputs)
    outs = fusetune.qkv(x, g, wq, wk, wv, head_dim=hd)
    err = max(float((o.float() - ref[n]).norm() / ref[n].norm())
              for o, n in zip(outs, "qkv", strict=True))
    assert err < SPEC.tolerance[dtype_name], f"tuned qkv wrong: rel err {err}"
    liger = liger_qkv(hd, dims, m, dtype)
    fns = {
        "tuned": lambda: fusetune.qkv(x, g, wq, wk, wv, head_dim=hd),
        "default": lambda: fusetune.qkv(x, g, wq, wk, wv, head_dim=hd, config=default_cfg),
        "eager": lambda: eager_qkv(x, g, wq, wk, wv, freqs_cis, hd),
        "compile": lambda: compiled(x, g, wq, wk, wv, freqs_cis, hd),
        "liger": (lambda: liger(x, g, wqkv)) if liger else None,
        "gemm_alone": lambda: F.linear(x, wqkv),
    }
    cost = SPEC.cost(point)
    return {"label": f"M={m}", "dtype": dtype_name, "fns": fns, "tuned_cfg": tuned_cfg,
            "default_cfg": default_cfg, "rel_err": err, "bytes": cost.bytes,
            "flops": cost.flops, "weight_bytes": wqkv.numel() * wqkv.element_size()}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, IMPLS)
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--rows", default="1,16,4096")
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args(argv)
    gpu = start(args)
    if gpu is None:
        return 2
    dims = SPEC.dims_from_model(preset(args.model))
    compiled = torch.compile(eager_qkv)
    cases = [make_case(int(m), dims, dt, gpu, compiled)
             for dt in args.dtype.split(",") for m in args.rows.split(",")]
    medians, host = run(args, cases)
    head = heading(gpu, f"{args.model} {dims}", graphs=not args.no_graph)
    gemm_report(head, cases, medians, IMPLS, SPEC.config_keys, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
