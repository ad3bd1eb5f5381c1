"""Where the Python-side cost of a fusetune call goes: a diagnostic, not a kernel of fusetune.

Applications that call the kernels without CUDA graphs pay the launch path on the CPU each
call; at decode sizes and small prefills that path takes longer than the GPU's work. For each
kernel at one shape this script measures the cost of one call (no waiting for the GPU) and
the number of Triton launches in it, then profiles 2000 calls with cProfile, printing the
functions with the most time of their own.

With `--stub` (no GPU needed) the tensors are on the CPU and every Triton kernel of fusetune
is replaced by a launch that does nothing: what is left is fusetune's own Python per call
(checks, lookup, views, allocations; the CPU path, so no TMA descriptors), comparable
between versions of fusetune on one machine.

    python -m benchmarks.host_profile [--kernels lola,ffn,qkv,rmsnorm,rope] [--top 18] [--stub]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

import fusetune
from benchmarks.script_args import doc_summary
from benchmarks.timing import cuda_gpu, host_us_per_call


def cases(dev: str = "cuda") -> dict[str, tuple[str, Callable[[], Any]]]:
    """kernel -> (shape, a call of it), Llama-2-7B / GPT-2 sizes, fp16."""
    torch.manual_seed(0)
    h = torch.float16
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


class _NoLaunch:
    """A kernel whose launches do nothing (--stub)."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def stub_kernels() -> int:
    """Replaces every Triton kernel object in fusetune's kernel modules by _NoLaunch; returns
    how many. For this diagnostic's process only: the kernels cannot run afterwards."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface

    import fusetune.kernels

    n = 0
    for info in pkgutil.iter_modules(fusetune.kernels.__path__):
        mod = importlib.import_module(f"fusetune.kernels.{info.name}")
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, KernelInterface):
                setattr(mod, name, _NoLaunch())
                n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--kernels", default="lola,ffn,qkv,rmsnorm,rope")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--stub", action="store_true",
                    help="CPU tensors, Triton launches replaced by no-ops (no GPU needed)")
    args = ap.parse_args()
    import triton

    from fusetune.tuner.launches import launched_kernels

    if args.stub:
        os.environ["TRITON_INTERPRET"] = "1"  # fusetune accepts CPU tensors under it
        warnings.simplefilter("ignore", fusetune.FusetuneWarning)  # default configs on the CPU
        print(f"CPU, launches stubbed ({stub_kernels()} kernel objects), torch "
              f"{torch.__version__}, Triton {triton.__version__}, Python "
              f"{sys.version.split()[0]}, fusetune from {fusetune.__file__}; µs of CPU per call")
    else:
        if cuda_gpu() is None:
            return 2
        print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
              f"{triton.__version__}, Python {sys.version.split()[0]}; µs of CPU per call")
    all_cases = cases("cpu" if args.stub else "cuda")
    for name in args.kernels.split(","):
        shape, fn = all_cases[name]
        if args.stub:
            print(f"\n## {name} ({shape}): {host_us_per_call(fn):.1f} µs per call")
            continue
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
