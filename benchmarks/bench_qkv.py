"""Fused QKV projection side by side on one GPU, in one process: tuned (lookup table) vs the
default heuristic vs torch eager (Llama's RMSNorm, three nn.Linear, RoPE on q and k: Meta's
complex-number code for interleaved pairs, Hugging Face's rotate_half for half-split) vs
torch.compile of it vs Liger Kernel's pieces (its RMSNorm, one GEMM, its RoPE) vs the cuBLAS
GEMM alone on the stacked [Wq; Wk; Wv] weight. fusetune.qkv takes the cos/sin tables of the
tokens' positions (fusetune.kernels.rope.rotary_tables, as a Hugging Face rotary embedding
returns them), built once outside the timing like the eager code's tables.

    python -m benchmarks.bench_qkv --tables tables.yaml --rows 1,16,4096
    python -m benchmarks.bench_qkv --rows 1 --layout half   # Hugging Face's pair layout
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

import fusetune
from benchmarks.timing import compile_static, gemm_report, heading, parser, run, start
from fusetune.kernels.qkv import SPEC
from fusetune.kernels.rope import rotary_tables
from fusetune.models import preset
from fusetune.spec import Point

IMPLS = ("tuned", "default", "unfused", "eager", "compile", "liger", "gemm_alone")
EPS = 1e-6
THETA = 10000.0


def rotate(t: torch.Tensor, freqs_cis: torch.Tensor | None, cos: torch.Tensor,
           sin: torch.Tensor) -> torch.Tensor:
    """RoPE on t [B, S, H, D]: Meta's complex-number code where freqs_cis is given (pairs 2i,
    2i+1), else Hugging Face's x·cos + rotate_half(x)·sin with cos, sin [1, S, 1, D]."""
    if freqs_cis is not None:
        tc = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(tc * freqs_cis).flatten(3).type_as(t)
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


def head_norm(t: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's q_norm / k_norm: an RMSNorm over each head (float32 math, x's dtype out)."""
    h = t.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(t)


def eager_qkv(x: torch.Tensor, g: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
              wv: torch.Tensor, freqs_cis: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor, head_dim: int, q_norm: torch.Tensor | None = None,
              k_norm: torch.Tensor | None = None, qk_eps: float = EPS
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Llama's attention input: RMSNorm, three projections, RoPE on q and k (Qwen3's: each
    head of q and k normalized before RoPE, where q_norm and k_norm are given)."""
    h = x.float()
    xn = g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).type_as(x)
    b, s, _ = x.shape
    q, k, v = (F.linear(xn, w).view(b, s, -1, head_dim) for w in (wq, wk, wv))
    if q_norm is not None and k_norm is not None:
        q, k = head_norm(q, q_norm, qk_eps), head_norm(k, k_norm, qk_eps)
    return rotate(q, freqs_cis, cos, sin), rotate(k, freqs_cis, cos, sin), v


def liger_qkv(hd: int, dims: dict[str, int], cos: torch.Tensor, sin: torch.Tensor) -> Any:
    """Liger Kernel's RMSNorm, one GEMM on [Wq; Wk; Wv], Liger's RoPE on q and k with the
    tables cos, sin [1, S, D] (Liger has only the half-split layout)."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception:
        return None
    nq, nkv = dims["n_heads"] * hd, dims["n_kv_heads"] * hd

    def run(x: torch.Tensor, g: torch.Tensor, wqkv: torch.Tensor) -> Any:
        b, s, _ = x.shape
        y = F.linear(LigerRMSNormFunction.apply(x, g, EPS, 0.0, "llama", False), wqkv)
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
    # Wq, Wk, Wv: views of one stacked matrix, as fusetune.patch holds them (the unfused form
    # multiplies by all three in one GEMM there)
    nq, nkv = dims["n_heads"] * hd, dims["n_kv_heads"] * hd
    wqkv = (torch.randn(nq + 2 * nkv, d, device="cuda") / d**0.5).to(dtype)
    wq, wk, wv = wqkv[:nq], wqkv[nq:nq + nkv], wqkv[nq + nkv:]
    interleaved = bool(dims["interleaved"])
    # The tables of positions 0..m-1, [1, m, hd] in x's dtype (what a rotary embedding returns
    # and the fused kernel reads), and the eager code's own forms of the same angles.
    cos, sin = rotary_tables(torch.arange(m, device="cuda")[None], hd, theta=THETA, dtype=dtype)
    freqs_cis = None
    if interleaved:
        ang = torch.outer(torch.arange(m, device="cuda", dtype=torch.float32),
                          THETA ** (-torch.arange(0, hd, 2, device="cuda") / hd))
        freqs_cis = torch.polar(torch.ones_like(ang), ang)[None, :, None, :]
    cos4, sin4 = cos[:, :, None, :], sin[:, :, None, :]
    point = Point.make("qkv", dims, 1, m, dtype_name)
    tuned_cfg = fusetune.lookup("qkv", dims, dtype_name, rows=m)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    inputs = {"x": x, "rms_weight": g, "wq": wq, "wk": wk, "wv": wv, "cos": cos, "sin": sin,
              "eps": EPS, "head_dim": hd, "interleaved": interleaved}
    ref = SPEC.reference(inputs)

    def fused(config: dict[str, int] | None = None) -> Any:
        return fusetune.qkv(x, g, wq, wk, wv, cos, sin, eps=EPS, head_dim=hd,
                            interleaved=interleaved, config=config)

    err = max(float((o.float() - ref[n]).norm() / ref[n].norm())
              for o, n in zip(fused(), "qkv", strict=True))
    assert err < SPEC.tolerance[dtype_name], f"tuned qkv wrong: rel err {err}"
    liger = liger_qkv(hd, dims, cos, sin)
    fns = {
        "tuned": fused,
        "default": lambda: fused(default_cfg),
        "unfused": lambda: fused(SPEC.canonical({**default_cfg, "UNFUSED": 1}, point)),
        "eager": lambda: eager_qkv(x, g, wq, wk, wv, freqs_cis, cos4, sin4, hd),
        "compile": lambda: compiled(x, g, wq, wk, wv, freqs_cis, cos4, sin4, hd),
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
    ap.add_argument("--layout", default="interleaved", choices=("interleaved", "half"),
                    help="RoPE pairs: (2i, 2i+1) as Meta's Llama code, or (i, i + head_dim/2) "
                         "as Hugging Face's rotate_half (what fusetune.patch runs)")
    args = ap.parse_args(argv)
    gpu = start(args)
    if gpu is None:
        return 2
    dims = {**SPEC.dims_from_model(preset(args.model)),
            "interleaved": int(args.layout == "interleaved")}
    compiled = compile_static(eager_qkv)
    cases = [make_case(int(m), dims, dt, gpu, compiled)
             for dt in args.dtype.split(",") for m in args.rows.split(",")]
    medians, host = run(args, cases)
    head = heading(gpu, f"{args.model} {dims} ({args.layout} pairs)", graphs=not args.no_graph)
    gemm_report(head, cases, medians, IMPLS, SPEC.config_keys, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
