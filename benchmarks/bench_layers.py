"""Per decoder layer, how far a 16-bit model's hidden states lie from the same model in float32:
transformers' own 16-bit forward beside `fusetune.patch`'s, in one process.

A model of a family fusetune.patch runs is built as bench_generate builds it (a preset or a
config.json, random weights; nothing is downloaded) in the chosen 16-bit dtype. The reference
is the same weights in float32 (the parameters converted exactly; the buffers, such as the
rotary embedding's float32 inverse frequencies, left as they are), run by the model's own code.
For prompts of random tokens every layer's output (`output_hidden_states`) of the 16-bit model
unpatched and patched is compared with the reference's: ‖h − h_fp32‖ / ‖h_fp32‖, and their
ratio. The exit status is 1 where a layer of the patched model lies further from float32 than
the unpatched one by more than --slack. On the CPU the comparison checks the script only:
Triton's interpreter rounds float32 to bfloat16 toward zero, the GPU to nearest.

    python -m benchmarks.bench_layers --model llama-3-8b
    TRITON_INTERPRET=1 python -m benchmarks.bench_layers --device cpu --model tiny
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys

import torch

from benchmarks import bench_generate
from benchmarks.script_args import device_usable, doc_summary


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def hidden_states(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """The embeddings' output and every decoder layer's (the last after the final norm), as
    float32 tensors on the host."""
    with torch.inference_mode():
        out = model(input_ids=ids, output_hidden_states=True)
    return [h.float().cpu() for h in out.hidden_states]


def main() -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__ or ""))
    ap.add_argument("--model", default="llama-3-8b",
                    help=f"a preset ({', '.join(bench_generate.PRESETS)}) or an HF config.json "
                         "/ model dir")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--layers", type=int, default=None, help="the first N decoder layers only")
    ap.add_argument("--slack", type=float, default=1.05,
                    help="how much further from float32 a patched layer may lie than the "
                         "unpatched one (ratio) before the exit status says so")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the kernels through Triton's interpreter (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if not device_usable(args.device):
        return 1
    import transformers

    import fusetune

    bench_generate.DEVICE = args.device
    dtype = getattr(torch, args.dtype)
    model = bench_generate.build(args.model, dtype, 0, args.layers)
    gen = torch.Generator(device=args.device).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens),
                        device=args.device, generator=gen)

    reference = copy.deepcopy(model)
    for p in reference.parameters():  # exact: 16-bit values widened
        p.data = p.data.float()
    exact = hidden_states(reference, ids)
    del reference
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    own = hidden_states(model, ids)
    fusetune.patch(model)
    patched = hidden_states(model, ids)

    rows, worst = [], 0.0
    for i, (h_own, h_ft, h_ref) in enumerate(zip(own, patched, exact, strict=True)):
        e_own, e_ft = rel_err(h_own, h_ref), rel_err(h_ft, h_ref)
        ratio = e_ft / e_own if e_own > 0 else (1.0 if e_ft == 0 else float("inf"))
        if i > 0:  # the embeddings' output is the same lookup in both
            worst = max(worst, ratio)
        what = "embeddings" if i == 0 else (f"layer {i - 1}, final norm" if i == len(own) - 1
                                            else f"layer {i - 1}")
        rows.append(f"| {what} | {e_own:.3e} | {e_ft:.3e} | {ratio:.3f} |")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (interpreter)"
    print(f"{where}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.model} ({type(model).__name__}, {len(own) - 1} layers), {args.dtype}, "
          f"{args.batch}×{args.tokens} tokens; ‖h − h_fp32‖ / ‖h_fp32‖ per layer output\n")
    print(f"| output | transformers {args.dtype} | fusetune.patch | fusetune / transformers |")
    print("|---|---:|---:|---:|")
    print("\n".join(rows))
    print(f"\nLargest ratio over the layers: {worst:.3f} (slack {args.slack})")
    return 0 if worst <= args.slack else 1


if __name__ == "__main__":
    sys.exit(main())
