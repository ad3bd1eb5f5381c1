"""The points of a file, for `fusetune search --points FILE`: every point a table holds for one
GPU (re-tune a shipped or exported table after a Triton or driver upgrade, where
`benchmarks/bench_tables.py` finds entries no faster than the default), or a list of points
written by hand:

    points:
    - {kernel: ffn, dims: {dim: 5120, hidden: 13824}, rows: 1, dtype: bfloat16}
    - {kernel: qkv, dims: {...}, batch: 8, seq: 512, dtype: float16, weights: fp8-e4m3}

`rows: R` stands for batch R, seq 1 (the lookup keys on rows: that point answers `exact` for
R rows however they are split). The points come back grouped by kernel, dims and weights, in
the file's order, so that one search serves them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from fusetune.kernels import get_spec
from fusetune.spec import DTYPES, KernelSpec, Point
from fusetune.tuner.search import SearchError

Group = tuple[KernelSpec, list[Point]]


def load_points(path: str | Path, gpu: str, kernel: str = "all", stale: bool = False
                ) -> list[Group]:
    """The points of `path` (a fusetune table: its entries for `gpu`; or a `points:` list),
    those of `kernel` only unless "all", grouped as (spec, points) by kernel, dims, weights and
    activations; with `stale`, only a table's entries the lookup no longer serves because they
    were tuned on another version of the code their config runs (their `source`; see
    `is_stale`), possibly none. SearchError naming the file, the entry and the bad value."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SearchError(f"--points {path}: cannot read it: {e}") from None
    if kernel != "all":
        try:
            kernel = get_spec(kernel).name  # "package.module:name" of one's own: its name
        except ValueError as e:
            raise SearchError(str(e)) from None
    raw = _raw_entries(doc, path, gpu)
    if stale and not (isinstance(doc, Mapping) and isinstance(doc.get("gpus"), Mapping)):
        raise SearchError(f"--points {path} --stale: a table's entries record the code they "
                          "were tuned on; a list of points does not")
    groups: dict[tuple[Any, ...], Group] = {}
    for i, (name, entry) in enumerate(raw, 1):
        where = f"--points {path}, entry {i}"
        if not isinstance(name, str):
            raise SearchError(f"{where}: no kernel name (got {name!r})")
        if kernel != "all" and name != kernel:
            continue
        try:
            spec = get_spec(name)  # ValueError naming the valid kernels
            point = _point(spec, entry)
        except (ValueError, TypeError) as e:
            raise SearchError(f"{where} ({name}): {e}") from None
        if stale and not is_stale(spec, entry):
            continue
        key = (name, point.dims, point.weights, point.activations)
        group = groups.setdefault(key, (spec, []))
        if point not in group[1]:
            group[1].append(point)
    if not groups and not stale:
        what = "points" if kernel == "all" else f"{kernel} points"
        raise SearchError(f"--points {path}: no {what} for {gpu} in it")
    return list(groups.values())


def is_stale(spec: KernelSpec, entry: Mapping[str, Any]) -> bool:
    """Whether a table entry records a source hash of other code than its config runs here
    (KernelSpec.runs_source, the lookup's test): tuned on other code, not served."""
    source, config = entry.get("source"), entry.get("config")
    if source is None or not isinstance(config, Mapping):
        return False
    return not spec.runs_source(source, config)


def _raw_entries(doc: Any, path: str | Path, gpu: str) -> list[tuple[Any, Any]]:
    """(kernel name, entry mapping) for every entry of the document."""
    if isinstance(doc, Mapping) and isinstance(doc.get("gpus"), Mapping):
        tables = doc["gpus"]
        if gpu not in tables:
            raise SearchError(f"--points {path}: a table without entries for {gpu}; it has "
                              f"{', '.join(map(str, tables)) or 'none'} (choose with --gpu)")
        kernels = tables[gpu] or {}
        if not isinstance(kernels, Mapping):
            raise SearchError(f"--points {path}: gpus.{gpu} must map kernel names to entries")
        return [(name, e) for name, entries in kernels.items() for e in entries or []]
    if isinstance(doc, Mapping) and isinstance(doc.get("points"), list):
        return [(e.get("kernel") if isinstance(e, Mapping) else None, e)
                for e in doc["points"]]
    raise SearchError(f"--points {path}: expected a fusetune table (gpus: ...) or a list of "
                      "points (points: [{kernel, dims, rows or batch and seq, dtype}, ...])")


def _point(spec: KernelSpec, entry: Any) -> Point:
    kernel = spec.name
    if not isinstance(entry, Mapping):
        raise TypeError(f"expected a mapping, got {entry!r}")
    dims = entry.get("dims")
    if not isinstance(dims, Mapping) or not spec.dims_named(dims):
        raise ValueError(f"dims {dims!r} do not match {kernel}'s {spec.dims_text}")
    problem = spec.dims_problem(dims)
    if problem is not None:
        raise ValueError(f"dims: {problem}")
    if "rows" in entry and ("batch" in entry or "seq" in entry):
        raise ValueError("give rows, or batch and seq, not both")
    batch, seq = ((entry["rows"], 1) if "rows" in entry
                  else (entry.get("batch"), entry.get("seq", 1)))
    for name, value in (("rows" if "rows" in entry else "batch", batch), ("seq", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} {value!r} must be a positive integer")
    dtype = entry.get("dtype")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    weights = entry.get("weights") or ""
    if weights:
        weights = spec.point_weights(weights, dtype)
    activations = spec.point_activations(entry.get("activations") or None, weights)
    return Point.make(kernel, spec.short_dims(dims), batch, seq, dtype, weights, activations)
