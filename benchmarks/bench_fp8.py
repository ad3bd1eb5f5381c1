"""FP8 weights in the fused matmul kernels (ffn, qkv, lola) on one GPU, in one process.

Accuracy: for each kernel, format (e4m3, e5m2), scaling (one scale per output channel, as
fusetune.quantize_fp8 makes them, or one for the whole tensor) and ACT_FP8 (0; 1 where the GPU
has FP8 tensor cores), the relative error ‖out − ref‖/‖ref‖ against the float32 reference on the
same weights before quantization, beside the error of dequantizing the weights to fp16 and
running the layer in torch (cuBLAS fp16): what FP8 weights cost in accuracy by themselves.

Time at M = 1, 16, 4096 rows (Llama-2-7B: ffn 4096 -> 11008, qkv 32 heads of 128 with 32 kv
heads, lola 4096 -> 16384): the FP8 kernel (config from the tables, or the default heuristic),
the same config with ACT_FP8 = 0 and with ACT_FP8 = 1 (PASSES = 2), the fp16 kernel, cuBLAS FP8
(torch._scaled_mm on the stacked weights, activations already quantized to e4m3, M padded to a
multiple of 16) and the cuBLAS fp16 GEMM on the stacked weights, beside the memory floors (bytes
that must move at 3.0 TB/s) with FP8 and with fp16 weights. The cuBLAS columns are the matmul
alone, without the norm and the epilogue the fused kernels include.

    python -m benchmarks.bench_fp8 --tables tables.yaml --markdown fp8.md --json fp8.json
    python -m benchmarks.bench_fp8 --small     # accuracy at small shapes; on a machine without
                                               # a GPU through Triton's CPU interpreter
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# benchmarks.timing (Triton's language with it) is imported in main(): under --small without a
# GPU, TRITON_INTERPRET must be set first.
IMPLS = ("fp8", "fp8_act0", "fp8_act1", "fp16", "scaled_mm", "gemm_fp16")
FMTS = ("e4m3", "e5m2")
LLAMA_DIMS = {"ffn": {"dim": 4096, "hidden": 11008},
              "qkv": {"dim": 4096, "head_dim": 128, "interleaved": 1, "n_heads": 32,
                      "n_kv_heads": 32},
              "lola": {"dim": 4096, "out": 16384}}
SMALL_DIMS = {"ffn": {"dim": 256, "hidden": 176},
              "qkv": {"dim": 256, "head_dim": 32, "interleaved": 1, "n_heads": 4,
                      "n_kv_heads": 2},
              "lola": {"dim": 256, "out": 192}}
WEIGHTS = {"ffn": ("w1", "w3"), "qkv": ("wq", "wk", "wv"), "lola": ("weight",)}


@dataclass
class Layer:
    """One kernel's inputs at one shape: activations, norm weight or bias, float32 weights."""

    kernel: str
    dims: dict[str, int]
    x: torch.Tensor
    side: torch.Tensor  # the RMSNorm weight (ffn, qkv) or the bias (lola)
    weights: dict[str, torch.Tensor]  # float32, [out_features, in_features]

    @property
    def rows(self) -> int:
        return self.x.numel() // self.x.shape[-1]


def make_layer(kernel: str, dims: dict[str, int], m: int, dtype: torch.dtype, device: str
               ) -> Layer:
    torch.manual_seed(0)
    d = dims["dim"]
    x = torch.randn(m, d, device=device)
    if kernel == "lola":  # hidden states with a per-row offset and scale
        x = x * (1 + torch.rand(m, 1, device=device)) + 0.5 * torch.randn(m, 1, device=device)
    if kernel == "qkv":
        x = x.view(1, m, d)
        hd = dims["head_dim"]
        outs = {"wq": dims["n_heads"] * hd, "wk": dims["n_kv_heads"] * hd,
                "wv": dims["n_kv_heads"] * hd}
    else:
        n = dims["hidden"] if kernel == "ffn" else dims["out"]
        outs = {name: n for name in WEIGHTS[kernel]}
    side = (0.1 * torch.randn(outs["weight"], device=device) if kernel == "lola"
            else 1 + 0.1 * torch.randn(d, device=device))
    weights = {name: torch.randn(n, d, device=device) / d**0.5 for name, n in outs.items()}
    return Layer(kernel, dims, x.to(dtype), side.to(dtype), weights)


def run_fused(layer: Layer, w: dict[str, torch.Tensor], s: dict[str, torch.Tensor | None],
              config: dict[str, int] | None) -> tuple[torch.Tensor, ...]:
    """The fusetune kernel on weights `w` (FP8 or x's dtype) with scales `s`."""
    import fusetune

    if layer.kernel == "ffn":
        return (fusetune.ffn(layer.x, layer.side, w["w1"], w["w3"], w1_scale=s.get("w1"),
                             w3_scale=s.get("w3"), config=config),)
    if layer.kernel == "qkv":
        return fusetune.qkv(layer.x, layer.side, w["wq"], w["wk"], w["wv"],
                            head_dim=layer.dims["head_dim"], wq_scale=s.get("wq"),
                            wk_scale=s.get("wk"), wv_scale=s.get("wv"), config=config)
    return (fusetune.lola(layer.x, w["weight"], layer.side, weight_scale=s.get("weight"),
                          config=config),)


def reference(layer: Layer) -> tuple[torch.Tensor, ...]:
    """float32 torch on the unquantized weights (the kernel spec's reference)."""
    from fusetune.kernels import get_spec

    spec = get_spec(layer.kernel)
    inputs: dict[str, Any] = {"x": layer.x, **layer.weights}
    if layer.kernel == "lola":
        inputs.update(bias=layer.side, eps=1e-5)
    else:
        inputs.update(rms_weight=layer.side, eps=1e-6)
    if layer.kernel == "qkv":
        inputs.update(start_pos=0, theta=10000.0, head_dim=layer.dims["head_dim"],
                      interleaved=True)
    return tuple(spec.reference(inputs).values())


def eager_fp16(layer: Layer, w16: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The layer in torch with 16-bit weights `w16` (dequantized FP8): norm in float32, the
    products by cuBLAS (F.linear) in x's dtype."""
    from fusetune.kernels import get_spec

    rope_reference = get_spec("rope").reference
    h = layer.x.float()
    if layer.kernel == "lola":
        xn = F.layer_norm(h, (h.shape[-1],), eps=1e-5).to(layer.x.dtype)
        return (F.gelu(F.linear(xn, w16["weight"], layer.side)),)
    xn = layer.side * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(layer.x)
    if layer.kernel == "ffn":
        return (F.silu(F.linear(xn, w16["w1"])) * F.linear(xn, w16["w3"]),)
    b, s, _ = layer.x.shape
    hd = layer.dims["head_dim"]
    q, k, v = (F.linear(xn, w16[n]).view(b, s, -1, hd) for n in WEIGHTS["qkv"])

    def rot(t: torch.Tensor) -> torch.Tensor:
        inputs = {"x": t, "start_pos": 0, "theta": 10000.0, "interleaved": True}
        return rope_reference(inputs)["y"].to(t.dtype)

    return rot(q), rot(k), v


def rel_err(outs: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...]) -> float:
    """The largest ‖out − ref‖/‖ref‖ over the outputs (q, k, v for qkv)."""
    return max(float((o.float() - r.float()).norm() / r.float().norm())
               for o, r in zip(outs, refs, strict=True))


def quantized(layer: Layer, fmt: str, per_channel: bool = True
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from fusetune.kernels.fp8 import quantize_fp8

    pairs = {n: quantize_fp8(w, fmt, per_channel=per_channel) for n, w in layer.weights.items()}
    return {n: q for n, (q, _) in pairs.items()}, {n: s for n, (_, s) in pairs.items()}


def fp8_config(layer: Layer, fmt: str, act: int) -> dict[str, int]:
    """A config of the kind a prefill search picks (norm pass first), with ACT_FP8 = act."""
    from fusetune.kernels import get_spec
    from fusetune.kernels._spec import Point
    from fusetune.tables import gpu_for_device

    spec = get_spec(layer.kernel)
    point = Point.make(layer.kernel, layer.dims, 1, layer.rows,
                       str(layer.x.dtype).removeprefix("torch."), f"fp8-{fmt}")
    c = spec.default_config(point, gpu_for_device(layer.x.device))
    c.update(PASSES=2, ACT_FP8=act, SPLIT_K=1, BLOCK_M=max(c["BLOCK_M"], 16))
    return spec.canonical(c, point)


def accuracy(kernels: list[str], dims: dict[str, dict[str, int]], m: int, dtype: torch.dtype,
             device: str, act_values: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for kernel in kernels:
        layer = make_layer(kernel, dims[kernel], m, dtype, device)
        ref = reference(layer)
        w16 = {n: w.to(dtype) for n, w in layer.weights.items()}
        base = rel_err(run_fused(layer, w16, {}, fp8_config(layer, "e4m3", 0)), ref)
        for fmt in FMTS:
            for per_channel in (True, False):
                wq, sc = quantized(layer, fmt, per_channel)
                deq = {n: (wq[n].float() * sc[n][:, None]).to(dtype) for n in wq}
                torch_err = rel_err(eager_fp16(layer, deq), ref)
                for act in act_values:
                    out = run_fused(layer, wq, sc, fp8_config(layer, fmt, act))
                    rows.append({"kernel": kernel, "fmt": fmt,
                                 "scales": "per-channel" if per_channel else "per-tensor",
                                 "act_fp8": act, "rows": m, "fused_err": rel_err(out, ref),
                                 "torch_dequant_err": torch_err, "fused_fp16_err": base})
    return rows


def accuracy_lines(rows: list[dict[str, Any]], what: str) -> list[str]:
    lines = [f"Accuracy ({what}): ‖out − ref‖/‖ref‖ against float32 on the unquantized weights",
             "", "| kernel | fmt | scales | ACT_FP8 | fusetune FP8 | torch dequant->fp16 | "
             "fusetune fp16 weights |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['fmt']} | {r['scales']} | {r['act_fp8']} | "
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
    from fusetune.kernels._spec import Point, check_fits
    from fusetune.tables import gpu_for_device

    spec = get_spec(kernel)
    dims = dims or LLAMA_DIMS[kernel]
    layer = make_layer(kernel, dims, m, dtype, device)
    wq, sc = quantized(layer, fmt)
    w16 = {n: w.to(dtype) for n, w in layer.weights.items()}
    dtype_name = str(dtype).removeprefix("torch.")
    point = Point.make(kernel, dims, 1, m, dtype_name, f"fp8-{fmt}")
    tuned = fusetune.lookup(kernel, dims, dtype_name, rows=m, weights=f"fp8-{fmt}",
                            device=layer.x.device)

    gpu = gpu_for_device(layer.x.device)

    def forced(act: int) -> dict[str, int] | None:
        """The tuned config with ACT_FP8 = act, or None where that does not fit this GPU
        (FP8 tiles upcast in registers take more shared memory)."""
        c = dict(tuned, ACT_FP8=act)
        if act:
            c.update(PASSES=2, BLOCK_M=max(c["BLOCK_M"], 16))
        c = spec.canonical(c, point)
        return c if check_fits(spec.resources(c, point), gpu) is None else None

    act0, act1 = forced(0), forced(1) if fp8_mma else None

    # The FP8 kernel is checked once against the reference on the dequantized weights.
    deq = {n: fp8.dequantize(wq[n], sc[n]) for n in wq}
    ref = reference(Layer(kernel, dims, layer.x, layer.side, deq))
    err = rel_err(run_fused(layer, wq, sc, tuned), ref)
    assert err <= spec.tolerance_for(point, tuned), f"{kernel} FP8 wrong: rel err {err}"
    w16_stacked = torch.cat([w16[n] for n in WEIGHTS[kernel]])
    x2 = layer.x.reshape(-1, layer.x.shape[-1])
    fns = {
        "fp8": lambda: run_fused(layer, wq, sc, tuned),
        "fp8_act0": (lambda: run_fused(layer, wq, sc, act0)) if act0 else None,
        "fp8_act1": (lambda: run_fused(layer, wq, sc, act1)) if act1 else None,
        "fp16": lambda: run_fused(layer, w16, {}, None),
        "scaled_mm": stacked_e4m3_gemm(layer, wq) if fp8_mma else None,
        "gemm_fp16": lambda: F.linear(x2, w16_stacked),
    }
    layer.weights = {}  # only the quantized and 16-bit copies stay alive while timing
    floor8 = spec.cost(point).bytes / (BW_TBS * 1e6)
    floor16 = spec.cost(Point.make(kernel, dims, 1, m, dtype_name)).bytes / (BW_TBS * 1e6)
    return {"kernel": kernel, "rows": m, "fmt": fmt, "fns": fns, "tuned_cfg": tuned,
            "act1_cfg": act1, "rel_err": err,
            "floor_fp8_us": floor8, "floor_fp16_us": floor16}


def timing_lines(cases: list[dict[str, Any]], medians: list[dict[str, float | None]],
                 head: str) -> tuple[list[str], list[dict[str, Any]]]:
    cols = ["kernel", "M", "fmt", "floor FP8 µs", "floor fp16 µs", *IMPLS, "fp8/fp16",
            "fp8 config"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    raw = []
    for case, t in zip(cases, medians, strict=True):
        cells = ["-" if t.get(k) is None else f"{t[k]:.1f}" for k in IMPLS]
        best8 = min((t[k] for k in ("fp8", "fp8_act0", "fp8_act1") if t.get(k)), default=None)
        ratio = f"{best8 / t['fp16']:.2f}" if best8 and t.get("fp16") else "-"
        cfg = " ".join(f"{k}={v}" for k, v in case["tuned_cfg"].items())
        lines.append(f"| {case['kernel']} | {case['rows']} | {case['fmt']} | "
                     f"{case['floor_fp8_us']:.1f} | {case['floor_fp16_us']:.1f} | "
                     + " | ".join(cells) + f" | {ratio} | {cfg} |")
        raw.append({k: case[k] for k in ("kernel", "rows", "fmt", "tuned_cfg", "act1_cfg",
                                         "rel_err", "floor_fp8_us", "floor_fp16_us")}
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
    dtype = getattr(torch, args.dtype)
    device = "cuda" if cuda else "cpu"
    fp8_mma = fp8.has_fp8(torch.device(device))
    acc_rows = min(args.accuracy_rows, 64) if args.small else args.accuracy_rows
    acc = accuracy(kernels, SMALL_DIMS if args.small else LLAMA_DIMS, acc_rows, dtype, device,
                   (0, 1) if fp8_mma else (0,))
    what = (f"{'small shapes' if args.small else 'Llama-2-7B'}, {acc_rows} rows, {args.dtype}"
            f"{', Triton interpreter' if not cuda else ''}")
    lines = accuracy_lines(acc, what)
    doc: dict[str, Any] = {"accuracy": acc}
    if cuda and not args.small:
        from fusetune.tables import gpu_for_device

        gpu = gpu_for_device(torch.device("cuda"))
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
