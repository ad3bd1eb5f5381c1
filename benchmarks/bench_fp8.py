"""FP8 weights in the fused matmul kernels (ffn, qkv, lola) on one GPU, in one process, in both
numerics modes: weight-only (the default: activations in their 16-bit dtype, FP8 weight tiles
upcast in registers) and FP8 activations (fp8_activations=True, on GPUs with FP8 tensor cores:
the normalized activations rounded to e4m3 with a scale per row, FP8 by FP8 products).

Accuracy: for each kernel, format (e4m3, e5m2), scaling (one scale per output channel, as
fusetune.quantize_fp8 makes them, or one for the whole tensor) and mode, the relative error
‖out − ref‖/‖ref‖ against the float32 reference on the same weights before quantization, beside
the error of dequantizing the weights to fp16 and running the layer in torch (cuBLAS fp16): what
FP8 weights cost in accuracy by themselves, and what FP8 activations add. Every config of a mode
has that mode's numerics, so the accuracy runs use the default heuristic's config.

Time at M = 1, 16, 4096 rows (Llama-2-7B: ffn 4096 -> 11008, qkv 32 heads of 128 with 32 kv
heads, lola 4096 -> 16384): the FP8 kernel weight-only and with FP8 activations (each with the
config its own lookup gives: the tables' entries of that mode, or the default heuristic), the
fp16 kernel, cuBLAS FP8 (torch._scaled_mm on the stacked weights, activations already quantized
to e4m3, M padded to a multiple of 16) and the cuBLAS fp16 GEMM on the stacked weights, beside
the memory floors (bytes that must move at 3.0 TB/s) with FP8 and with fp16 weights. The cuBLAS
columns are the matmul alone, without the norm and the epilogue the fused kernels include.
linear's FP8 weights are timed by bench_linear.

    python -m benchmarks.bench_fp8 --tables tables.yaml --markdown fp8.md --json fp8.json
    python -m benchmarks.bench_fp8 --small     # accuracy at small shapes; on a machine without
                                               # a GPU through Triton's CPU interpreter
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# benchmarks.timing (Triton's language with it) is imported in main(): under --small without a
# GPU, TRITON_INTERPRET must be set first.
IMPLS = ("fp8", "fp8_act", "fp16", "scaled_mm", "gemm_fp16")
FMTS = ("e4m3", "e5m2")
MODES = {"": "weight-only", "fp8": "FP8 activations"}  # Point.activations -> name
LLAMA_DIMS = {"ffn": {"dim": 4096, "hidden": 11008},
              "qkv": {"dim": 4096, "head_dim": 128, "interleaved": 1, "n_heads": 32,
                      "n_kv_heads": 32},
              "lola": {"dim": 4096, "out": 16384}}
SMALL_DIMS = {"ffn": {"dim": 256, "hidden": 176},
              "qkv": {"dim": 256, "head_dim": 32, "interleaved": 1, "n_heads": 4,
                      "n_kv_heads": 2},
              "lola": {"dim": 256, "out": 192}}
WEIGHTS = {"ffn": ("w1", "w3"), "qkv": ("wq", "wk", "wv"), "lola": ("weight",)}
EPS = {"ffn": 1e-6, "qkv": 1e-6, "lola": 1e-5}
THETA = 10000.0


@dataclass
class Layer:
    """One kernel's inputs at one shape: activations, norm weight or bias, float32 weights, and
    for qkv the RoPE tables of positions 0..M-1."""

    kernel: str
    dims: dict[str, int]
    x: torch.Tensor
    side: torch.Tensor  # the RMSNorm weight (ffn, qkv) or the bias (lola)
    weights: dict[str, torch.Tensor]  # float32, [out_features, in_features]
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) [1, M, head_dim]

    @property
    def rows(self) -> int:
        return self.x.numel() // self.x.shape[-1]


def make_layer(kernel: str, dims: dict[str, int], m: int, dtype: torch.dtype, device: str
               ) -> Layer:
    from fusetune.kernels.rope import rotary_tables

    torch.manual_seed(0)
    d = dims["dim"]
    x = torch.randn(m, d, device=device)
    rope = None
    if kernel == "lola":  # hidden states with a per-row offset and scale
        x = x * (1 + torch.rand(m, 1, device=device)) + 0.5 * torch.randn(m, 1, device=device)
    if kernel == "qkv":
        x = x.view(1, m, d)
        hd = dims["head_dim"]
        outs = {"wq": dims["n_heads"] * hd, "wk": dims["n_kv_heads"] * hd,
                "wv": dims["n_kv_heads"] * hd}
        rope = rotary_tables(torch.arange(m, device=device)[None], hd, theta=THETA, dtype=dtype)
    else:
        n = dims["hidden"] if kernel == "ffn" else dims["out"]
        outs = {name: n for name in WEIGHTS[kernel]}
    side = (0.1 * torch.randn(outs["weight"], device=device) if kernel == "lola"
            else 1 + 0.1 * torch.randn(d, device=device))
    weights = {name: torch.randn(n, d, device=device) / d**0.5 for name, n in outs.items()}
    return Layer(kernel, dims, x.to(dtype), side.to(dtype), weights, rope)


def run_fused(layer: Layer, w: dict[str, torch.Tensor], s: dict[str, torch.Tensor | None],
              config: dict[str, int] | None, act: bool = False) -> tuple[torch.Tensor, ...]:
    """The fusetune kernel on weights `w` (FP8 or x's dtype) with scales `s`; `act`: FP8
    activations."""
    import fusetune

    eps = EPS[layer.kernel]
    if layer.kernel == "ffn":
        return (fusetune.ffn(layer.x, layer.side, w["w1"], w["w3"], eps=eps,
                             w1_scale=s.get("w1"), w3_scale=s.get("w3"),
                             fp8_activations=act, config=config),)
    if layer.kernel == "qkv":
        assert layer.rope is not None
        return fusetune.qkv(layer.x, layer.side, w["wq"], w["wk"], w["wv"], *layer.rope,
                            eps=eps, head_dim=layer.dims["head_dim"],
                            interleaved=bool(layer.dims["interleaved"]), wq_scale=s.get("wq"),
                            wk_scale=s.get("wk"), wv_scale=s.get("wv"), fp8_activations=act,
                            config=config)
    return (fusetune.lola(layer.x, w["weight"], layer.side, eps=eps,
                          weight_scale=s.get("weight"), fp8_activations=act, config=config),)


def reference(layer: Layer) -> tuple[torch.Tensor, ...]:
    """float32 torch on the unquantized weights (the kernel spec's reference)."""
    from fusetune.kernels import get_spec

    spec = get_spec(layer.kernel)
    inputs: dict[str, Any] = {"x": layer.x, **layer.weights, "eps": EPS[layer.kernel]}
    if layer.kernel == "lola":
        inputs.update(bias=layer.side)
    else:
        inputs.update(rms_weight=layer.side)
    if layer.kernel == "qkv":
        assert layer.rope is not None
        inputs.update(cos=layer.rope[0], sin=layer.rope[1], head_dim=layer.dims["head_dim"],
                      interleaved=bool(layer.dims["interleaved"]))
    return tuple(spec.reference(inputs).values())


def eager_fp16(layer: Layer, w16: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The layer in torch with 16-bit weights `w16` (dequantized FP8): norm in float32, the
    products by cuBLAS (F.linear) in x's dtype."""
    from fusetune.kernels.rope import rotated

    h = layer.x.float()
    eps = EPS[layer.kernel]
    if layer.kernel == "lola":
        xn = F.layer_norm(h, (h.shape[-1],), eps=eps).to(layer.x.dtype)
        return (F.gelu(F.linear(xn, w16["weight"], layer.side)),)
    xn = layer.side * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(layer.x)
    if layer.kernel == "ffn":
        return (F.silu(F.linear(xn, w16["w1"])) * F.linear(xn, w16["w3"]),)
    assert layer.rope is not None
    b, s, _ = layer.x.shape
    hd, interleaved = layer.dims["head_dim"], bool(layer.dims["interleaved"])
    q, k, v = (F.linear(xn, w16[n]).view(b, s, -1, hd) for n in WEIGHTS["qkv"])
    return (rotated(q, *layer.rope, interleaved).to(q.dtype),
            rotated(k, *layer.rope, interleaved).to(k.dtype), v)


def rel_err(outs: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...]) -> float:
    """The largest ‖out − ref‖/‖ref‖ over the outputs (q, k, v for qkv)."""
    return max(float((o.float() - r.float()).norm() / r.float().norm())
               for o, r in zip(outs, refs, strict=True))


def quantized(layer: Layer, fmt: str, per_channel: bool = True
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from fusetune.kernels.fp8 import quantize_fp8

    pairs = {n: quantize_fp8(w, fmt, per_channel=per_channel) for n, w in layer.weights.items()}
    return {n: q for n, (q, _) in pairs.items()}, {n: s for n, (_, s) in pairs.items()}


def point_of(layer: Layer, weights: str = "", activations: str = "") -> Any:
    from fusetune.spec import Point

    return Point.make(layer.kernel, layer.dims, 1, layer.rows,
                      str(layer.x.dtype).removeprefix("torch."), weights, activations)


def default_config(layer: Layer, weights: str = "", activations: str = "") -> dict[str, int]:
    """The default heuristic's config at the layer's point of this weight format and mode."""
    from fusetune.kernels import get_spec
    from fusetune.tables import gpu_for_device

    spec = get_spec(layer.kernel)
    point = point_of(layer, weights, activations)
    return spec.canonical(spec.default_config(point, gpu_for_device(layer.x.device)), point)


def accuracy(kernels: list[str], dims: dict[str, dict[str, int]], m: int, dtype: torch.dtype,
             device: str, modes: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for kernel in kernels:
        layer = make_layer(kernel, dims[kernel], m, dtype, device)
        ref = reference(layer)
        w16 = {n: w.to(dtype) for n, w in layer.weights.items()}
        base = rel_err(run_fused(layer, w16, {}, default_config(layer)), ref)
        for fmt in FMTS:
            for per_channel in (True, False):
                wq, sc = quantized(layer, fmt, per_channel)
                deq = {n: (wq[n].float() * sc[n][:, None]).to(dtype) for n in wq}
                torch_err = rel_err(eager_fp16(layer, deq), ref)
                for mode in modes:
                    config = default_config(layer, f"fp8-{fmt}", mode)
                    out = run_fused(layer, wq, sc, config, act=bool(mode))
                    rows.append({"kernel": kernel, "fmt": fmt,
                                 "scales": "per-channel" if per_channel else "per-tensor",
                                 "activations": mode or "16bit", "rows": m,
                                 "fused_err": rel_err(out, ref), "torch_dequant_err": torch_err,
                                 "fused_fp16_err": base})
    return rows


def accuracy_lines(rows: list[dict[str, Any]], what: str) -> list[str]:
    lines = [f"Accuracy ({what}): ‖out − ref‖/‖ref‖ against float32 on the unquantized weights",
             "", "| kernel | fmt | scales | mode | fusetune FP8 | torch dequant->fp16 | "
             "fusetune fp16 weights |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        mode = MODES["fp8" if r["activations"] == "fp8" else ""]
        lines.append(f"| {r['kernel']} | {r['fmt']} | {r['scales']} | {mode} | "
                     f"{r['fused_err']:.2e} | {r['torch_dequant_err']:.2e} | "
                     f"{r['fused_fp16_err']:.2e} |")
    return lines


# ---- timing (CUDA only) ---------------------------------------------------------------------


def stacked_e4m3_gemm(layer: Layer, wq: dict[str, torch.Tensor]) -> Any:
    """cuBLAS FP8: x (already quantized to e4m3, per-tensor scale) times the stacked FP8
    weights, M padded to a multiple of 16; None where torch._scaled_mm refuses the formats."""
    w = torch.cat([wq[n] for n in WEIGHTS[layer.kernel]])
    x = layer.x.reshape(-1, layer.x.shape[-1])
    m = x.shape[0]
    xp = torch.zeros(-(-m // 16) * 16, x.shape[1], dtype=x.dtype, device=x.device)
    xp[:m] = x
    sx = (xp.float().abs().amax() / 448.0).clamp_min(1e-12)
    xq = (xp.float() / sx).to(torch.float8_e4m3fn)
    one = torch.ones((), device=x.device)

    def fn() -> torch.Tensor:
        # The second operand column-major: the transpose of the row-major [N, K] weight.
        return torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=one, out_dtype=torch.float16)

    try:
        fn()
    except (RuntimeError, TypeError) as e:
        print(f"note: torch._scaled_mm e4m3 x {w.dtype}: {' '.join(str(e).split())[:200]}",
              file=sys.stderr)
        return None
    return fn


def timing_case(kernel: str, m: int, fmt: str, dtype: torch.dtype, fp8_mma: bool,
                dims: dict[str, int] | None = None, device: str = "cuda") -> dict[str, Any]:
    """One row of the timing table: the functions to time and what is printed beside them."""
    import fusetune
    from benchmarks.timing import BW_TBS
    from fusetune.kernels import fp8, get_spec
    from fusetune.spec import Point

    spec = get_spec(kernel)
    dims = dims or LLAMA_DIMS[kernel]
    layer = make_layer(kernel, dims, m, dtype, device)
    wq, sc = quantized(layer, fmt)
    w16 = {n: w.to(dtype) for n, w in layer.weights.items()}
    dtype_name = str(dtype).removeprefix("torch.")
    weights = f"fp8-{fmt}"
    tuned = fusetune.lookup(kernel, dims, dtype_name, rows=m, weights=weights,
                            device=layer.x.device)
    tuned_act = (fusetune.lookup(kernel, dims, dtype_name, rows=m, weights=weights,
                                 activations="fp8", device=layer.x.device) if fp8_mma else None)

    # Each mode is checked once against the reference on the dequantized weights, with its
    # point's tolerance (16-bit for weight-only, fp8.ACT_FP8_TOLERANCE for FP8 activations).
    deq = {n: fp8.dequantize(wq[n], sc[n]) for n in wq}
    ref = reference(Layer(kernel, dims, layer.x, layer.side, deq, layer.rope))
    err = rel_err(run_fused(layer, wq, sc, None), ref)
    assert err <= spec.tolerance_for(point_of(layer, weights)), f"{kernel} FP8 wrong: {err}"
    err_act = None
    if fp8_mma:
        err_act = rel_err(run_fused(layer, wq, sc, None, act=True), ref)
        tol = spec.tolerance_for(point_of(layer, weights, "fp8"))
        assert err_act <= tol, f"{kernel} FP8 activations wrong: rel err {err_act}"
    w16_stacked = torch.cat([w16[n] for n in WEIGHTS[kernel]])
    x2 = layer.x.reshape(-1, layer.x.shape[-1])
    fns = {
        "fp8": lambda: run_fused(layer, wq, sc, None),
        "fp8_act": (lambda: run_fused(layer, wq, sc, None, act=True)) if fp8_mma else None,
        "fp16": lambda: run_fused(layer, w16, {}, None),
        "scaled_mm": stacked_e4m3_gemm(layer, wq) if fp8_mma else None,
        "gemm_fp16": lambda: F.linear(x2, w16_stacked),
    }
    layer.weights = {}  # only the quantized and 16-bit copies stay alive while timing
    point = point_of(layer, weights)
    floor8 = spec.cost(point).bytes / (BW_TBS * 1e6)
    floor16 = spec.cost(Point.make(kernel, dims, 1, m, dtype_name)).bytes / (BW_TBS * 1e6)
    return {"kernel": kernel, "rows": m, "fmt": fmt, "fns": fns, "tuned_cfg": tuned,
            "act_cfg": tuned_act, "rel_err": err, "rel_err_act": err_act,
            "floor_fp8_us": floor8, "floor_fp16_us": floor16}


def timing_lines(cases: list[dict[str, Any]], medians: list[dict[str, float | None]],
                 head: str) -> tuple[list[str], list[dict[str, Any]]]:
    cols = ["kernel", "M", "fmt", "floor FP8 µs", "floor fp16 µs", "fp8 (weight-only)",
            "fp8_act (FP8 activations)", "fp16", "scaled_mm", "gemm_fp16", "weight-only / fp16",
            "weight-only config", "FP8-activation config"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    raw = []
    for case, t in zip(cases, medians, strict=True):
        cells = ["-" if t.get(k) is None else f"{t[k]:.1f}" for k in IMPLS]
        ratio = f"{t['fp8'] / t['fp16']:.2f}" if t.get("fp8") and t.get("fp16") else "-"
        cfgs = [" ".join(f"{k}={v}" for k, v in c.items()) if c else "-"
                for c in (case["tuned_cfg"], case["act_cfg"])]
        lines.append(f"| {case['kernel']} | {case['rows']} | {case['fmt']} | "
                     f"{case['floor_fp8_us']:.1f} | {case['floor_fp16_us']:.1f} | "
                     + " | ".join(cells) + f" | {ratio} | " + " | ".join(cfgs) + " |")
        raw.append({k: case[k] for k in ("kernel", "rows", "fmt", "tuned_cfg", "act_cfg",
                                         "rel_err", "rel_err_act", "floor_fp8_us",
                                         "floor_fp16_us")}
                   | {"us": t})
    return lines, raw


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cuda = torch.cuda.is_available()
    if "--small" in argv and not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton's language and the kernels load
    from benchmarks.timing import heading, parser, time_cases

    ap = parser(__doc__, IMPLS)
    ap.add_argument("--kernels", default="ffn,qkv,lola")
    ap.add_argument("--rows", default="1,16,4096", help="rows (M) to time")
    ap.add_argument("--accuracy-rows", type=int, default=256,
                    help="rows of the accuracy comparison")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--small", action="store_true",
                    help="accuracy only, at small shapes; through Triton's CPU interpreter "
                         "where no GPU is visible")
    args = ap.parse_args(argv)
    if not cuda and not args.small:
        print("needs a CUDA GPU (or --small: accuracy on the CPU interpreter)", file=sys.stderr)
        return 2
    import fusetune
    from fusetune.kernels import fp8

    if args.tables:
        fusetune.load_tables(args.tables)
    kernels = args.kernels.split(",")
    unknown = [k for k in kernels if k not in WEIGHTS]
    if unknown:
        ap.error(f"unknown kernel {','.join(unknown)}; valid: {','.join(WEIGHTS)}")
    dtype = getattr(torch, args.dtype)
    device = "cuda" if cuda else "cpu"
    fp8_mma = fp8.has_fp8(torch.device(device))
    modes = ("", "fp8") if fp8_mma else ("",)
    acc_rows = min(args.accuracy_rows, 64) if args.small else args.accuracy_rows
    acc = accuracy(kernels, SMALL_DIMS if args.small else LLAMA_DIMS, acc_rows, dtype, device,
                   modes)
    what = (f"{'small shapes' if args.small else 'Llama-2-7B'}, {acc_rows} rows, {args.dtype}"
            f"{', Triton interpreter' if not cuda else ''}")
    lines = accuracy_lines(acc, what)
    doc: dict[str, Any] = {"accuracy": acc}
    if cuda and not args.small:
        from fusetune.tables import gpu_for_device

        gpu = gpu_for_device(torch.device("cuda"))
        # Points without a table entry run the default heuristic: warned once per point.
        warnings.simplefilter("once", fusetune.FusetuneWarning)
        cases = [timing_case(k, int(m), fmt, dtype, fp8_mma) for k in kernels
                 for m in args.rows.split(",") for fmt in FMTS]
        medians, host = time_cases(cases, args.impls.split(","), args.rounds,
                                   graphs=not args.no_graph)
        head = heading(gpu, "Llama-2-7B dims, FP8 weights with per-channel scales",
                       graphs=not args.no_graph)
        t_lines, raw = timing_lines(cases, medians, head)
        lines += ["", *t_lines, "", "Python-side cost of one call at the first row (µs of CPU, "
                  "not in the GPU times): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items())]
        doc.update(timing=raw, host_us=host)
    text = "\n".join(lines)
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
