"""Where the configs of a patched model come from (`fusetune coverage`): for every point the
model launches through fusetune.patch (its inference path, or with `--training` its training
path), the lookup's answer on one GPU (exact, rows, nearby or
default; marginal where the entry's tuning found nothing better than the default heuristic,
whose config then runs) and the speedup its table entry recorded over the default."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fusetune.models import ModelPreset, launched_dims


@dataclass(frozen=True)
class CoverageRow:
    kernel: str
    use: str
    dims: dict[str, int]
    rows: int
    dtype: str
    weights: str
    activations: str
    source: str  # exact, rows, nearby, default
    # tuned_rows, tuned_dims: the entry that answered; marginal: it was no better than the
    # default heuristic, whose config runs (source still exact or rows: the point is tuned)
    tuned_rows: int | None
    tuned_dims: dict[str, int] | None
    speedup: float | None
    marginal: bool
    unfused: bool = False  # the config runs the unfused form (UNFUSED = 1, kernels/_unfused.py)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def coverage(model: ModelPreset, gpu: str, dtype: str, weights: str, activations: str,
             rows: Sequence[int], training: bool = False) -> list[CoverageRow]:
    """The lookup's answer for every kernel, use and row count of `model` on `gpu` (no warning
    for a missing entry: this is the report of them). `weights` and `activations` as Point's
    (the norm has no weights). `training`: the kernels of fusetune.patch's training path
    (models.launched_dims) instead of its inference path."""
    from fusetune.kernels import get_spec
    from fusetune.tables import resolve

    out = []
    for kernel, uses in launched_dims(model, training).items():
        spec = get_spec(kernel)
        w, a = (weights, activations) if spec.weight_formats else ("", "")
        for use, dims in uses:
            for r in rows:
                res = resolve(kernel, dims, dtype, rows=r, weights=w, activations=a, gpu=gpu,
                              warn=False)
                out.append(CoverageRow(kernel, use, dims, r, dtype, w, a, res.source, res.rows,
                                       None if res.dims is None else dict(res.dims),
                                       res.speedup, res.marginal,
                                       bool(res.config.get("UNFUSED"))))
    return out
