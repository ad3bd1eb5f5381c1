"""The experts of a mixture-of-experts layer side by side on one GPU, in one process: fusetune.moe
with the tables' config and the default heuristic's, transformers' own experts module
(MixtralExperts, once per experts implementation the installed release registers: its eager
loop, batched_mm, grouped_mm, and those from the Hugging Face hub's kernels, deepgemm and
sonicmoe, where they load; each one left out says why), and a torch._grouped_mm baseline over
the same grouped tokens (two grouped GEMMs around SiLU·mul, the routing weights and the top-k
sum in torch), beside the floor of the weights the routed experts must read (their bytes at
this run's copy rate) and a Triton kernel that only reads those bytes in one launch
(read_only: the best of bench_decode's shapes), what a kernel that must read them can reach at
all.

A lone layer's graph replay pays the graph's launch before its first kernel: at a few tokens a
large part of the experts' time. In a model every layer runs in one graph, back to back:
--layers N times N layers' calls in one graph, each layer its own weights and routing, and
reports the time per layer (every implementation the same way).

    python -m benchmarks.bench_moe --model mixtral-8x7b --rows 1,8,4096 [--layers 8]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import fusetune
from benchmarks.bench_decode import READ_SHAPES
from benchmarks.timing import heading, median_us, parser, report, run, start
from fusetune.kernels import fp8
from fusetune.kernels.moe import SPEC, _reference
from fusetune.models import preset
from fusetune.spec import Point, torch_dtype


def hf_impl_names() -> tuple[str, ...]:
    """transformers' experts implementations of the installed release: "eager" (the module's
    own loop), then every name its ExpertsInterface registers (none without transformers)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return ()
    return ("eager", *sorted(ALL_EXPERTS_FUNCTIONS.valid_keys()))


HF_IMPLS = hf_impl_names()
IMPLS = ("tuned", "default", *(f"hf-{name}" for name in HF_IMPLS), "grouped_mm", "read_only")


def hf_experts(inputs: dict[str, Any]) -> dict[str, Any]:
    """transformers' MixtralExperts holding the case's weights, once per experts implementation
    of the installed release ("hf-<name>"; None, after a note saying why, where it fails here:
    a hub kernel that does not load, a GPU it does not support)."""
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
        except Exception as err:  # a kernel that does not load or run here
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


@triton.jit
def _read_experts_kernel(GU, DN, USED, OUT, n_gu, n_dn, BLOCK: tl.constexpr,
                         EVICT: tl.constexpr):
    # Program (b, j): elements [b·BLOCK, (b+1)·BLOCK) of expert USED[j]'s weights taken as one
    # range, its gate_up slab (n_gu elements) and then its down slab (n_dn); each load's mask
    # keeps it inside its slab, so every byte is read once. Writes the block's float32 sum:
    # almost nothing, as the experts' GEMVs write almost nothing at a few tokens. (The blocks
    # on grid axis 0, the only one not limited to 65535: Mixtral's expert is 176M elements.)
    e = tl.load(USED + tl.program_id(1)).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_gu = offs < n_gu
    a = tl.load(GU + e * n_gu + offs, mask=in_gu, other=0.0, eviction_policy=EVICT)
    b = tl.load(DN + e * n_dn + (offs - n_gu), mask=~in_gu & (offs < n_gu + n_dn), other=0.0,
                eviction_policy=EVICT)
    total = tl.sum(a.to(tl.float32), axis=0) + tl.sum(b.to(tl.float32), axis=0)
    tl.store(OUT + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), total)


def read_grid(used: int, per_expert: int, block: int) -> tuple[int, int]:
    """_read_experts_kernel's grid: (blocks of an expert, experts)."""
    return triton.cdiv(per_expert, block), used


def read_experts(gate_up: torch.Tensor, down: torch.Tensor, used: torch.Tensor, block: int,
                 warps: int, evict: bool) -> torch.Tensor:
    """The read-only kernel over the experts `used` (int32 ids) of gate_up [E, 2H, D] and down
    [E, D, H]: per program, the float32 sum of its block (their total: the weights' sum)."""
    n_gu, n_dn = gate_up[0].numel(), down[0].numel()
    grid = read_grid(used.numel(), n_gu + n_dn, block)
    out = torch.empty(grid[0] * grid[1], device=gate_up.device, dtype=torch.float32)
    _read_experts_kernel[grid](gate_up, down, used, out, n_gu, n_dn, BLOCK=block,
                               EVICT="evict_first" if evict else "", num_warps=warps)
    return out


def read_only(inputs: dict[str, Any]) -> Any:
    """The read-only kernel over the routed experts' weights in its fastest shape here (its
    sum checked against torch's first)."""
    gu, dn = inputs["gate_up"], inputs["down"]
    used = inputs["topk_ids"].unique().to(torch.int32)
    ref = (gu[used.long()].double().sum() + dn[used.long()].double().sum()).item()
    best: tuple[float, Any] | None = None
    for block, warps, evict in READ_SHAPES:
        def fn(block: int = block, warps: int = warps, evict: bool = evict) -> torch.Tensor:
            return read_experts(gu, dn, used, block, warps, evict)

        total = fn().double().sum().item()
        assert abs(total - ref) <= 1e-3 * max(1.0, abs(ref)), (total, ref)
        t = median_us(fn)
        if best is None or t < best[0]:
            best = (t, fn)
    assert best is not None
    return best[1]


def layer_fns(inputs: dict[str, Any], point: Point, tuned_cfg: dict[str, int],
              default_cfg: dict[str, int], impls: Sequence[str]
              ) -> tuple[dict[str, Any], float, int]:
    """One layer's implementations over `inputs` (fusetune.moe's two and those of `impls`),
    fusetune.moe's relative error against the reference, and the number of experts its
    routing uses."""
    def fused(config: dict[str, int] | None = None) -> torch.Tensor:
        return fusetune.moe(inputs["x"], inputs["gate_up"], inputs["down"], inputs["topk_ids"],
                            inputs["topk_weights"], gate_up_scale=inputs["gate_up_scale"],
                            down_scale=inputs["down_scale"], config=config)

    base = inputs  # what the baselines take: 16-bit weights, the dequantized ones
    if point.weights:
        base = {**inputs, **{name: fp8.spec_dequantized(inputs, name).to(
            torch_dtype(point.dtype)) for name in ("gate_up", "down")}}
    ref = _reference(inputs)["out"]
    err = float((fused().float() - ref).norm() / ref.norm())
    assert err < SPEC.tolerance[point.dtype], f"moe wrong: rel err {err}"
    fns = {"tuned": fused, "default": lambda: fused(default_cfg)}
    if any(i.startswith("hf-") for i in impls):  # (each holds a copy of the experts first)
        fns.update(hf_experts(base))
    if "grouped_mm" in impls:
        fns["grouped_mm"] = grouped_mm(base)
    if "read_only" in impls:
        fns["read_only"] = read_only(inputs)
    return fns, err, int(inputs["topk_ids"].unique().numel())


def chained(fns: list[Any]) -> Any:
    """One call that runs `fns` in turn (a model's layers, one after the other); None where
    any of them is None."""
    if any(f is None for f in fns):
        return None

    def run_() -> object:
        for f in fns:
            out = f()
        return out

    return run_


def make_case(rows: int, dims: dict[str, int], dtype: str, weights: str,
              gpu: Any, impls: Sequence[str] = IMPLS, layers: int = 1) -> dict[str, Any]:
    """A case of `layers` layers (each its own weights and routing, seeded by its index),
    each implementation's call running them all; its floor's bytes those of a layer's routed
    experts (the layers' mean)."""
    point = Point.make("moe", dims, 1, rows, dtype, weights)
    tuned_cfg = fusetune.lookup("moe", dims, dtype, rows=rows, weights=weights)
    default_cfg = SPEC.canonical(SPEC.default_config(point, gpu), point)
    per_layer, errs, used = [], [], []
    for i in range(layers):
        torch.manual_seed(i)
        fns, err, n = layer_fns(SPEC.make_inputs(point, "cuda"), point, tuned_cfg, default_cfg,
                                impls)
        per_layer.append(fns)
        errs.append(err)
        used.append(n)
    elt = fp8.operand_bytes(point)[1]
    weight_bytes = sum(used) / layers * 3 * dims["hidden"] * dims["dim"] * elt
    label = (f"T={rows} ({used[0]} experts used)" if layers == 1 else
             f"T={rows} ({sum(used) / layers:.1f} experts used a layer)")
    return {"label": label, "dtype": dtype + (f", {weights}" if weights else ""),
            "fns": {k: chained([f[k] for f in per_layer]) for k in per_layer[0]},
            "tuned_cfg": tuned_cfg, "default_cfg": default_cfg, "rel_err": max(errs),
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
    ap.add_argument("--layers", type=int, default=1,
                    help="layers timed in one call (one CUDA graph), each its own weights and "
                         "routing, as in a model; every figure is then per layer (default: 1, "
                         "a lone layer)")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers must be at least 1, not {args.layers}")
    gpu = start(args)
    if gpu is None:
        return 2
    dims = SPEC.dims_from_model(preset(args.model))
    impls = args.impls.split(",")
    cases = [make_case(int(m), dims, dt, args.weights, gpu, impls, args.layers)
             for dt in args.dtype.split(",") for m in args.rows.split(",")]
    totals, host_totals = run(args, cases)
    n = args.layers  # every figure per layer
    medians = [{k: None if v is None else v / n for k, v in t.items()} for t in totals]
    host = {k: v / n for k, v in host_totals.items()}
    bw = copy_tbs()
    per_layer = "" if n == 1 else f"; per layer, {n} layers' calls back to back in one graph"
    head = heading(gpu, f"{args.model} experts {dims}; weights floor: the routed experts' "
                        f"bytes at this run's copy rate, {bw:.2f} TB/s{per_layer}",
                   graphs=not args.no_graph)
    cols = ["dtype", "tokens", "weights floor µs", *impls, "tuned / grouped_mm",
            "tuned / fastest transformers",
            "weights TB/s (tuned)", "floor / tuned", "read_only / tuned",
            "tuned config " + "/".join(SPEC.config_keys)]
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
                 f"{t['read_only'] / tuned:.0%}" if tuned and t.get("read_only") else "-",
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
