"""What holds the decode (one row) matmul kernels above the read-only ceiling: launches for a
profiler, and what the compiled kernels are made of.

For ffn, qkv and lola 4096->16384 at one token row with the shipped tables' configs (and, with
--two-pass, the same tiles after a separate norm pass, PASSES = 2), and for the read-only kernel
of benchmarks/bench_read_bw.py over the same bytes: prints each compiled kernel's registers,
spills and global loads by width (from its PTX: 16-byte vector loads or narrower), then launches
each --launches times, so that a profiler run over this script, e.g.

    ncu --clock-control none -k regex:'_(ffn|qkv|lola|read|layernorm|rmsnorm)_kernel' \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python -m benchmarks.decode_profile

(benchmarks/run_gpu_decode_profile.sh) sees the kernels in the order of the lines "check NAME
kernels=N" and "launch NAME kernels=N" printed here (benchmarks/ncu_table.py pairs them).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import triton

from benchmarks.bench_decode import CASES, shipped_case
from benchmarks.bench_read_bw import _read_kernel
from benchmarks.script_args import doc_summary
from benchmarks.timing import cuda_gpu
from fusetune.kernels._spec import WEIGHT_FORMATS
from fusetune.tuner.launches import launched_kernels

_LOAD = re.compile(r"\bld\.global(?:\.[a-zA-Z0-9_:]+)*?(?:\.(v[248]))?\.([bfsu]\d+)\b")


def load_widths(ptx: str) -> dict[str, int]:
    """Global loads in a PTX text, counted by bytes per thread and instruction ("16B": v4.b32,
    or v2.b64...), from the instruction's vector width and element type."""
    counts: Counter[str] = Counter()
    for vec, elt in _LOAD.findall(ptx):
        n = int(vec[1:]) if vec else 1
        counts[f"{n * int(elt[1:]) // 8}B"] += 1
    return dict(sorted(counts.items(), key=lambda kv: -int(kv[0][:-1])))


def describe(name: str, kernels: list[Any]) -> None:
    for k in {id(k): k for k in kernels}.values():
        print(f"  {name}: {k.name}: {k.n_regs} registers, {k.n_spills} spilled, "
              f"{k.metadata.shared} B shared, global loads by width {load_widths(k.asm['ptx'])}",
              flush=True)


def counted(what: str, name: str, fn: Callable[[], object]) -> list[Any]:
    """Runs fn, then prints "WHAT NAME kernels=N": the Triton kernels it launched, which a
    profiler over this script sees next, in this order."""
    kernels: list[Any] = []
    with launched_kernels(kernels):
        fn()
        torch.cuda.synchronize()
    print(f"{what} {name} kernels={len(kernels)}", flush=True)
    return kernels


def profile_case(kernel: str, model: str | None, dims: dict[str, int] | None, dtype: str,
                 launches: int, two_pass: bool, weights: str = "") -> None:
    spec, dims, point, shipped, ev = shipped_case(kernel, model, dims, dtype, weights)
    configs = [("shipped", shipped)]
    if two_pass:
        configs.append(("two-pass", spec.canonical(shipped | {"PASSES": 2}, point)))
    for how, config in configs:
        name = f"{kernel} {how} {'/'.join(str(v) for v in config.values())}"
        outcome: list[Any] = []
        kernels = counted("check", name, lambda c=config, o=outcome: o.append(ev.check(c)))
        print(f"  {outcome[0].status} {outcome[0].reason}", flush=True)
        describe(name, kernels)
        for _ in range(launches):
            counted("launch", name, lambda c=config: spec.launch(ev.inputs, ev.outputs, c))
    # The read-only kernel over the same bytes: 2048 elements a program, 8 warps, evict-first
    # (bench_read_bw's fastest shape at these sizes on the H100).
    n = spec.cost(point).bytes // 2
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    grid = triton.cdiv(n, 2048)
    part = torch.empty(grid, device="cuda", dtype=torch.float32)

    def read() -> None:
        _read_kernel[(grid,)](x, part, n, BLOCK=2048, STEPS=1, UNROLL=False,
                              EVICT="evict_first", num_warps=8)

    name = f"read-only {n * 2 / 1e6:.0f} MB"
    describe(name, counted("check", name, read))
    for _ in range(launches):
        counted("launch", name, read)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--weights", default="", choices=["", *WEIGHT_FORMATS],
                    help="weight format (default: the activations' dtype)")
    ap.add_argument("--launches", type=int, default=2, help="launches of each kernel")
    ap.add_argument("--two-pass", action="store_true",
                    help="also each config with PASSES = 2 (norm pass first)")
    args = ap.parse_args(argv)
    if cuda_gpu() is None:
        return 2
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}", flush=True)
    for kernel, model, dims in CASES[:3]:
        profile_case(kernel, model, dims, args.dtype, args.launches, args.two_pass,
                     args.weights)
    return 0


if __name__ == "__main__":
    sys.exit(main())
