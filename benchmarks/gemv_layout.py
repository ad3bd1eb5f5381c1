"""Does the layout of the weight rows a one-row GEMV program reads decide its speed at decode?

At the same tile (BLOCK_N output rows or pairs a program, whole 4096-wide rows, UNROLL_K 1), ffn
reads 180 MB at 0.37 µs/MB and qkv 101 MB at 0.49 µs/MB (BENCHMARKS.md). The programs differ in
which rows they read: ffn two rows of W1 and the same two of W3 (two tensors), qkv with
interleaved pairs rows 2p, 2p+1 of one matrix (adjacent), with half-split pairs rows i and
i + head_dim/2 (half a head apart). Timed here side by side as CUDA-graph replays at M = 1,
Llama-2-7B dims, each checked against its reference first:

- ffn as shipped, and with W1 and W3 the two halves of one [2N, K] tensor;
- qkv with interleaved and with half-split pairs, at the same tiles.

    python -m benchmarks.gemv_layout
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import triton

from benchmarks.timing import as_graph, cuda_gpu, interleaved_medians
from fusetune import models
from fusetune.kernels import get_spec
from fusetune.kernels._spec import Config, Point
from fusetune.tuner.bench import Evaluator

TILES = [  # (BLOCK_N, BLOCK_K, UNROLL_K, num_warps)
    (2, 2048, 1, 8), (1, 2048, 1, 4), (4, 256, 1, 2), (16, 256, 1, 4), (8, 512, 0, 4)]


def gemv(bn: int, bk: int, unroll: int, warps: int) -> Config:
    return {"BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "PASSES": 1, "SPLIT_K": 1,
            "ACT_FP8": 0, "UNROLL_K": unroll, "TMA": 0, "num_warps": warps, "num_stages": 1}


def case(kernel: str, dims: dict[str, int], one_tensor: bool = False
         ) -> tuple[Evaluator, Callable[[Config], Callable[[], None]], int]:
    spec = get_spec(kernel)
    point = Point.make(kernel, dims, 1, 1, "float16")
    ev = Evaluator(spec, point, "cuda", "cuda")
    if one_tensor:  # W1 and W3 as the two halves of one allocation
        w13 = torch.cat([ev.inputs["w1"], ev.inputs["w3"]])
        n = ev.inputs["w1"].shape[0]
        ev.inputs["w1"], ev.inputs["w3"] = w13[:n], w13[n:]

    def launcher(config: Config) -> Callable[[], None]:
        return lambda: spec.launch(ev.inputs, ev.outputs, config)

    return ev, launcher, spec.cost(point).bytes


def main() -> int:
    if cuda_gpu() is None:
        return 2
    llama = models.preset("llama-2-7b")
    ffn_dims = get_spec("ffn").dims_from_model(llama)
    qkv_dims = get_spec("qkv").dims_from_model(llama)
    cases = {
        "ffn (W1, W3 two tensors)": case("ffn", ffn_dims),
        "ffn (W1, W3 halves of one)": case("ffn", ffn_dims, one_tensor=True),
        "qkv interleaved (rows 2p, 2p+1)": case("qkv", qkv_dims | {"interleaved": 1}),
        "qkv half-split (rows i, i+64)": case("qkv", qkv_dims | {"interleaved": 0}),
    }
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; M = 1, CUDA-graph replays, do_bench medians (L2 flushed), "
          "median of 3 interleaved rounds; µs and µs per MB\n")
    print("| tile (rows or pairs × K-step, unroll, warps) | " + " | ".join(cases) + " |")
    print("|---|" + "---:|" * len(cases))
    for tile in TILES:
        config = gemv(*tile)
        fns = {}
        for name, (ev, launcher, _) in cases.items():
            out = ev.check(config)
            fns[name] = as_graph(launcher(config)) if out.ok else None
            if not out.ok:
                print(f"{name} {tile}: {out.status} {out.reason}", file=sys.stderr)
        times = interleaved_medians(fns, 3)
        cells = []
        for name, (_, _, nbytes) in cases.items():
            t = times[name]
            cells.append(f"{t:.1f} ({t / (nbytes / 1e6):.3f})" if t is not None else "-")
        print(f"| {tile[0]} × {tile[1]}, U{tile[2]}, {tile[3]}w | " + " | ".join(cells) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
