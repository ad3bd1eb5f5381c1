"""The exhaustive grid of one point: every distinct feasible config, timed once and stored.

It runs through the search's own `PointTuner` (same evaluator, same ft_results rows), so a grid
resumes where it stopped and reuses what an earlier search or grid on the point stored. The
seconds spent evaluating are added up in the point's Optuna study (user attributes), so that the
grid's cost can be reported later, on another machine, from the database alone.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import optuna

from fusetune import gpus
from fusetune.db.store import PointKey, Store, safe_url
from fusetune.spec import Config, KernelSpec, Point
from fusetune.tuner.seeds import neighbour_winners
from fusetune.tuner.space import Plan, SearchSpace, config_key, make_plan
from fusetune.tuner.study import PointResult, PointTuner

if TYPE_CHECKING:
    from fusetune.db.models import PointRow

EVAL_S_ATTR = "grid_eval_s"  # seconds of grid runs spent evaluating configs of this point
TIMED_ATTR = "grid_timed"  # configs those seconds cover

GridProgress = Callable[[int, int, str], None]  # (done, total, message)


def config_text(config: Config) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


@dataclass
class GridRun:
    size: int  # distinct feasible configs of the point
    stored_before: int  # of those, already stored when this run started
    timed: int  # evaluated by this run
    wall_s: float  # seconds this run spent evaluating
    result: PointResult | None  # winner re-timed beside the default (None if nothing ran)
    compile_s: float = 0.0  # of which compiling and checking, in the evaluating process
    compiled_ahead: int = 0  # configs timed after the compile processes compiled them


def grid_study(tuner: PointTuner) -> optuna.Study:
    """The point's study (the search's), where the grid's evaluation time is kept."""
    return optuna.create_study(storage=tuner.ctx.storage, study_name=tuner.key.study_name,
                               direction="minimize", load_if_exists=True)


def run_grid(tuner: PointTuner, progress: GridProgress | None = None) -> GridRun:
    """Evaluates every feasible config of the tuner's plan not stored yet (and the default
    config when the space cannot express it), stores pruned configs as infeasible, then re-times
    the best few beside the default and stores the winner like a search does. With compile
    processes (the context's `compiler`), every config to time is handed to them first: they
    compile ahead while the GPU times."""
    plan, results, default_key = tuner.plan, tuner.results, config_key(tuner.default)
    todo = [c for c in plan.feasible if config_key(c) not in results]
    if default_key not in plan.representative and default_key not in results:
        todo.append(tuner.default)  # the search runs it first, outside the space
    size = len(plan.feasible)
    stored_before = size - sum(1 for c in todo if config_key(c) in plan.representative)
    report = progress or (lambda done, total, msg: None)

    for key in plan.infeasible:  # pruned, nothing runs: stored so that the db tells it all
        if key not in results:
            tuner.evaluate(tuner.spec.canonical(plan.representative[key], tuner.point))
    study = grid_study(tuner)
    spent, timed = 0.0, 0
    best = min((r.time_us for r in results.values() if r.status == "ok" and r.time_us),
               default=None)
    total = stored_before + len(todo)
    report(stored_before, total, "resuming" if stored_before else "starting")
    tuner.compile_ahead(todo)  # all known now: the compile processes run ahead of the GPU
    for c in todo:
        t0 = time.perf_counter()
        out = tuner.evaluate(c)
        dt = time.perf_counter() - t0
        spent, timed = spent + dt, timed + 1
        attrs = study.user_attrs
        study.set_user_attr(EVAL_S_ATTR, float(attrs.get(EVAL_S_ATTR, 0.0)) + dt)
        study.set_user_attr(TIMED_ATTR, int(attrs.get(TIMED_ATTR, 0)) + 1)
        if out.ok and out.time_us is not None and (best is None or out.time_us < best):
            best = out.time_us
        report(stored_before + timed, total,
               f"{out.status}, best {best:.2f} µs" if best is not None else out.status)
    result = tuner.finish() if any(r.status == "ok" for r in results.values()) else None
    return GridRun(size, stored_before, timed, spent, result, tuner.compile_s,
                   tuner.compiled_ahead)


# ---- reading a grid back -------------------------------------------------------------------


class GridError(ValueError):
    """A stored grid that cannot be used as asked (none stored, incomplete); says why."""


@dataclass(frozen=True)
class Measured:
    """A stored result, as the replay needs it."""

    status: str
    time_us: float | None = None
    compile_s: float | None = None


@dataclass
class StoredGrid:
    """One point's exhaustive grid as the database holds it: the objective of every replay."""

    point: Point
    plan: Plan
    measured: dict[str, Measured]  # stored results by config key
    default: Config  # the default heuristic's config, canonical
    neighbours: list[Config] = field(default_factory=list)  # winners of the nearest points
    eval_s: float | None = None  # seconds grid runs spent evaluating, where recorded
    eval_timed: int = 0  # configs those seconds cover
    label: str = ""  # where it came from (database point id, ...)
    kernel_hash: str = ""  # of the kernel version the results were measured with

    @property
    def size(self) -> int:
        """Distinct feasible configs: what an exhaustive search evaluates."""
        return len(self.plan.feasible)

    def missing(self) -> list[Config]:
        """Configs an exhaustive search evaluates that have no stored result."""
        out = [c for c in self.plan.feasible if config_key(c) not in self.measured]
        dkey = config_key(self.default)
        if dkey not in self.plan.representative and dkey not in self.measured:
            out.append(self.default)
        return out

    def require_complete(self, kernel_hash: str | None = None) -> None:
        """GridError unless every config an exhaustive search evaluates has a stored result;
        `kernel_hash` (the current kernel's) helps say why when none has."""
        missing = self.missing()
        if not missing:
            return
        where = self.label or self.point.label
        msg = (f"the grid of {where} is incomplete: {len(missing)} of {self.size} configs have "
               f"no stored result (e.g. {config_text(missing[0])})")
        if len(missing) >= self.size and self.measured:
            msg += (f"; the point holds {len(self.measured)} results, none of this search "
                    "space's configs: it was measured with another space")
            if kernel_hash and self.kernel_hash and kernel_hash != self.kernel_hash:
                msg += (f" and another version of the kernel (source hash {self.kernel_hash}, "
                        f"now {kernel_hash})")
            msg += ". Replay it with the fusetune version (and --space) it was run with"
        else:
            msg += ". Run with --grid on that GPU to time them"
        raise GridError(msg)

    def time_us(self, key: str) -> float | None:
        """The stored median time of a config that ran correctly, else None."""
        m = self.measured.get(key)
        return m.time_us if m is not None and m.status == "ok" else None

    def objective(self, key: str) -> tuple[float, int]:
        """(value the sampler is told, evaluations it costs) of the config `key`."""
        if key in self.plan.infeasible or self.measured[key].status == "infeasible":
            return math.inf, 0  # pruned before compiling: costs nothing
        t = self.time_us(key)
        return (math.inf if t is None else t), 1

    @property
    def optimum(self) -> tuple[Config, float]:
        """The fastest feasible config of the grid and its stored median time (µs)."""
        timed = [(t, c) for c in self.plan.feasible
                 if (t := self.time_us(config_key(c))) is not None]
        if not timed:
            raise GridError(f"{self.label or self.point.label}: no feasible config of the grid "
                            "ran correctly, so there is no optimum to reach")
        t, c = min(timed, key=lambda tc: tc[0])
        return c, t

    def count_within(self, threshold: float) -> int:
        """Feasible configs whose stored time is within `threshold` of the optimum."""
        limit = self.optimum[1] * (1 + threshold)
        return sum(1 for c in self.plan.feasible
                   if (t := self.time_us(config_key(c))) is not None and t <= limit)

    def _ran(self) -> list[Measured]:
        """Stored results of the grid's configs that ran (were not pruned)."""
        keys = {config_key(c) for c in self.plan.feasible} | {config_key(self.default)}
        return [m for k in keys if (m := self.measured.get(k)) is not None
                and m.status != "infeasible"]

    def evaluated(self) -> int:
        """Configs of the grid that ran: what the grid's wall time was spent on."""
        return len(self._ran())

    def wall_s(self) -> tuple[float | None, bool]:
        """Seconds the grid took to evaluate, and whether that is extrapolated (some configs
        were stored by a search, whose time was not recorded). None if nothing was recorded."""
        if not self.eval_s or not self.eval_timed:
            return None, False
        n = self.evaluated()
        if self.eval_timed >= n:
            return self.eval_s, False
        return self.eval_s / self.eval_timed * n, True

    def compile_s(self) -> float:
        """Seconds spent compiling and checking the grid's configs (stored per config)."""
        return sum(m.compile_s or 0.0 for m in self._ran())


def find_points(store: Store, gpu: str, point: Point, backend: str | None = None
                ) -> list[tuple[PointRow, int]]:
    """Stored points of `gpu` at `point` (any kernel version, Triton, torch; one backend if
    given) with their number of stored results, the most results first, then the newest."""
    return store.points_of_shape(gpu, point.kernel, point.dim, point.batch, point.seq,
                                 point.dtype, point.weights, backend)


def stored_point(store: Store, gpu: str, point: Point, backend: str | None
                 ) -> tuple[PointRow, str | None]:
    """The stored point that holds `point`'s grid on `gpu` (the one with the most results if
    several versions match), and a note when there was a choice."""
    found = find_points(store, gpu, point, backend)
    if not found:
        there = stored_points(store, point.kernel)
        raise GridError(
            f"no stored point {point.label} on {gpu}" + (f" ({backend})" if backend else "")
            + f" in {safe_url(store.url)}; stored {point.kernel} points: "
            + ("; ".join(there) or "none")
            + ". Run with --grid on that GPU first, or name a stored point with --gpu, --dims, "
              "--batch, --seq and --dtype.")
    row, n = found[0]
    note = None
    if len(found) > 1:
        note = (f"{len(found)} stored points match {point.label} on {gpu} (kernel, Triton or "
                f"torch versions differ); replaying point {row.id}, which holds the most "
                f"results ({n})")
    return row, note


def stored_points(store: Store, kernel: str) -> list[str]:
    """One line per stored point of `kernel` (for messages naming what there is)."""
    return [f"{r.gpu} {r.dims} b={r.batch} s={r.seq} {r.dtype} ({r.backend})"
            for r in store.points(kernel)]


def recorded_eval_time(storage: optuna.storages.BaseStorage, study_name: str
                       ) -> tuple[float | None, int]:
    """(seconds, configs) that grid runs recorded in the point's study; (None, 0) if none."""
    try:
        attrs = storage.get_study_user_attrs(storage.get_study_id_from_name(study_name))
    except KeyError:
        return None, 0
    if EVAL_S_ATTR not in attrs:
        return None, 0
    return float(attrs[EVAL_S_ATTR]), int(attrs.get(TIMED_ATTR, 0))


def load_grid(store: Store, storage: optuna.storages.BaseStorage, row: PointRow,
              spec: KernelSpec, space: SearchSpace) -> StoredGrid:
    """The stored grid of the point `row`, planned under its GPU's limits (from the catalogue:
    no GPU needed), with the nearest points' winners and the recorded evaluation time."""
    dims = json.loads(row.dims)
    point = Point.make(row.kernel, dims, row.batch, row.seq, row.dtype, row.weight_format,
                       row.activations)
    gpu = gpus.resolve(row.gpu)
    plan = make_plan(space, spec, point, gpu)
    # Keyed as today's configs are: a flag (or same_as key) the kernel gained after the grid
    # ran (absent from its stored configs) had its default value there.
    omitted = spec.omitted_values
    measured = {config_key({**omitted, **r.config}): Measured(r.status, r.time_us, r.compile_s)
                for r in store.results(row.id).values()}
    key = PointKey(row.gpu, row.kernel, dims, row.batch, row.seq, row.dtype, row.weight_format,
                   row.backend, row.kernel_hash, row.triton_version, row.torch_version,
                   row.activations)
    eval_s, timed = recorded_eval_time(storage, row.study_name)
    return StoredGrid(point, plan, measured, spec.canonical(spec.default_config(point, gpu), point),
                      neighbour_winners(store, key, row.id, same_shape=False,
                                        flags=omitted, optional_dims=spec.optional_dims),
                      eval_s, timed,
                      f"stored point {row.id}", row.kernel_hash)
