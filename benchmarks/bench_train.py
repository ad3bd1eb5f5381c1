"""Training: a forward + backward step of one Llama decoder layer, and of the ops with
backward passes alone, beside Hugging Face eager, torch.compile and Liger Kernel; time and
peak memory.

The layer is a transformers LlamaModel of one decoder layer (and its final norm) with random
weights, stepped from input embeddings [batch, seq, dim] to a backward of a fixed output
gradient; every parameter's gradient is compared with the same step of the model in float32.
fusetune: `fusetune.patch(model)` (with gradients recorded each layer runs fusetune.rmsnorm,
fusetune.rope and fusetune.swiglu, the projections stay torch matmuls). liger:
`apply_liger_kernel_to_llama` (RMSNorm, RoPE, SwiGLU; its module-wide replacement of
transformers' rotary function is in place only during its own steps, so all four run in the
same interleaved rounds). The ops alone: RMSNorm [tokens, dim], RoPE
of q [batch, seq, heads, head_dim], SwiGLU [tokens, hidden], forward + backward each.

Times: medians of triton.testing.do_bench (L2 flushed) of plain calls, median of
interleaved rounds; peak memory: the most allocated during a step beyond what was allocated
before it.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.script_args import doc_summary
from benchmarks.timing import interleaved_medians

IMPLS = ("hf-eager", "compile", "liger", "fusetune")
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                 max_position_embeddings=8192, vocab_size=256)  # the embedding is not used


def peak_mib(step: Callable[[], object]) -> float:
    """The most memory allocated during `step()` beyond what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def layer_model(dtype: torch.dtype, seed: int) -> Any:
    import transformers

    config = transformers.LlamaConfig(**LLAMA3_8B, num_hidden_layers=1)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.LlamaModel(config).to(dtype)
    return model.train()


def layer_step(model: Any, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], None]:
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        out = model(inputs_embeds=x).last_hidden_state
        out.backward(dy.clone())  # Liger's RMSNorm backward overwrites its output gradient

    return step


def liger_layer(base: Any, x: torch.Tensor, dy: torch.Tensor
                ) -> tuple[Any, Callable[[], None]] | None:
    """A copy of `base` patched by Liger Kernel (RMSNorm, RoPE, SwiGLU) and its step; None
    without Liger Kernel. apply_liger_kernel_to_llama replaces transformers' rotary function
    (and its RMSNorm and MLP classes) module-wide: they are put back at once, and Liger's
    rotary function is installed only while its own step runs, so that every implementation
    runs in the same interleaved rounds and the others keep transformers' code."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError:
        return None
    from transformers.models.llama import modeling_llama as ml

    kept = {n: getattr(ml, n) for n in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}
    m = copy.deepcopy(base)
    try:
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False, model=m)
        liger_rope = ml.apply_rotary_pos_emb
    finally:
        for n, v in kept.items():
            setattr(ml, n, v)
    inner = layer_step(m, x, dy)

    def step() -> None:
        ml.apply_rotary_pos_emb = liger_rope
        try:
            inner()
        finally:
            ml.apply_rotary_pos_emb = kept["apply_rotary_pos_emb"]

    return m, step


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def layer_cases(args: argparse.Namespace, impls: list[str]) -> list[str]:
    import fusetune

    dtype = torch.bfloat16
    b, s, d = args.batch, args.seq, LLAMA3_8B["hidden_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, s, d, device="cuda", dtype=dtype, generator=gen)
    dy = torch.randn(b, s, d, device="cuda", dtype=dtype, generator=gen)
    base = layer_model(dtype, 0)
    # the float32 step: the gradients every case is compared with
    exact = copy.deepcopy(base).float()
    layer_step(exact, x.float(), dy.float())()
    want = {n: p.grad for n, p in exact.named_parameters() if p.grad is not None}
    del exact
    models = {}
    for impl in impls:
        if impl == "liger":
            continue
        m = copy.deepcopy(base)
        if impl == "fusetune":
            fusetune.patch(m)
        models[impl] = torch.compile(m) if impl == "compile" else m
    steps = {impl: layer_step(m, x, dy) for impl, m in models.items()}
    if "liger" in impls:
        liger = liger_layer(base, x, dy)
        if liger is None:
            print("liger skipped: liger_kernel is not installed")
        else:
            models["liger"], steps["liger"] = liger
    results: dict[str, dict[str, float | None]] = {}
    for impl, step in steps.items():
        step()  # compiles, tunes nothing: the tables hold the configs
        results[impl] = {"peak": peak_mib(step), "err": max(
            rel_err(p.grad, want[n.removeprefix("_orig_mod.")])
            for n, p in models[impl].named_parameters() if n.removeprefix("_orig_mod.") in want)}
    times = interleaved_medians(steps, args.rounds)
    lines = [f"### One decoder layer, forward + backward: batch {b} × seq {s}, bf16, "
             "Llama-3-8B dims",
             "| implementation | ms | vs HF eager | peak MiB | max grad rel. err vs float32 |",
             "|---|---|---|---|---|"]
    ref = times.get("hf-eager")
    for impl in impls:
        if impl not in results:
            continue
        t = times[impl]
        lines.append(f"| {impl} | {t / 1e3:.2f} | "
                     f"{'' if ref is None else f'{t / ref:.2f}×'} | "
                     f"{results[impl]['peak']:.0f} | {results[impl]['err']:.1e} |")
    return lines


# ---- the ops alone ---------------------------------------------------------------------------


def torch_rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def torch_swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(a) * b


def op_cases(args: argparse.Namespace, impls: list[str]) -> list[str]:
    import fusetune
    from fusetune.kernels.rope import rotary_tables

    dtype = torch.bfloat16
    b, s = args.batch, args.seq
    d, h, heads, hd = 4096, 14336, 32, 128
    gen = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen).requires_grad_()

    x, w = randn(b * s, d), randn(d)
    q = randn(b, s, heads, hd)
    cos, sin = rotary_tables(torch.arange(s, device="cuda")[None], hd, theta=500000.0,
                             dtype=dtype)
    ga, gb = randn(b * s, h), randn(b * s, h)
    liger: dict[str, Callable[..., torch.Tensor]] = {}
    try:
        from liger_kernel.transformers.functional import liger_rms_norm, liger_swiglu

        liger["rmsnorm"] = lambda x, w: liger_rms_norm(x, w, 1e-5)
        liger["swiglu"] = liger_swiglu
    except ImportError:
        pass
    ops: dict[str, dict[str, Callable[..., torch.Tensor] | None]] = {
        "rmsnorm": {"hf-eager": torch_rmsnorm, "compile": torch.compile(torch_rmsnorm),
                    "liger": liger.get("rmsnorm"),
                    "fusetune": lambda x, w: fusetune.rmsnorm(x, w, eps=1e-5)},
        # Liger's RoPE rotates q and k together in another layout: not comparable here
        "rope": {"hf-eager": torch_rope, "compile": torch.compile(torch_rope), "liger": None,
                 "fusetune": lambda x, c, s_: fusetune.rope(x, c, s_, interleaved=False)},
        "swiglu": {"hf-eager": torch_swiglu, "compile": torch.compile(torch_swiglu),
                   "liger": liger.get("swiglu"), "fusetune": fusetune.swiglu},
    }
    inputs = {"rmsnorm": (x, w), "rope": (q, cos, sin), "swiglu": (ga, gb)}
    lines = [f"### The ops alone, forward + backward: {b} × {s} tokens, bf16 (ms; peak MiB)",
             "| op | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for name, fns in ops.items():
        ins = inputs[name]
        leaves = [t for t in ins if t.requires_grad]
        steps = {}
        for impl in impls:
            fn = fns.get(impl)
            if fn is None:
                continue
            out = fn(*ins)
            dy = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)

            def step(fn: Callable[..., torch.Tensor] = fn, dy: torch.Tensor = dy,
                     ins: tuple[torch.Tensor, ...] = ins,
                     leaves: list[torch.Tensor] = leaves) -> None:
                for t in leaves:
                    t.grad = None
                fn(*ins).backward(dy.clone())

            step()
            steps[impl] = step
        times = interleaved_medians(steps, args.rounds)
        cells = [f"{times[i] / 1e3:.3f}; {peak_mib(steps[i]):.0f}" if i in steps else "-"
                 for i in impls]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__ or ""))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"of {', '.join(IMPLS)}")
    ap.add_argument("--tables", help="lookup table (fusetune export); default: shipped tables")
    ap.add_argument("--skip-ops", action="store_true", help="the decoder layer only")
    args = ap.parse_args()
    impls = args.impls.split(",")
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        ap.error(f"unknown --impls {', '.join(unknown)}; valid: {', '.join(IMPLS)}")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    import transformers
    import triton

    import fusetune

    if args.tables:
        fusetune.load_tables(args.tables)
    lines = [f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
             f"{triton.__version__}, transformers {transformers.__version__}"]
    if not args.skip_ops:
        lines += op_cases(args, impls)
    lines += layer_cases(args, impls)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
