"""The experts of a mixture-of-experts layer side by side on one GPU, in one process: fusetune.moe
with the tables' config and the default heuristic's, transformers' own experts module
(MixtralExperts, once per experts implementation of the installed release: its eager loop,
batched_mm, grouped_mm), and a torch._grouped_mm baseline over the same grouped tokens (two
grouped GEMMs around SiLU·mul, the routing weights and the top-k sum in torch), beside the floor
of the weights the routed experts must read.

    python -m benchmarks.bench_moe --model mixtral-8x7b --rows 1,8,4096
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

import fusetune
from benchmarks.timing import heading, median_us, parser, report, run, start
from fusetune.kernels import fp8
from fusetune.kernels.moe import SPEC, _reference
from fusetune.models import preset
from fusetune.spec import Point, torch_dtype

IMPLS = ("tuned", "default", "hf-eager", "hf-batched_mm", "hf-grouped_mm", "grouped_mm")


HF_IMPLS = ("eager", "batched_mm", "grouped_mm")  # transformers' experts implementations that
# need no package beyond torch (its ExpertsInterface; "eager" is the module's own loop)


def hf_experts(inputs: dict[str, Any]) -> dict[str, Any]:
    """transformers' MixtralExperts holding the case's weights, once per experts implementation
    of the installed release ("hf-<name>"; None where the release lacks it or it fails here)."""
    fns: dict[str, Any] = {f"hf-{name}": None for name in HF_IMPLS}
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    except ImportError:
        return fns
    e, h2, d = inputs["gate_up"].shape
    for name in HF_IMPLS:
        config = MixtralConfig(hidden_size=d, intermediate_size=h2 // 2, num_local_experts=e,
                               num_experts_per_tok=inputs["topk_ids"].shape[1],
                               hidden_act="silu")
        config._experts_implementation = name
        experts = MixtralExperts(config).to(device=inputs["x"].device, dtype=inputs["x"].dtype)
        experts.gate_up_proj.data = inputs["gate_up"]
        experts.down_proj.data = inputs["down"]

        def fn(experts: Any = experts) -> torch.Tensor:
            return experts(inputs["x"], inputs["topk_ids"], inputs["topk_weights"])

        try:
            fn()
        except Exception as err:  # (KeyError where the release does not register it)
            print(f"note: transformers' {name} experts left out: {type(err).__name__}: {err}",
                  file=sys.stderr)
            continue
        fns[f"hf-{name}"] = fn
    return fns


def grouped_mm(inputs: dict[str, Any]) -> Any:
    """torch._grouped_mm over the pairs sorted by expert (None where torch lacks it)."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    x, gu, dn = inputs["x"], inputs["gate_up"], inputs["down"]
    ids, w = inputs["topk_ids"], inputs["topk_weights"]
    k = ids.shape[1]

    def run_() -> torch.Tensor:
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        counts = torch.zeros(gu.shape[0], dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # (bincount waits for the device)
        offs = counts.cumsum(0).to(torch.int32)
        ab = torch._grouped_mm(x[token], gu.transpose(1, 2), offs=offs)
        a, b = ab.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(a) * b, dn.transpose(1, 2), offs=offs)
        y = y * w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, y)

    return run_


def make_case(rows: int, dims: dict[str, int], dtype: str, weights: str,
              gpu: Any) -> dict[str, Any]:
    point = Point.make("moe", dims, 1, rows, dtype, weights)
    torch.manual_seed(0)
    inputs = SPEC.make_inputs(point, "cuda")
    tuned_cfg = fusetune.lookup("moe", dims, dtype, rows=rows, weights=weights)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    ref = _reference(inputs)["out"]

    def fused(config: dict[str, int] | None = None) -> torch.Tensor:
        return fusetune.moe(inputs["x"], inputs["gate_up"], inputs["down"], inputs["topk_ids"],
                            inputs["topk_weights"], gate_up_scale=inputs["gate_up_scale"],
                            down_scale=inputs["down_scale"], config=config)

    base = inputs  # what the baselines take: 16-bit weights, the dequantized ones
    if weights:
        base = {**inputs, **{name: fp8.spec_dequantized(inputs, name).to(torch_dtype(dtype))
                             for name in ("gate_up", "down")}}

    err = float((fused().float() - ref).norm() / ref.norm())
    assert err < SPEC.tolerance[dtype], f"moe wrong: rel err {err}"
    used = int(inputs["topk_ids"].unique().numel())
    elt = fp8.operand_bytes(point)[1]
    weight_bytes = used * 3 * dims["hidden"] * dims["dim"] * elt
    fns = {"tuned": fused, "default": lambda: fused(default_cfg), **hf_experts(base),
           "grouped_mm": grouped_mm(base)}
    return {"label": f"T={rows} ({used} experts used)", "dtype": dtype + (
                f", {weights}" if weights else ""), "fns": fns,
            "tuned_cfg": tuned_cfg, "default_cfg": default_cfg, "rel_err": err,
            "weight_bytes": weight_bytes}


def copy_tbs() -> float:
    """This GPU's device-to-device copy rate in this run, TB/s of bytes read and written (a
    1 GiB tensor): the floors' bandwidth."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / median_us(lambda: dst.copy_(src)) / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, IMPLS)
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--rows", default="1,8,4096", help="tokens, comma-separated")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="", help="fp8-e4m3 or fp8-e5m2: fusetune.moe's weights "
                    "(the baselines run the dequantized 16-bit ones); default: 16-bit")
    args = ap.parse_args(argv)
    gpu = start(args)
    if gpu is None:
        return 2
    dims = SPEC.dims_from_model(preset(args.model))
    cases = [make_case(int(m), dims, dt, args.weights, gpu)
             for dt in args.dtype.split(",") for m in args.rows.split(",")]
    medians, host = run(args, cases)
    bw = copy_tbs()
    impls = args.impls.split(",")
    head = heading(gpu, f"{args.model} experts {dims}; weights floor: the routed experts' "
                        f"bytes at this run's copy rate, {bw:.2f} TB/s", graphs=not args.no_graph)
    cols = ["dtype", "tokens", "weights floor µs", *impls, "tuned / grouped_mm",
            "tuned / fastest transformers",
            "weights TB/s (tuned)", "floor / tuned", "tuned config " + "/".join(SPEC.config_keys)]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    raw = []
    for case, t in zip(cases, medians, strict=True):
        floor = case["weight_bytes"] / (bw * 1e6)
        tuned, base = t.get("tuned"), t.get("grouped_mm")
        hf = [v for k, v in t.items() if k.startswith("hf-") and v is not None]
        cells = [case["dtype"], case["label"], f"{floor:.1f}",
                 *("-" if t.get(k) is None else f"{t[k]:.1f}" for k in impls),
                 f"{tuned / base:.2f}" if tuned and base else "-",
                 f"{tuned / min(hf):.2f}" if tuned and hf else "-",
                 f"{case['weight_bytes'] / tuned / 1e6:.2f}" if tuned else "-",
                 f"{floor / tuned:.0%}" if tuned else "-",
                 "/".join(str(case["tuned_cfg"][k]) for k in SPEC.config_keys)]
        lines.append("| " + " | ".join(cells) + " |")
        raw.append({"dtype": case["dtype"], "tokens": case["label"], "us": t,
                    "floor_us": floor, "tuned_config": case["tuned_cfg"],
                    "rel_err": case["rel_err"]})
    report(lines, raw, host, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
