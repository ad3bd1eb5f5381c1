"""SwiGLU's gate silu(a)·b side by side on one GPU, in one process, at training sizes: tuned
(lookup table) vs the default heuristic vs torch eager (Hugging Face's act_fn(gate) * up) vs
torch.compile of it vs Liger Kernel's silu·mul (if installed) vs a device-to-device copy of the
same bytes, beside the roofline floor (bytes / 3.0 TB/s). Its backward: bench_swiglu_bwd.

    python -m benchmarks.bench_swiglu --tables tables.yaml --rows 8192 --hidden 14336
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fusetune
from benchmarks.timing import compile_static, heading, parser, report, run, start
from fusetune.kernels.swiglu import SPEC
from fusetune.spec import Point

FLOOR_TBS = 3.0
IMPLS = ("tuned", "default", "eager", "compile", "liger", "copy")


def eager_swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama's MLP between its projections: act_fn(gate_proj(x)) * up_proj(x)."""
    return F.silu(a) * b


def liger_swiglu() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:
        return None
    return LigerSiLUMulFunction.apply


def gate_inputs(m: int, h: int, dtype_name: str, n: int) -> list[torch.Tensor]:
    """`n` [m, h] tensors: the gate's values (σ = 2, spread over silu's curve), then standard
    normal ones (up, dy)."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    out = [2 * torch.randn(m, h, device="cuda")]
    out += [torch.randn(m, h, device="cuda") for _ in range(n - 1)]
    return [t.to(dtype) for t in out]


def copy_of(nbytes: int) -> Callable[[], Any]:
    """A device-to-device copy that reads and writes `nbytes` in all."""
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def make_case(m: int, h: int, dtype_name: str, gpu: Any, compiled: Callable[..., Any],
              liger: Callable[..., Any] | None) -> dict[str, Any]:
    a, b = gate_inputs(m, h, dtype_name, 2)
    point = Point.make("swiglu", {"hidden": h}, 1, m, dtype_name)
    tuned_cfg = fusetune.lookup("swiglu", {"hidden": h}, dtype_name, rows=m)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    ref = SPEC.reference({"a": a, "b": b})["y"]
    out = fusetune.swiglu(a, b)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < SPEC.tolerance[dtype_name], f"tuned swiglu wrong: rel err {err}"
    nbytes = SPEC.cost(point).bytes
    fns = {
        "tuned": lambda: fusetune.swiglu(a, b),
        "default": lambda: fusetune.swiglu(a, b, config=default_cfg),
        "eager": lambda: eager_swiglu(a, b),
        "compile": lambda: compiled(a, b),
        "liger": (lambda: liger(a, b)) if liger else None,
        "copy": copy_of(nbytes),
    }
    return {"label": f"{m}×{h}", "dtype": dtype_name, "fns": fns, "tuned_cfg": tuned_cfg,
            "default_cfg": default_cfg, "rel_err": err, "bytes": nbytes}


def table(head: str, cases: list[dict[str, Any]], medians: list[dict[str, float | None]],
          config_keys: tuple[str, ...]) -> tuple[list[str], list[dict[str, Any]]]:
    """Markdown lines and raw rows: µs (TB/s) per implementation, floor, tuned / copy."""
    cols = ["dtype", "rows×H", "MB moved", "floor µs", *IMPLS, "tuned/copy BW",
            "tuned " + "/".join(config_keys)]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    raw = []
    for case, t in zip(cases, medians, strict=True):
        nb = case["bytes"]
        cells = ["-" if t[k] is None else f"{t[k]:.1f} ({nb / t[k] / 1e6:.2f})" for k in IMPLS]
        ratio = t["copy"] / t["tuned"] if t["tuned"] and t["copy"] else float("nan")
        cfg = "/".join(str(case["tuned_cfg"][k]) for k in config_keys)
        lines.append(f"| {case['dtype']} | {case['label']} | {nb / 1e6:.0f} | "
                     f"{nb / (FLOOR_TBS * 1e6):.1f} | " + " | ".join(cells)
                     + f" | {100 * ratio:.0f}% | {cfg} |")
        raw.append({"dtype": case["dtype"], "shape": case["label"], "bytes": nb, "us": t,
                    "tuned_config": case["tuned_cfg"], "default_config": case["default_cfg"],
                    "rel_err": case["rel_err"]})
    return lines, raw


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
    compiled = compile_static(eager_swiglu)
    liger = liger_swiglu()
    cases = [make_case(m, args.hidden, dt, gpu, compiled, liger)
             for dt in args.dtype.split(",") for m in (int(v) for v in args.rows.split(","))]
    medians, host = run(args, cases)
    head = heading(gpu, "SwiGLU gate silu(a)·b; (TB/s) beside each time",
                   graphs=not args.no_graph)
    lines, raw = table(head, cases, medians, SPEC.config_keys)
    report(lines, raw, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
