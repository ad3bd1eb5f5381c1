"""The configs a study starts from: the default heuristic and the winners of neighbouring points.

A point's neighbours share its GPU, kernel, dims, dtype, weight format and backend and differ in
batch or sequence length; the nearest in log2 of the row count come first. Their winners are
only first guesses (they are evaluated like any other config), so neighbours tuned with another
version of the kernel, Triton or torch are welcome too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fusetune.db.store import PointKey, Store
from fusetune.kernels._spec import Config, KernelSpec, Point
from fusetune.tuner.space import Plan, config_key

NEIGHBOURS = 2  # winners of this many nearest points are tried right after the default


def neighbour_winners(store: Store, key: PointKey, point_id: int | None,
                      limit: int = NEIGHBOURS) -> list[Config]:
    """Winners of the `limit` points nearest to `key` in rows (newest first among equals),
    leaving out the point `point_id` itself."""
    rows = max(1, key.batch * key.seq)
    found = [(abs(math.log2(max(1, p.batch * p.seq)) - math.log2(rows)), i, dict(w.config))
             for i, (p, w) in enumerate(store.winners(gpu=key.gpu, kernel=key.kernel))
             if p.id != point_id and p.dims == key.dims_json and p.dtype == key.dtype
             and p.weights == key.weights and p.backend == key.backend]
    found.sort(key=lambda t: (t[0], t[1]))  # winners() lists the newest first
    return [config for _, _, config in found[:limit]]


def start_configs(spec: KernelSpec, point: Point, plan: Plan, default: Config,
                  neighbours: Sequence[Config]) -> list[Config]:
    """The default, then the neighbours' winners made canonical for `point`; winners that this
    point's space does not hold, and duplicates, are left out."""
    out, seen = [default], {config_key(default)}
    for c in neighbours:
        try:
            canon = spec.canonical(c, point)
        except (KeyError, TypeError, ValueError):  # a winner of an older kernel's config keys
            continue
        key = config_key(canon)
        if key in seen or key not in plan.representative:
            continue
        seen.add(key)
        out.append(canon)
    return out
