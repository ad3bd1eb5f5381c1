"""Lookup tables by kernel name: load and check YAML tables, find the config for (GPU, kernel,
shape, dtype), the entries a search starts from.

The API for applications (fusetune.load_tables, fusetune.lookup), the tuner and `fusetune
export`. The work is done by `fusetune.runtime`, which the launchers call with their own spec;
this module names kernels, and hands the runtime the specs of every kernel in the registry, so
that a table read here is checked whole as it loads.

This is the runtime path: it never imports optuna or sqlalchemy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusetune import runtime
from fusetune.runtime import (
    ENV_VAR,
    SCHEMA_VERSION,
    FusetuneWarning,
    TableError,
    Tables,
    TunedEntry,
    canonical_gpu,
    gpu_for_device,
    reset,
)

if TYPE_CHECKING:
    from fusetune.spec import Config, KernelSpec

__all__ = ["ENV_VAR", "SCHEMA_VERSION", "FusetuneWarning", "TableError", "Tables", "TunedEntry",
           "canonical_gpu", "gpu_for_device", "load_tables", "lookup", "parse_tables",
           "read_tables", "reset", "tuned_entries"]


def _registry() -> Mapping[str, KernelSpec]:
    # Imported on first use, not with this module: the kernels load Triton, which must not load
    # before the CLI has chosen its backend (TRITON_INTERPRET).
    from fusetune.kernels import REGISTRY

    return REGISTRY


def _spec(kernel: str) -> KernelSpec:
    from fusetune.kernels import get_spec

    return get_spec(kernel)


def parse_tables(text: str, source: str) -> Tables:
    """Checks the YAML text of a table file against every kernel's spec; TableError names the
    bad entry."""
    return runtime.parse_tables(text, source, _registry())


def read_tables(path: str | Path) -> Tables:
    """The table file at `path`, checked as parse_tables checks it."""
    return runtime.read_tables(path, _registry())


def load_tables(*paths: str | Path) -> Tables:
    """Uses these table files (checked) before the shipped tables, replacing earlier ones."""
    return runtime.load_tables(*paths, specs=_registry())


def lookup(kernel: str, dims: Mapping[str, int], dtype: str, *, rows: int, weights: str = "",
           activations: str = "", gpu: str | None = None, device: Any = None) -> Config:
    """The config a kernel launches with for this GPU and shape (a copy), with weights
    `weights` ("" for the activations' dtype, "fp8-e4m3", "fp8-e5m2") and activation mode
    `activations` ("" or "fp8": FP8 activations beside FP8 weights).

    `gpu` names a catalogue GPU ("h100", "3090", "interpreter"); by default the GPU of
    `device` (or the current CUDA device; the interpreter when there is none).
    """
    return runtime.lookup(_spec(kernel), dims, dtype, rows=rows, weights=weights,
                          activations=activations, gpu=gpu, device=device)


def resolve(kernel: str, dims: Mapping[str, int], dtype: str, *, rows: int, weights: str = "",
            activations: str = "", gpu: str | None = None, device: Any = None,
            warn: bool = True) -> runtime.Resolution:
    """`lookup`'s answer with where it comes from: a Resolution (config; source "exact",
    "rows", "nearby" or "default"; the table entry's rows and dims; its recorded speedup over
    the default heuristic; `marginal` where that entry's winner was no better than the default,
    whose config then answers). `warn`: the one-time warning where nothing tuned answers."""
    return runtime.resolve(_spec(kernel), dims, dtype, rows=rows, weights=weights,
                           activations=activations, gpu=gpu, device=device, warn=warn)


def tuned_entries(gpu: str, kernel: str, weights: str = "",
                  activations: str = "") -> list[TunedEntry]:
    """Every entry the lookup could use for `kernel` with `weights` and `activations` on `gpu`
    (any dims, dtype and row count): the loaded tables' first, then the shipped ones'. A
    search starts from the nearest of them (fusetune.tuner.seeds)."""
    return runtime.tuned_entries(_spec(kernel), gpu, weights, activations)
