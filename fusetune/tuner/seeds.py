"""The configs a study starts from: the default heuristic and the winners of neighbouring points.

A point's neighbours are the other tuned points of its GPU, kernel, backend and activation
mode with weights of the same width (the same format, or for FP8 weights the other FP8
format): the winners stored
in the database and the entries of the lookup tables (the loaded ones and those shipped with
fusetune) for that GPU. The nearest come first, by `point_distance` (row count, then dims:
another model's shapes, then dtype) plus `weights_distance`. Their winners are only first guesses
(they are evaluated like any other config), so neighbours tuned with another version of the
kernel, Triton or torch are welcome too: one model's decode optimum is often another's, as the
structure that streams the weights best depends on the rows and the GPU more than on the
widths.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

from fusetune import tables
from fusetune.db.store import PointKey, Store
from fusetune.spec import WEIGHT_FORMATS, Config, KernelSpec, Point
from fusetune.tuner.space import PointPlan, SearchSpace, config_key

NEIGHBOURS = 2  # winners of this many nearest points are tried right after the default
DTYPE_DISTANCE = 1.0  # another activation dtype counts as a factor of 2 in the row count
# The other FP8 format (e5m2 for e4m3 and back) too: one byte a weight either way, so the same
# tiles fit and the same decode structure wins or comes close.
WEIGHTS_DISTANCE = 1.0
# Points farther apart than this (64× the rows, or the equivalent in dims) do not seed each other:
# decode (few rows) and prefill (thousands) take other structures, and a winner of one, moved
# into the other's space, starts the climb in the wrong place.
MAX_DISTANCE = 6.0


def point_distance(dims: Mapping[str, int], rows: int, dtype: str,
                   other_dims: Mapping[str, int], other_rows: int, other_dtype: str
                   ) -> float | None:
    """How far apart two points of one kernel are: |Δ log2 rows| + Σ |Δ log2 (1 + dim)| over
    the dims (+ DTYPE_DISTANCE for another dtype); None when their dims have other names.
    A factor of 2 in the rows or in one dim counts 1 (about: 1 + dim keeps dims of 0 and 1,
    such as qkv's interleaved flag, apart)."""
    if set(dims) != set(other_dims):
        return None
    d = abs(math.log2(max(1, rows)) - math.log2(max(1, other_rows)))
    d += sum(abs(math.log2(1 + dims[k]) - math.log2(1 + other_dims[k])) for k in dims)
    return d + (DTYPE_DISTANCE if dtype != other_dtype else 0.0)


def weights_distance(weights: str, other: str) -> float | None:
    """How far apart two points' weight formats are (Point.weights: "" for weights in the
    activations' dtype): 0 for the same, WEIGHTS_DISTANCE between the two FP8 formats, None
    between FP8 and 16-bit weights (twice the bytes a weight: other tiles fit, other structures
    win)."""
    if weights == other:
        return 0.0
    if weights in WEIGHT_FORMATS and other in WEIGHT_FORMATS:
        return WEIGHTS_DISTANCE
    return None


def neighbour_winners(store: Store, key: PointKey, point_id: int | None,
                      limit: int = NEIGHBOURS, *, use_tables: bool = True,
                      same_shape: bool = True, flags: Mapping[str, int] | None = None,
                      optional_dims: Mapping[str, int] | None = None) -> list[Config]:
    """Distinct winners of the `limit` points nearest to `key` (point_distance, at most
    MAX_DISTANCE; among equals the one of more rows first, as the lookup rounds up: a config
    tuned for more rows serves fewer, not the reverse; then the database's before the tables',
    newest first), leaving out the point `point_id` itself. use_tables: the lookup tables'
    entries for key.gpu count as points too. same_shape=False also leaves out winners of key's
    very shape (dims, rows, dtype) stored under another version or in a table: what a replay
    does, where those may come from the grid itself. `flags` (KernelSpec.omitted_values): a
    winner stored before the kernel gained a flag (or a `same_as` key) ran with its default, and
    is returned with it (as the tables' validated entries are), so that it is the same config as
    its twin in a table. `optional_dims` (KernelSpec.optional_dims): a point that leaves one
    out has its default, so that the points with and without it are neighbours (qkv's plain
    points beside those with q/k norms, one apart)."""
    rows = max(1, key.batch * key.seq)
    found: list[tuple[float, int, int, Config]] = []
    optional = dict(optional_dims or {})
    my_dims = {**optional, **key.dims}

    def consider(dims: Mapping[str, int], n_rows: int, dtype: str, weights: str,
                 config: Config) -> None:
        d = point_distance(my_dims, rows, key.dtype, {**optional, **dims}, n_rows, dtype)
        w = weights_distance(key.weights, weights)
        if d is None or w is None:
            return
        d += w
        # Distance 0 is key's very shape: every term is 0 only for equal rows, dims, dtype and
        # weight format.
        if d > MAX_DISTANCE or (not same_shape and d == 0):
            return
        found.append((d, -n_rows, len(found), dict(config)))

    # Points of the same activation mode only: FP8 activations take other structures (the
    # norm always its own pass, FP8 tiles) than weight-only FP8.
    for p, w in store.winners(gpu=key.gpu, kernel=key.kernel):  # newest first
        if p.id != point_id and p.backend == key.backend and p.activations == key.activations:
            consider(json.loads(p.dims), max(1, p.batch * p.seq), p.dtype, p.weight_format,
                     {**(flags or {}), **w.config})
    if use_tables and key.backend == "cuda":
        for weights in dict.fromkeys((key.weights, *WEIGHT_FORMATS)):  # consider() picks
            if key.activations and not weights:
                continue  # FP8 activations only beside FP8 weights
            for dims, dtype, n_rows, config in tables.tuned_entries(key.gpu, key.kernel,
                                                                    weights, key.activations):
                consider(dict(dims), n_rows, dtype, weights, config)
    found.sort(key=lambda t: t[:3])  # distance, more rows first, order found
    out: list[Config] = []
    seen: set[str] = set()
    for _, _, _, config in found:
        if (k := config_key(config)) not in seen:
            seen.add(k)
            out.append(config)
        if len(out) == limit:
            break
    return out


def start_configs(spec: KernelSpec, point: Point, space: SearchSpace, plan: PointPlan,
                  default: Config, neighbours: Sequence[Config]) -> list[Config]:
    """The default, then the neighbours' winners made canonical for `point`. A start config
    that this point's space does not hold (a winner of another space, a default outside a
    `--space` file) leads to its nearest config in the space (SearchSpace.nearest), the
    default to both; what the GPU cannot hold, winners of an older kernel's config keys and
    duplicates are left out."""
    out, seen = [default], {config_key(default)}
    # The other algorithms of the kernel (KernelSpec.algorithm_keys) right after the default:
    # whether one beats every tile of the fused kernel is what every search must find out.
    others = [{**default, k: 1} for k in spec.algorithm_keys]
    for c in [default, *others, *neighbours]:
        try:
            canon = spec.canonical(c, point)
            if plan.raw_of(config_key(canon)) is None:
                canon = spec.canonical(space.nearest(canon), point)
        except (KeyError, TypeError, ValueError):  # a winner of an older kernel's config keys
            continue
        key = config_key(canon)
        if key in seen or not plan.is_feasible(key):
            continue
        seen.add(key)
        out.append(canon)
    return out
