"""Where the Python-side cost of a fusetune call goes: a diagnostic, not a kernel of fusetune.

Applications that call the kernels without CUDA graphs pay the launch path on the CPU each
call; at decode sizes and small prefills that path takes longer than the GPU's work. For each
kernel at one shape this script measures the cost of one call (no waiting for the GPU) and
the number of Triton launches in it, then profiles 2000 calls with cProfile, printing the
functions with the most time of their own.

    python -m benchmarks.host_profile [--kernels lola,ffn,qkv,rmsnorm,rope] [--top 18]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from collections.abc import Callable
from typing import Any

import torch

import fusetune
from benchmarks.timing import cuda_gpu, host_us_per_call


def cases() -> dict[str, tuple[str, Callable[[], Any]]]:
    """kernel -> (shape, a call of it), Llama-2-7B / GPT-2 sizes, fp16."""
    torch.manual_seed(0)
    h = torch.float16
    dev = "cuda"
    x1 = torch.randn(1, 4096, device=dev, dtype=h)
    g = torch.ones(4096, device=dev, dtype=h)
    w1 = torch.randn(11008, 4096, device=dev, dtype=h) / 64
    w3 = torch.randn(11008, 4096, device=dev, dtype=h) / 64
    wq = torch.randn(4096, 4096, device=dev, dtype=h) / 64
    xg = torch.randn(4096, 768, device=dev, dtype=h)
    wl = torch.randn(3072, 768, device=dev, dtype=h) / 28
    bl = torch.zeros(3072, device=dev, dtype=h)
    xr = torch.randn(1, 1, 32, 128, device=dev, dtype=h)
    return {
        "lola": ("4096 x 768 -> 3072", lambda: fusetune.lola(xg, wl, bl)),
        "ffn": ("1 x 4096 -> 11008", lambda: fusetune.ffn(x1, g, w1, w3)),
        "qkv": ("1 x 4096 -> 3 x 4096", lambda: fusetune.qkv(x1.view(1, 1, 4096), g, wq, wq,
                                                             wq, head_dim=128)),
        "rmsnorm": ("1 x 4096", lambda: fusetune.rmsnorm(x1, g)),
        "rope": ("1 x 1 x 32 x 128", lambda: fusetune.rope(xr, start_pos=7)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="lola,ffn,qkv,rmsnorm,rope")
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    if cuda_gpu() is None:
        return 2
    import triton

    from fusetune.tuner.launches import launched_kernels

    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}, Python {sys.version.split()[0]}; µs of CPU per call")
    all_cases = cases()
    for name in args.kernels.split(","):
        shape, fn = all_cases[name]
        with launched_kernels() as kernels:
            fn()
        torch.cuda.synchronize()
        us = host_us_per_call(fn)
        print(f"\n## {name} ({shape}): {us:.1f} µs per call, {len(kernels)} Triton launch(es)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
