"""A whole search: the grid of points, the backend and device, one `PointTuner` per point."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fusetune import gpus
from fusetune.gpus import GpuSpec

if TYPE_CHECKING:
    import optuna

    from fusetune.spec import KernelSpec, Point

BACKEND_CHOICES = ("auto", "cuda", "interpreter")
# Small enough for Triton's CPU interpreter to get through a search in a minute or two.
INTERPRETER_GRID = {"model": "tiny", "batch": [1, 4], "seq": [1, 16], "dtype": ["float16"]}
DEFAULT_GRID = {"model": "llama-2-7b", "batch": [1, 16, 64], "seq": [1, 512],
                "dtype": ["float16", "bfloat16"]}


class SearchError(RuntimeError):
    """A search that cannot start as asked (bad flags, missing GPU); the message says why."""


@dataclass
class Target:
    """Where configs are measured: the backend, the device, and the GPU whose limits apply."""

    backend: str  # "cuda" | "interpreter"
    gpu: GpuSpec
    device: str  # "cuda:N" | "cpu"
    notes: list[str] = field(default_factory=list)
    # --devices: every device to measure on at once ("cuda:N", one worker each; `device` is the
    # first). Empty: one device, the search as without --devices.
    devices: tuple[str, ...] = ()


def choose_target(backend: str, gpu_name: str | None, dry_run: bool,
                  devices: str | None = None) -> Target:
    """Resolves --backend/--gpu/--devices into a Target. Sets TRITON_INTERPRET for the
    interpreter.

    `devices` ("all" or indices such as "0,1") selects several CUDA devices of one GPU model
    (see `gpus.select_devices`); it needs the cuda backend.

    Must run before the kernel modules are imported: Triton reads TRITON_INTERPRET when a
    kernel is defined.
    """
    if backend not in BACKEND_CHOICES:
        raise SearchError(f"unknown backend {backend!r}; valid: {', '.join(BACKEND_CHOICES)}")
    if devices is not None and not dry_run:
        if backend == "interpreter":
            raise SearchError(f"--devices {devices} selects CUDA devices, and the interpreter "
                              "backend runs configs on the CPU: leave out --devices (--isolate "
                              "runs them in a worker process)")
        return _devices_target(devices, gpu_name)
    if dry_run:  # needs no GPU: only the named GPU's limits
        if gpu_name:
            return Target("cuda", gpus.resolve(gpu_name), "none")
        visible = gpus.visible_gpus()
        if visible:
            return Target("cuda", visible[0].spec, "none")
        return Target("interpreter", gpus.INTERPRETER, "none",
                      ["no --gpu given and no GPU visible: planning with the interpreter's limits"])
    if backend == "auto":
        backend = "cuda" if gpu_name or gpus.visible_gpus() else "interpreter"
        if backend == "interpreter":
            os.environ["TRITON_INTERPRET"] = "1"
            return Target("interpreter", gpus.INTERPRETER, "cpu", [
                "no CUDA GPU is visible: searching with Triton's CPU interpreter; its timings "
                "are meaningless (use it to check the flow, not to pick configs)"])
    if backend == "interpreter":
        os.environ["TRITON_INTERPRET"] = "1"
        notes = ["interpreter backend: timings are meaningless; results are stored under the "
                 "GPU name 'interpreter'"]
        if gpu_name and gpus.resolve(gpu_name) is not gpus.INTERPRETER:
            notes.append(f"--gpu {gpu_name} is ignored: the interpreter measures the CPU")
        return Target("interpreter", gpus.INTERPRETER, "cpu", notes)
    # cuda
    if gpu_name:
        try:
            found = gpus.select_device(gpu_name)
        except (gpus.GpuNotFoundError, gpus.UnknownGpuError) as e:
            raise SearchError(str(e)) from None
    else:
        visible = gpus.visible_gpus()
        if not visible:
            raise SearchError("no CUDA GPU is visible; use --backend interpreter to run the "
                              "flow on the CPU, or --dry-run --gpu NAME to see the plan")
        found = visible[0]
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SearchError("TRITON_INTERPRET is set, so kernels would run on the CPU: unset it "
                          "to tune on the GPU, or use --backend interpreter")
    import torch

    torch.cuda.set_device(found.index)
    return Target("cuda", found.spec, f"cuda:{found.index}")


def _devices_target(devices: str, gpu_name: str | None) -> Target:
    """The cuda Target of --devices: the selected devices, all of one GPU model."""
    try:
        found = gpus.select_devices(devices, gpu_name)
    except (ValueError, gpus.GpuNotFoundError) as e:  # UnknownGpuError is a ValueError
        raise SearchError(str(e)) from None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SearchError("TRITON_INTERPRET is set, so kernels would run on the CPU: unset it "
                          "to tune on the GPU, or use --backend interpreter without --devices")
    # Nothing runs on a GPU in this process: each device's worker subprocess binds its own.
    names = tuple(f"cuda:{g.index}" for g in found)
    return Target("cuda", found[0].spec, names[0], devices=names)


def parse_dims(spec: KernelSpec, model: str | None, dim: int | None,
               dims: Mapping[str, int] | None) -> dict[str, int]:
    """The kernel's dims from --model (spec.dims_from_model), --dim (the width) or --dims
    k=v,..., an optional dim at its default left out (spec.short_dims)."""
    from fusetune.models import load_model

    given = sum(x is not None for x in (model, dim, dims))
    if given > 1:
        raise SearchError("give only one of --model, --dim, --dims")
    if model is not None:
        try:
            return spec.dims_from_model(load_model(model))
        except ValueError as e:
            raise SearchError(str(e)) from None
    if dim is not None:
        if tuple(spec.dim_names) != ("dim",):
            raise SearchError(f"--dim sets only 'dim'; this kernel needs "
                              f"{', '.join(spec.dim_names)}: use --dims or --model")
        out = {"dim": dim}
    else:
        out = dict(dims or {})
    if not spec.dims_named(out):
        raise SearchError(f"dims {out} do not match this kernel's {spec.dims_text}")
    problem = spec.dims_problem(out)
    if problem is not None:
        raise SearchError(f"--dims: {problem}")
    return spec.short_dims(out)


@dataclass
class Request:
    """What `fusetune search` was asked for (after parsing flags)."""

    kernel: str
    dims: dict[str, int]
    batches: list[int]
    seqs: list[int]
    dtypes: list[str]
    weights: str = ""
    activations: str = ""


def make_points(req: Request) -> list[Point]:
    from fusetune.spec import DTYPES, Point

    for d in req.dtypes:
        if d not in DTYPES:
            raise SearchError(f"unknown dtype {d!r}; valid: {', '.join(DTYPES)}")
    for name, values in (("--batch", req.batches), ("--seq", req.seqs)):
        if not values or any(v < 1 for v in values):
            raise SearchError(f"{name} needs positive integers, got {values}")
    return [Point.make(req.kernel, req.dims, b, s, d, req.weights, req.activations)
            for d in req.dtypes for s in req.seqs for b in req.batches]


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's storage on the same database as fusetune's tables (`url` as for `Store`)."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    from fusetune.db.store import normalize_url, schema_lock

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    engine_url = normalize_url(url)
    kwargs = ({"connect_args": {"timeout": 60}} if engine_url.startswith("sqlite")
              else {"pool_pre_ping": True})
    for attempt in range(5):
        try:
            # PostgreSQL: one process at a time creates Optuna's tables (see schema_lock).
            with schema_lock(url):
                return optuna.storages.RDBStorage(engine_url, engine_kwargs=kwargs)
        except SQLAlchemyError:
            # SQLite: two searches creating Optuna's tables at once, one of them loses the
            # race (e.g. on alembic_version); the tables exist on the next try.
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")
