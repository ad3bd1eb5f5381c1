"""Do the one-row GEMV kernels stream faster with fewer registers a thread? A diagnostic.

The decode winners run at 18-25% occupancy (120-168 registers a thread: the float32
accumulators and the loaded tiles of whole weight rows; Nsight Compute, BENCHMARKS.md), where
the read-only kernel of the same bytes runs at 88%. Triton's `maxnreg` launch option caps the
registers a thread (ptxas then keeps fewer values live, or spills), so more programs fit on an
SM. Here the shipped M = 1 configs of ffn and qkv (16-bit and e4m3 weights, Llama-2-7B dims)
are launched with caps of none, 128, 96, 80 and 64 registers, each checked against the
reference first, timed as CUDA-graph replays (do_bench medians, L2 flushed, median of
interleaved rounds), beside the read-only kernel of the same bytes.

    python -m benchmarks.gemv_maxnreg [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import triton

from benchmarks.bench_decode import READ_SHAPES
from benchmarks.bench_read_bw import read_us
from benchmarks.script_args import doc_summary
from benchmarks.timing import as_graph, cuda_gpu, interleaved_medians
from fusetune import models
from fusetune.kernels import ffn as ffn_mod
from fusetune.kernels import get_spec
from fusetune.kernels import qkv as qkv_mod
from fusetune.kernels._spec import Point
from fusetune.tables import lookup
from fusetune.tuner.bench import Evaluator

CAPS = (None, 128, 96, 80, 64)
KERNELS: dict[str, tuple[ModuleType, str]] = {"ffn": (ffn_mod, "_ffn_kernel"),
                                              "qkv": (qkv_mod, "_qkv_kernel")}


class Capped:
    """Stands in for a module's @triton.jit kernel: launches it with `maxnreg` added."""

    def __init__(self, kernel: Any, cap: int | None) -> None:
        self.kernel, self.cap = kernel, cap

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]
        if self.cap is None:
            return launch
        return lambda *args, **kw: launch(*args, **kw, maxnreg=self.cap)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if cuda_gpu() is None:
        return 2
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; M = 1, Llama-2-7B, shipped configs; µs of CUDA-graph replays "
          f"(do_bench medians, L2 flushed, median of {args.rounds} rounds)\n")
    print("| kernel | weights | " + " | ".join(f"maxnreg {c or 'none'}" for c in CAPS)
          + " | read-only |")
    print("|---|---|" + "---:|" * (len(CAPS) + 1))
    llama = models.preset("llama-2-7b")
    for name, weights in (("ffn", ""), ("qkv", ""), ("ffn", "fp8-e4m3"), ("qkv", "fp8-e4m3")):
        module, attr = KERNELS[name]
        original = getattr(module, attr)
        spec = get_spec(name)
        dims = spec.dims_from_model(llama)
        point = Point.make(name, dims, 1, 1, "float16", weights)
        config = spec.canonical(lookup(name, dims, "float16", rows=1, weights=weights), point)
        ev = Evaluator(spec, point, "cuda", "cuda")
        fns: dict[int | None, Callable[[], object] | None] = {}
        for cap in CAPS:
            setattr(module, attr, Capped(original, cap))
            try:
                check = ev.check(config)
                if not check.ok:
                    print(f"{name} {weights} maxnreg {cap}: {check.status} {check.reason}",
                          file=sys.stderr)
                    fns[cap] = None
                    continue
                print(f"{name} {weights or 'fp16'} maxnreg {cap}: {check.n_regs} registers, "
                      f"{check.n_spills} spilled, rel. error {check.rel_err:.2e}",
                      file=sys.stderr)
                fns[cap] = as_graph(lambda ev=ev, spec=spec, config=config:
                                    spec.launch(ev.inputs, ev.outputs, config))
            finally:
                setattr(module, attr, original)
        times = interleaved_medians(fns, args.rounds)
        nbytes = spec.cost(point).bytes
        x = torch.empty(nbytes // 2, device="cuda", dtype=torch.float16).normal_()
        read = min(read_us(x, *s) for s in READ_SHAPES)
        cells = [f"{t:.1f}" if t is not None else "-" for t in times.values()]
        print(f"| {name} | {weights or 'fp16'} | " + " | ".join(cells) + f" | {read:.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
