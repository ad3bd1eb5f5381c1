"""A kernel spec whose configs misbehave on purpose, for the worker and tuner tests.

MODE 1 is right, 2 kills its process (as a segfault would), 3 hangs, 4 raises, 5 computes the
wrong result, 6 reports a lost CUDA context. It runs plain torch on the CPU (no Triton; fake_jit
adds a MODE that launches Triton kernels). With LOG_ENV set, launches are logged to that file.
SPEC_3X is a second kernel, for processes that serve several.

`fake_compiler` stands in for the compile step of the compile-ahead processes."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from fusetune.spec import Config, Cost, KernelSpec, Point, Resources, Tensors
from fusetune.tuner.space import config_key

MODES = {1: "ok", 2: "crash", 3: "hang", 4: "raise", 5: "wrong", 6: "device lost"}
LOG_ENV = "FUSETUNE_TEST_LOG"  # a file the fakes append lines to, in any process


def log(line: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{line} pid={os.getpid()} t={time.monotonic():.6f}\n")


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    log(f"run {config_key(config)}")
    mode = config["MODE"]
    if mode == 2:
        os._exit(139)  # what a segfault looks like from the parent
    if mode == 3:
        time.sleep(3600)
    if mode == 4:
        raise RuntimeError("planted runtime error")
    if mode == 6:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    outputs["y"].copy_(inputs["x"] * (3.0 if mode == 5 else 2.0))


SPEC = KernelSpec(
    name="fake",
    description="misbehaving configs for tests",
    dim_names=("dim",),
    config_keys=("MODE", "num_warps"),
    pow2_keys=("num_warps",),
    make_inputs=lambda p, device: {"x": torch.randn(p.rows, p.dim["dim"], device=device)},
    make_outputs=lambda inputs: {"y": torch.empty_like(inputs["x"])},
    reference=lambda inputs: {"y": inputs["x"] * 2.0},
    launch=_launch,
    default_config=lambda p, gpu: {"MODE": 1, "num_warps": 4},
    resources=lambda c, p: Resources(smem_bytes=0, regs_per_thread=32,
                                     threads=32 * c["num_warps"]),
    cost=lambda p: Cost(bytes=8 * p.rows * p.dim["dim"], flops=p.rows * p.dim["dim"]),
    canonical=lambda c, p: dict(c),
    dims_from_model=lambda m: {"dim": m.dim},
)


# Another kernel for processes that serve several: its reference is 3x, so MODE 5 is its right
# config and MODE 1 computes the wrong result.
SPEC_3X = dataclasses.replace(SPEC, name="fake3x",
                              reference=lambda inputs: {"y": inputs["x"] * 3.0})


def nap() -> None:
    """A child process's whole work (this module's imports, torch's among them, come first)."""
    time.sleep(0.5)


def point() -> Point:
    return Point.make("fake", {"dim": 16}, 1, 4, "float32")


def point_3x() -> Point:
    return Point.make("fake3x", {"dim": 32}, 2, 1, "float32")


def fake_compiler(spec: KernelSpec, point: Point, device: str) -> Any:
    """A compile step for CompileAhead: logs its start and end; the config's MODE decides what
    it does (2 kills the process, 3 hangs, 4 raises, others take SLEEP_MS milliseconds)."""
    log(f"spec {spec.name}")
    log(f"inputs {point.label}")

    def compile_config(config: Config) -> None:
        key = config_key(config)
        log(f"start {key}")
        mode = config["MODE"]
        if mode == 2:
            os._exit(139)
        if mode == 3:
            time.sleep(3600)
        if mode == 4:
            raise RuntimeError("planted compile error")
        time.sleep(config.get("SLEEP_MS", 0) / 1000)
        log(f"end {key}")

    return compile_config
