"""RoPE side by side on one GPU, in one process: tuned (lookup table) vs the default heuristic vs
torch eager (Llama's complex-number code for interleaved pairs, Hugging Face's rotate_half for
half-split) vs torch.compile of it vs Liger Kernel (half-split only; it rotates q and k together,
so its row counts twice the bytes) vs a device-to-device copy of the same bytes. Every
implementation reads the angles from tables built once outside the timing: fusetune.rope and
Liger the cos/sin tables [1, S, D] of a rotary embedding (fusetune.kernels.rope.rotary_tables,
in x's dtype; they add 2·S·D/2 elements to the bytes fusetune reads, under 2% at 32 heads,
left out of "MB moved"), the eager code its own form of them.

    python -m benchmarks.bench_rope --tables tables.yaml --shapes 1x4096x32x128,8x4096x32x128
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

import fusetune
from benchmarks.timing import compile_static, heading, parser, report, run, start
from fusetune.kernels.rope import SPEC, rotary_tables
from fusetune.spec import Point

FLOOR_TBS = 3.0
IMPLS = ("tuned", "default", "eager", "compile", "liger", "copy")


def llama_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Llama's apply_rotary_emb for one tensor: pairs (2i, 2i+1) as complex numbers."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(3).type_as(x)


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's apply_rotary_pos_emb for one tensor: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def tables_for(seq: int, d: int, theta: float, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The angles of positions 0..seq-1 (built once, outside the timing): Meta's freqs_cis
    [1, S, 1, D/2] and the cos/sin tables [1, S, D] in `dtype`, as a rotary embedding returns
    them (what fusetune.rope and Liger read; Hugging Face's code broadcasts them over heads)."""
    freqs = theta ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    angle = torch.outer(torch.arange(seq, device="cuda", dtype=torch.float32), freqs)
    freqs_cis = torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    cos, sin = rotary_tables(torch.arange(seq, device="cuda")[None], d, theta=theta,
                             dtype=dtype)
    return freqs_cis, cos, sin


def make_case(shape: tuple[int, int, int, int], interleaved: bool, dtype_name: str, gpu: Any,
              compiled: dict[str, Callable[..., Any]]) -> dict[str, Any]:
    b, s, h, d = shape
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    x = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    dims = {"heads": h, "head_dim": d, "interleaved": int(interleaved)}
    point = Point.make("rope", dims, b, s, dtype_name)
    tuned_cfg = fusetune.lookup("rope", dims, dtype_name, rows=b * s)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    freqs_cis, cos, sin = tables_for(s, d, 10000.0, dtype)  # one row of positions: every batch
    ref = SPEC.reference({"x": x, "cos": cos, "sin": sin, "interleaved": interleaved})["y"]
    out = fusetune.rope(x, cos, sin, interleaved=interleaved)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < SPEC.tolerance[dtype_name], f"tuned rope wrong: rel err {err}"
    if interleaved:
        eager = lambda: llama_rope(x, freqs_cis)
        comp = lambda: compiled["llama"](x, freqs_cis)
        liger = None
    else:
        cos4, sin4 = cos[:, :, None, :], sin[:, :, None, :]
        eager = lambda: hf_rope(x, cos4, sin4)
        comp = lambda: compiled["hf"](x, cos4, sin4)
        liger = _liger_fn(x, cos, sin)
    fns = {
        "tuned": lambda: fusetune.rope(x, cos, sin, interleaved=interleaved),
        "default": lambda: fusetune.rope(x, cos, sin, interleaved=interleaved,
                                         config=default_cfg),
        "eager": eager, "compile": comp, "liger": liger,
        "copy": lambda: y.copy_(x),
    }
    nbytes = 2 * x.numel() * x.element_size()
    return {"shape": shape, "interleaved": interleaved, "dtype": dtype_name, "fns": fns,
            "tuned_cfg": tuned_cfg, "default_cfg": default_cfg, "rel_err": err,
            "bytes": nbytes}


def _liger_fn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Callable[[], Any] | None:
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception:
        return None
    # Liger takes q, k as [B, H, S, D] views and rotates both (in place): q and k are two
    # tensors of x's shape here, so it moves twice the bytes of one.
    q, k = x.clone().transpose(1, 2), x.clone().transpose(1, 2)
    return lambda: LigerRopeFunction.apply(q, k, cos, sin)


def table(head: str, cases: list[dict[str, Any]], medians: list[dict[str, float | None]],
          liger_label: str) -> tuple[list[str], list[dict[str, Any]]]:
    """The markdown lines and raw rows of a RoPE side-by-side table (forward or backward: the
    same columns; Liger's column times q and k together, so its rate counts twice the bytes)."""
    cols = ["layout", "dtype", "B×S×H×D", "MB moved", "floor µs", "tuned", "default", "eager",
            "compile", liger_label, "copy", "tuned/copy BW", "tuned BLOCK_T/BLOCK_H/warps"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    raw = []
    for case, t in zip(cases, medians, strict=True):
        nb = case["bytes"]

        def cell(k: str, t: dict[str, float | None] = t, nb: int = nb) -> str:
            v = t[k]
            if v is None:
                return "-"
            b = 2 * nb if k == "liger" else nb
            return f"{v:.1f} ({b / v / 1e6:.2f})"

        ratio = t["copy"] / t["tuned"] if t["tuned"] and t["copy"] else float("nan")
        cfg = "/".join(str(case["tuned_cfg"][k]) for k in SPEC.config_keys)
        layout = "interleaved" if case["interleaved"] else "half-split"
        lines.append(f"| {layout} | {case['dtype']} | {'×'.join(map(str, case['shape']))} | "
                     f"{nb / 1e6:.0f} | {nb / (FLOOR_TBS * 1e6):.1f} | "
                     + " | ".join(cell(k) for k in IMPLS) + f" | {100 * ratio:.0f}% | {cfg} |")
        raw.append({"layout": layout, "dtype": case["dtype"], "shape": case["shape"],
                    "bytes": nb, "us": t, "tuned_config": case["tuned_cfg"],
                    "default_config": case["default_cfg"], "rel_err": case["rel_err"]})
    return lines, raw


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, IMPLS)
    ap.add_argument("--shapes", default="1x4096x32x128,8x4096x32x128",
                    help="BxSxHxD shapes, comma-separated")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--layouts", default="interleaved,half")
    args = ap.parse_args(argv)
    gpu = start(args)
    if gpu is None:
        return 2
    compiled = {"llama": compile_static(llama_rope), "hf": compile_static(hf_rope)}
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    cases = [make_case(shape, layout == "interleaved", dt, gpu, compiled)
             for dt in args.dtype.split(",") for layout in args.layouts.split(",")
             for shape in shapes]
    medians, host = run(args, cases)
    head = heading(gpu, "RoPE; (TB/s) beside each time", graphs=not args.no_graph)
    lines, raw = table(head, cases, medians, "liger (q+k)")
    report(lines, raw, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
