"""A search on the GPU through the isolating worker, over a space with planted bad configs: a
Triton copy kernel whose STORE=2 configs write far outside the output (an illegal memory
access that kills the CUDA context of the process that launches it). The search must reach its
end with every such config recorded as crashed, and its winner must be a correct config.

    python -m benchmarks.planted_search --db sqlite:///planted.db --trials 40
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from benchmarks.script_args import doc_summary
from fusetune.kernels._spec import Config, Cost, KernelSpec, Point, Resources, Tensors

SPACE = """
kernel: planted
params:
  BLOCK: {pow2: [256, 4096]}
  STORE: {values: [1, 2]}   # 1: in bounds; 2: 2**40 elements past the output
  num_warps: {pow2: [1, 8]}
"""


@triton.jit
def _planted_kernel(X, Y, N, FAR: tl.constexpr, BLOCK: tl.constexpr):
    # y = 2x over [N]; with FAR the store lands 2**40 elements past Y: unmapped memory.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0)
    tl.store(Y + offs.to(tl.int64) + FAR * (1 << 40), x * 2.0, mask=mask)


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    x, y = inputs["x"], outputs["y"]
    n = x.numel()
    _planted_kernel[(triton.cdiv(n, config["BLOCK"]),)](
        x, y, n, FAR=config["STORE"] - 1, BLOCK=config["BLOCK"], num_warps=config["num_warps"])


SPEC = KernelSpec(
    name="planted",
    description="y = 2x, with planted out-of-bounds stores",
    dim_names=("dim",),
    config_keys=("BLOCK", "STORE", "num_warps"),
    pow2_keys=("BLOCK", "num_warps"),
    make_inputs=lambda p, device: {"x": torch.randn(p.rows, p.dim["dim"], device=device)},
    make_outputs=lambda inputs: {"y": torch.empty_like(inputs["x"])},
    reference=lambda inputs: {"y": inputs["x"] * 2.0},
    launch=_launch,
    default_config=lambda p, gpu: {"BLOCK": 1024, "STORE": 1, "num_warps": 4},
    resources=lambda c, p: Resources(smem_bytes=0, regs_per_thread=32,
                                     threads=32 * c["num_warps"]),
    cost=lambda p: Cost(bytes=8 * p.rows * p.dim["dim"], flops=p.rows * p.dim["dim"]),
    canonical=lambda c, p: dict(c),
    dims_from_model=lambda m: {"dim": m.dim},
    source_objects=(_planted_kernel, _launch),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--db", default="sqlite:///planted.db")
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--trial-timeout", type=float, default=120.0)
    ap.add_argument("--backend", default="auto", help="auto, cuda or interpreter")
    args = ap.parse_args(argv)

    from fusetune.db.store import Store
    from fusetune.tuner.search import choose_target, open_storage
    from fusetune.tuner.space import parse_space
    from fusetune.tuner.study import Context, PointTuner, SearchOptions
    from fusetune.tuner.worker import Worker

    target = choose_target(args.backend, None, dry_run=False)
    space = parse_space(SPACE, SPEC, "planted space")
    worker = Worker("benchmarks.planted_search:SPEC", target.backend, target.device,
                    args.trial_timeout)
    ctx = Context(SPEC, space, target.gpu, target.backend, target.device, Store(args.db),
                  open_storage(args.db), triton.__version__, torch.__version__, worker)
    point = Point.make("planted", {"dim": 4096}, 1, 1024, "float32")
    try:
        res = PointTuner(ctx, point, SearchOptions(trials=args.trials, seed=0),
                         lambda done, total, msg: print(f"  {done}/{total} {msg}", flush=True)
                         ).run()
    finally:
        worker.close()
    print(f"statuses: {dict(res.statuses)}; worker restarts: {worker.restarts}")
    print(f"winner: {res.winner} at {res.time_us:.2f} µs (default {res.default_us:.2f} µs)")
    # The winner, launched here (outside the worker), must compute y = 2x.
    assert res.winner is not None and res.winner["STORE"] == 1, res.winner
    inputs = SPEC.make_inputs(point, target.device)
    outputs = SPEC.make_outputs(inputs)
    SPEC.launch(inputs, outputs, res.winner)
    if target.backend == "cuda":
        torch.cuda.synchronize()
    ok = torch.equal(outputs["y"], SPEC.reference(inputs)["y"])
    crashed = res.statuses.get("crashed", 0)
    print(f"winner output correct: {ok}; configs recorded as crashed: {crashed}")
    return 0 if ok and crashed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
