"""End to end: tokens per second of Hugging Face generate() with fusetune.patch, beside
transformers' own eager and compiled (static cache) paths and Liger Kernel, in one process.

A model of a family fusetune.patch runs is built from a config (a preset such as llama-3-8b
or phi-3-mini, or a config.json path) with random weights on the GPU: nothing is downloaded.
Every case generates the same greedy tokens' count (EOS off); tokens/s counts the new tokens
of the whole batch over the whole generate() call, time to first token is a generate() of one
new token. Before timing, the patched model's logits are compared with the model's own on
teacher-forced positions (relative error and top-1 agreement).

Cases: hf-eager, hf-static (cache_implementation="static": transformers compiles the decode
step with torch.compile and CUDA graphs), fusetune-eager, fusetune-static, fusetune-fp8 and
fusetune-fp8-static (projections in FP8 e4m3, weight-only), liger-eager (Liger Kernel's
patch of the model's family, when installed; run last, as it patches transformers' module
globally).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.script_args import add_cases_option, chosen_cases, device_usable, doc_summary

CASES = ("hf-eager", "hf-static", "fusetune-eager", "fusetune-static", "fusetune-fp8",
         "fusetune-fp8-static", "liger-eager")
NAMED = dict.fromkeys(CASES)
# Llama-3-8B's shape (Mistral-7B shares it but for the vocabulary and rope); Qwen3-8B's,
# Gemma-2-9B's, Gemma-3-12B's (its language model), Phi-3-mini's, Mixtral-8x7B's and
# Qwen3-30B-A3B's as their families' configs (build()).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, num_hidden_layers=32, vocab_size=128256,
                       rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192),
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                       num_key_value_heads=32, num_hidden_layers=32, vocab_size=32000,
                       rms_norm_eps=1e-5, max_position_embeddings=4096),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, num_hidden_layers=36,
                     vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=40960),
    "gemma-2-9b": dict(hidden_size=3584, intermediate_size=14336, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=256, num_hidden_layers=42,
                       vocab_size=256000, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
                       sliding_window=4096, max_position_embeddings=8192),
    "gemma-3-12b": dict(hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=256, num_hidden_layers=48,
                        vocab_size=262208, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
                        sliding_window=1024, max_position_embeddings=131072,
                        rope_parameters={
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                               "rope_theta": 1e6}}),
    "phi-3-mini": dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                       num_key_value_heads=32, num_hidden_layers=32, vocab_size=32064,
                       rms_norm_eps=1e-5, max_position_embeddings=4096, sliding_window=2047),
    # Mixture of experts (transformers' experts implementations: --hf-experts)
    "mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=32, vocab_size=32000,
                         rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768,
                         num_local_experts=8, num_experts_per_tok=2),
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_hidden_layers=48, vocab_size=151936, rms_norm_eps=1e-6,
                          max_position_embeddings=40960, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True),
    # A check of the script itself, e.g. on the CPU through Triton's interpreter.
    "tiny": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=2, vocab_size=128,
                 max_position_embeddings=512),
}
DEVICE = "cuda"


def build(model: str, dtype: torch.dtype, seed: int, layers: int | None) -> Any:
    """The causal LM of preset or config.json `model`, random weights on the GPU."""
    import transformers

    if model in PRESETS:
        cls = {"qwen3-8b": transformers.Qwen3Config, "gemma-2-9b": transformers.Gemma2Config,
               "gemma-3-12b": transformers.Gemma3TextConfig,
               "phi-3-mini": transformers.Phi3Config,
               "mixtral-8x7b": transformers.MixtralConfig,
               "qwen3-30b-a3b": transformers.Qwen3MoeConfig}.get(model,
                                                                 transformers.LlamaConfig)
        config = cls(**PRESETS[model])
    else:
        path = Path(model)
        config = transformers.AutoConfig.from_pretrained(path.parent if path.is_file() else path)
    if layers is not None:
        config.num_hidden_layers = layers
    config.eos_token_id = None  # random weights: generate exactly the asked number of tokens
    config.pad_token_id = 0
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(DEVICE):
            m = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    return m.eval()


def decode_bytes(model: Any) -> tuple[int, str]:
    """The weight bytes one decode step at batch 1 reads, and what they are: every weight once
    (the embedding table only a row, unless the LM head is the same matrix), a
    mixture-of-experts layer's experts only top-k of them. The step's floor: these bytes at
    3.0 TB/s, the H100's measured copy rate."""
    config = model.config
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    read = 0.0
    for name, p in model.named_parameters():  # a tied LM head is listed once, as the table
        share = 1.0
        if p is embed and (head is None or head.weight is not embed):
            share = 0.0
        elif experts and top_k and ".experts." in f".{name}":
            share = top_k / experts
        read += share * p.numel() * p.element_size()
    what = (f"16-bit weights, the experts {top_k} of {experts},"
            if experts and top_k else "16-bit weights")
    return int(read), what


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of fn() (synchronized), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def generate_kwargs(ids: torch.Tensor, new: int, static: bool) -> dict[str, Any]:
    """generate()'s arguments for exactly `new` greedy tokens after the prompts `ids`, with the
    static (compiled) cache where `static`."""
    kw: dict[str, Any] = dict(do_sample=False, min_new_tokens=new, max_new_tokens=new,
                              attention_mask=torch.ones_like(ids))
    if static:
        kw["cache_implementation"] = "static"
    return kw


def run_case(model: Any, ids: torch.Tensor, new: int, static: bool, repeat: int,
             ttft: bool = True) -> dict[str, float]:
    kw = generate_kwargs(ids, new, static)
    with torch.inference_mode():
        total = timed(lambda: model.generate(ids, **kw), repeat)
        first = (timed(lambda: model.generate(ids, **{**kw, "min_new_tokens": 1,
                                                        "max_new_tokens": 1}), repeat)
                 if ttft else math.nan)
    return {"tokens_per_s": ids.shape[0] * new / total, "ttft_ms": 1e3 * first,
            "total_s": total}


def kernel_us(prof: Any) -> float:
    """GPU time (µs) of the kernels and copies a torch.profiler run saw: the device's own
    events only (a torch op's row repeats the time of the kernels it launched, and a compiled
    graph's call that of its whole replay)."""
    from torch.autograd import DeviceType

    return sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()
               if e.device_type == DeviceType.CUDA)


def profile(model: Any, ids: torch.Tensor, static: bool, case: str) -> None:
    """Where a generate() of 8 new tokens spends its time: the GPU time of its kernels, largest
    first, their sum beside the wall time (a decode step whose GPU is idle part of the time is
    bound by the CPU, or waits for generate()'s own work between steps), the same per decode
    step (a generate() of one new token, the prefill alone, subtracted; with the static cache
    that one more length compiles once more), and the CPU time by Python function (cProfile,
    cumulative)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def run(new: int) -> tuple[float, float, Any]:
        kw = generate_kwargs(ids, new, static)
        model.generate(ids, **kw)  # compiled, cached, warm
        sync()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        sync()
        wall = time.perf_counter() - t0
        with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            model.generate(ids, **kw)
            sync()
        return wall, kernel_us(prof), prof

    with torch.inference_mode():
        wall1, gpu1, _ = run(1)
        wall, gpu_us, prof = run(8)
    step_wall, step_gpu = (wall - wall1) / 7, (gpu_us - gpu1) / 7
    print(f"-- {case}: generate() of 8 new tokens: {1e3 * wall:.1f} ms wall, kernels "
          f"{gpu_us / 1e3:.1f} ms of GPU time ({100 * gpu_us / 1e6 / wall:.0f}% busy); a decode "
          f"step (those of 8 tokens less the prefill's): {1e3 * step_wall:.2f} ms wall, kernels "
          f"{step_gpu / 1e3:.2f} ms ({100 * step_gpu / 1e6 / step_wall:.0f}% busy)")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14,
                                    max_name_column_width=60))
    pr = cProfile.Profile()
    with torch.inference_mode():
        pr.enable()
        model.generate(ids, **generate_kwargs(ids, 8, static))
        sync()
        pr.disable()
    print(f"-- {case}: CPU time by function over the same generate() (cProfile, which adds "
          "its own cost to every call)")
    pstats.Stats(pr, stream=sys.stdout).sort_stats("cumulative").print_stats(30)


def agreement(model: Any, ids: torch.Tensor, want: torch.Tensor, exact: torch.Tensor | None
              ) -> dict[str, float]:
    """Relative error of the logits against `want` (the unpatched model's) and the share of
    positions whose top-1 token is the same; the same against `exact` (the model's own logits
    computed in float32), where given: the bound the model's own 16-bit arithmetic sets."""
    with torch.inference_mode():
        got = model(ids).logits.float()
    out = {}
    for name, ref in (("", want), ("_fp32", exact)):
        if ref is not None:
            out[f"logits_rel_err{name}"] = float((got - ref).norm() / ref.norm())
            out[f"top1_agree{name}"] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__ or ""))
    ap.add_argument("--model", default="llama-3-8b",
                    help=f"a preset ({', '.join(PRESETS)}) or an HF config.json / model dir")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    ap.add_argument("--prompt", default="128", help="prompt lengths, comma-separated")
    ap.add_argument("--new", type=int, default=128, help="new tokens per sequence")
    ap.add_argument("--repeat", type=int, default=3, help="timed generate() calls per case")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: the config's; fewer for a quick check)")
    ap.add_argument("--check-positions", type=int, default=256,
                    help="teacher-forced positions compared with the model's own logits")
    ap.add_argument("--tables", help="lookup table to load (default: the shipped tables)")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--static-ttft", action="store_true",
                    help="time to first token of the static-cache cases too (a generate() of "
                         "one token has a cache of another length: one more compilation each)")
    ap.add_argument("--exact", action="store_true",
                    help="also compare every case's logits with the model's own in float32 "
                         "(the model is upcast for that once: twice its memory)")
    ap.add_argument("--profile", action="store_true",
                    help="after each case, the GPU time of its kernels over a generate() of 8 "
                         "new tokens (torch.profiler), largest first, and per decode step: where a "
                         "decode step goes")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a check of the flow through Triton's interpreter "
                         "(TRITON_INTERPRET=1; timings meaningless)")
    ap.add_argument("--hf-experts", default="",
                    help="mixture-of-experts models: transformers' experts implementations to "
                         "run hf-eager and hf-static with, comma-separated (eager or a name the "
                         "installed release registers: batched_mm, grouped_mm, and deepgemm "
                         "and sonicmoe where their hub kernels load; each case once per name, "
                         "e.g. hf-eager[grouped_mm]); default: the model's own")
    add_cases_option(ap, NAMED, CASES)
    args = ap.parse_args()
    cases = chosen_cases(ap, args.cases, NAMED, CASES)
    global DEVICE
    DEVICE = args.device
    if not device_usable(DEVICE):
        return 1
    import transformers

    import fusetune

    if args.tables:
        fusetune.load_tables(args.tables)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batch.split(",")]
    prompts = [int(p) for p in args.prompt.split(",")]
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    model = build(args.model, dtype, 0, args.layers)
    read, what = decode_bytes(model)
    floor = f"{what} {read / 1e9:.1f} GB: at most {3.0e12 / read:.0f} tokens/s at batch 1"
    vocab = model.config.vocab_size
    check_ids = torch.randint(0, vocab, (1, args.check_positions), device=DEVICE, generator=gen)
    with torch.inference_mode():
        want = model(check_ids).logits.float()
        exact = None
        if args.exact:
            # The parameters only (16-bit -> float32 -> 16-bit is exact), not the buffers: the
            # rotary embedding's inverse frequencies are float32 already, and rounded to 16
            # bits they would move every angle.
            params = list(model.parameters())
            for p in params:
                p.data = p.data.float()
            exact = model(check_ids).logits.float()
            for p in params:
                p.data = p.data.to(dtype)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    inputs = {(b, p): torch.randint(1, vocab, (b, p), device=DEVICE, generator=gen)
              for b in batches for p in prompts}
    rows: list[dict[str, Any]] = []

    def measure(case: str, static: bool, check: bool) -> None:
        quality = agreement(model, check_ids, want, exact) if check or exact is not None else {}
        fits = True
        for (b, p), ids in inputs.items():
            try:
                r = run_case(model, ids, args.new, static, args.repeat,
                             ttft=not static or args.static_ttft)
            except torch.OutOfMemoryError as e:
                # One way of running the model that does not fit (transformers' batched_mm
                # experts gather a weight copy per token) is a result, not the end of the run.
                gc.collect()
                torch.cuda.empty_cache()
                need = str(e).split(". ")[0]
                print(f"{case:20s} b={b} p={p}: out of GPU memory ({need})", flush=True)
                rows.append({"case": case, "batch": b, "prompt": p, "tokens_per_s": math.nan,
                             "ttft_ms": math.nan, "total_s": math.nan,
                             "error": "out of GPU memory"})
                fits = False
                continue
            rows.append({"case": case, "batch": b, "prompt": p, **r, **quality})
            print(f"{case:20s} b={b} p={p}: {r['tokens_per_s']:.1f} tokens/s, ttft "
                  f"{r['ttft_ms']:.1f} ms" + "".join(
                      f", logits err{k.removeprefix('logits_rel_err')} {v:.2e}"
                      if k.startswith("logits") else f", top-1{k.removeprefix('top1_agree')} "
                      f"{100 * v:.1f}%" for k, v in quality.items()), flush=True)
        if args.profile and DEVICE == "cuda" and fits:
            profile(model, next(iter(inputs.values())), static, case)

    experts = [name for name in args.hf_experts.split(",") if name] or [None]

    def hf(case: str, static: bool) -> None:
        for name in experts:
            if name is not None:
                model.set_experts_implementation(name)
            measure(case if name is None else f"{case}[{name}]", static, False)

    if "hf-eager" in cases:
        hf("hf-eager", False)
    if {"fusetune-eager", "fusetune-static"} & set(cases):
        fusetune.patch(model)
        if "fusetune-eager" in cases:
            measure("fusetune-eager", False, True)
        if "fusetune-static" in cases:
            measure("fusetune-static", True, "fusetune-eager" not in cases)
        fusetune.unpatch(model)
    if "hf-static" in cases:
        hf("hf-static", True)
    if {"fusetune-fp8", "fusetune-fp8-static"} & set(cases):
        fusetune.patch(model, weights="fp8-e4m3")  # the 16-bit weights are gone after this
        if "fusetune-fp8" in cases:
            measure("fusetune-fp8", False, True)
        if "fusetune-fp8-static" in cases:
            measure("fusetune-fp8-static", True, "fusetune-fp8" not in cases)
    if "liger-eager" in cases:
        model_type, apply = model.config.model_type, None
        try:
            from liger_kernel import transformers as liger
        except ImportError:
            print("liger-eager skipped: liger_kernel is not installed")
        else:
            apply = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
            if apply is None:
                print(f"liger-eager skipped: Liger Kernel has no patch for {model_type!r}")
        if apply is not None:
            del model
            gc.collect()
            torch.cuda.empty_cache()
            model = build(args.model, dtype, 0, args.layers)  # the same weights, 16-bit again
            apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                  fused_linear_cross_entropy=False, model=model)
            measure("liger-eager", False, True)

    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (interpreter)"
    print(f"\n{where}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {args.model} ({args.layers or 'all'} layers) "
          f"{args.dtype}, {args.new} new tokens, greedy; {floor}")
    print("| case | batch | prompt | tokens/s | time to first token ms | logits rel. err vs "
          "unpatched | top-1 agree | logits rel. err vs float32 | top-1 agree |")
    print("|---|---|---|---|---|---|---|---|---|")

    def q(r: dict[str, Any], name: str) -> str:
        key = f"logits_rel_err{name}"
        return (f"{r[key]:.2e} | {100 * r[f'top1_agree{name}']:.1f}%" if key in r
                else "- | -")

    for r in rows:
        speed = r.get("error") or f"{r['tokens_per_s']:.1f}"
        print(f"| {r['case']} | {r['batch']} | {r['prompt']} | {speed} | "
              f"{r['ttft_ms']:.1f} | {q(r, '')} | {q(r, '_fp32')} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
