"""Tuning one point: an Optuna study (resumable), every result stored, finalists re-timed."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna
from optuna.trial import TrialState

from fusetune.db.store import PointKey, Store
from fusetune.gpus import GpuSpec
from fusetune.kernels._spec import Config, Cost, KernelSpec, Point
from fusetune.tuner.bench import DeviceLostError, Evaluator, Outcome
from fusetune.tuner.liveness import Heartbeat, is_stale
from fusetune.tuner.space import Plan, SearchSpace, config_key, make_plan
from fusetune.tuner.worker import Worker

INTERRUPTED = "interrupted: the search stopped while this trial ran; it is tried again on resume"


@dataclass
class SearchOptions:
    trials: int = 40  # distinct configs evaluated per point (the whole space if it is smaller)
    time_budget_s: float | None = None  # per point; stops sampling, finalists still re-timed
    finalists: int = 3  # best configs re-timed, interleaved with the default, to pick the winner
    rounds: int = 3  # interleaved re-timing rounds
    seed: int = 0


@dataclass
class Context:
    """What every point of one search shares."""

    spec: KernelSpec
    space: SearchSpace
    gpu: GpuSpec
    backend: str  # "cuda" | "interpreter"
    device: str
    store: Store
    storage: optuna.storages.BaseStorage
    triton_version: str
    torch_version: str
    worker: Worker | None = None  # run configs in this subprocess (None: in this process)

    def key(self, point: Point) -> PointKey:
        return PointKey(
            gpu=self.gpu.name, kernel=point.kernel, dims=point.dim, batch=point.batch,
            seq=point.seq, dtype=point.dtype, weights=point.weights, backend=self.backend,
            kernel_hash=self.spec.source_hash, triton_version=self.triton_version,
            torch_version=self.torch_version)


@dataclass
class PointResult:
    point: Point
    cost: Cost
    winner: Config | None = None
    time_us: float | None = None
    default_config: Config = field(default_factory=dict)
    default_us: float | None = None
    n_evaluated: int = 0  # distinct configs with a stored result (this run and earlier ones)
    n_new: int = 0  # evaluated in this run
    statuses: Counter[str] = field(default_factory=Counter)

    @property
    def speedup(self) -> float | None:
        if self.time_us and self.default_us:
            return self.default_us / self.time_us
        return None


Progress = Callable[[int, int, str], None]  # (done, target, message)


def _fail_stale_trials(study: optuna.Study, storage: optuna.storages.BaseStorage, store: Store,
                       point_id: int) -> int:
    """Trials left RUNNING by a dead process become FAIL with a reason; trials that another
    live search is running (fresh heartbeat) are left alone. Returns how many were failed."""
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    if not running:
        return 0
    claims = store.running(point_id)
    # An unclaimed RUNNING trial is a live search's only in the instant between asking for it
    # and claiming it; with no live claim on the point at all, no search is running here.
    others_live = any(not is_stale(c, None) for c in claims.values())
    study_id = storage.get_study_id_from_name(study.study_name)
    failed = 0
    for t in running:
        claim = claims.get(t.number)
        unclaimed_and_alone = claim is None and not others_live
        if not unclaimed_and_alone and not is_stale(claim, t.datetime_start):
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        try:
            storage.set_trial_user_attr(trial_id, "status", "interrupted")
            storage.set_trial_user_attr(trial_id, "reason", INTERRUPTED)
            study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # its process finished it meanwhile
        if claim is not None:
            store.release(claim.id)
        failed += 1
    return failed


class PointTuner:
    """Runs the study of one point; see `run`."""

    def __init__(self, ctx: Context, point: Point, options: SearchOptions,
                 progress: Progress | None = None) -> None:
        self.ctx, self.point, self.options = ctx, point, options
        self.progress = progress or (lambda done, target, msg: None)
        self.spec = ctx.spec
        self.plan: Plan = make_plan(ctx.space, ctx.spec, point, ctx.gpu)
        self.key = ctx.key(point)
        self.point_id = ctx.store.point_id(self.key)
        self.results = ctx.store.results(self.point_id)
        self.default = self.spec.canonical(self.spec.default_config(point, ctx.gpu), point)
        self._evaluator: Evaluator | Worker | None = None
        self.n_new = 0

    @staticmethod
    def _tell(study: optuna.Study, trial: optuna.Trial, out: Outcome) -> None:
        """Reports a result to Optuna; failures count as +inf so the sampler avoids them."""
        try:
            trial.set_user_attr("status", out.status)
            if out.reason:
                trial.set_user_attr("reason", out.reason[:1000])
            study.tell(trial, out.time_us if out.ok and out.time_us is not None else math.inf,
                       skip_if_finished=True)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another search process on this point marked the trial failed as stale; the
            # result itself is already in ft_results.
            pass

    @property
    def evaluator(self) -> Evaluator | Worker:
        """Where configs run: the context's worker process (set to this point on first use),
        or an in-process Evaluator. Inputs are made only when something must run."""
        if self._evaluator is None:
            if self.ctx.worker is not None:
                self.ctx.worker.set_point(self.point, self.options.seed)
                self._evaluator = self.ctx.worker
            else:
                self._evaluator = Evaluator(self.spec, self.point, self.ctx.backend,
                                            self.ctx.device, seed=self.options.seed)
        return self._evaluator

    # -- one config ----------------------------------------------------------------------------

    def _value(self, key: str) -> float:
        row = self.results[key]
        return row.time_us if row.status == "ok" and row.time_us is not None else math.inf

    def _store(self, config: Config, out: Outcome, trial_number: int | None) -> None:
        key = config_key(config)
        self.results[key] = self.ctx.store.record(
            self.point_id, key, config, out.status, out.reason, time_us=out.time_us,
            p20_us=out.p20_us, p80_us=out.p80_us, rel_err=out.rel_err, compile_s=out.compile_s,
            trial_number=trial_number)

    def _evaluate(self, config: Config, trial_number: int | None) -> Outcome:
        key = config_key(config)
        if key in self.plan.infeasible:
            out = Outcome("infeasible", self.plan.infeasible[key])
        else:
            try:
                out = self.evaluator.evaluate(config)
            except DeviceLostError as exc:
                self._store(config, Outcome("crashed", str(exc)), trial_number)
                raise
            self.n_new += 1
        self._store(config, out, trial_number)
        return out

    # -- the study -----------------------------------------------------------------------------

    def _evaluated_feasible(self) -> int:
        return sum(1 for c in self.plan.feasible if config_key(c) in self.results)

    def run(self) -> PointResult:
        ctx, opts = self.ctx, self.options
        target = min(opts.trials, len(self.plan.feasible))
        study = optuna.create_study(
            storage=ctx.storage, study_name=self.key.study_name, direction="minimize",
            load_if_exists=True,
            sampler=optuna.samplers.TPESampler(seed=opts.seed, multivariate=True,
                                               n_startup_trials=max(4, min(10, target // 4))))
        _fail_stale_trials(study, ctx.storage, ctx.store, self.point_id)
        study.set_user_attr("point", self.point.label)
        study.set_user_attr("gpu", ctx.gpu.name)

        # The default first, then (for small spaces) every remaining config in order.
        queue = [self.default]
        if len(self.plan.feasible) <= opts.trials:
            queue += self.plan.feasible
        waiting = {
            # An enqueued trial keeps its parameters in system_attrs until it is asked for.
            config_key(self.spec.canonical(ctx.space.from_params(
                t.system_attrs.get("fixed_params") or t.params), self.point))
            for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        }
        for c in queue:
            k = config_key(c)
            if k in self.results or k in waiting:
                continue
            params = ctx.space.to_params(c)
            if params is None:  # outside the YAML space (e.g. a user space): run it directly
                self._evaluate(c, None)
                continue
            study.enqueue_trial(params)
            waiting.add(k)

        started = time.monotonic()
        asks, repeats = 0, 0
        rng = random.Random(opts.seed + len(self.results))
        while self._evaluated_feasible() < target:
            if opts.time_budget_s is not None and time.monotonic() - started > opts.time_budget_s:
                break
            if asks > 20 * target + 100:  # the sampler keeps proposing what was done: stop
                break
            asks += 1
            trial = study.ask()
            config = self.spec.canonical(ctx.space.suggest(trial), self.point)
            key = config_key(config)
            trial.set_user_attr("config", config)
            if key in self.results:
                # Never redone: the stored value answers (repeats happen in small spaces).
                row = self.results[key]
                trial.set_user_attr("status", row.status)
                trial.set_user_attr("repeat_of", key)
                study.tell(trial, self._value(key))
                repeats += 1
                if repeats >= 3:  # steer the sampler to an untried config
                    todo = [c for c in self.plan.feasible if config_key(c) not in self.results]
                    if todo:
                        p = ctx.space.to_params(rng.choice(todo))
                        if p is not None:
                            study.enqueue_trial(p)
                    repeats = 0
                continue
            repeats = 0
            # The claim covers the trial until Optuna has its result: a search starting on this
            # point meanwhile sees a live trial, not a stale one.
            with Heartbeat(ctx.store, self.point_id, trial.number):
                try:
                    out = self._evaluate(config, trial.number)
                except (KeyboardInterrupt, DeviceLostError) as exc:
                    reason = INTERRUPTED if isinstance(exc, KeyboardInterrupt) else str(exc)
                    trial.set_user_attr("status", "interrupted" if isinstance(
                        exc, KeyboardInterrupt) else "crashed")
                    trial.set_user_attr("reason", reason)
                    study.tell(trial, state=TrialState.FAIL)
                    raise
                self._tell(study, trial, out)
            if out.status != "infeasible":
                best = min((self._value(k) for k in self.results), default=math.inf)
                self.progress(self._evaluated_feasible(), target,
                              f"{out.status} best {best:.1f} µs" if best < math.inf
                              else out.status)
        return self._finish()

    def _finish(self) -> PointResult:
        """Re-times the best few beside the default, interleaved; stores the winner."""
        cost = self.spec.cost(self.point)
        res = PointResult(self.point, cost, default_config=self.default,
                          n_evaluated=len(self.results), n_new=self.n_new,
                          statuses=Counter(r.status for r in self.results.values()))
        ok = sorted((r for r in self.results.values() if r.status == "ok" and r.time_us),
                    key=lambda r: r.time_us)
        if not ok:
            return res
        dkey = config_key(self.default)
        finalists = [dict(r.config) for r in ok[: self.options.finalists]]
        default_ok = dkey in self.results and self.results[dkey].status == "ok"
        if default_ok and all(config_key(c) != dkey for c in finalists):
            finalists.append(dict(self.default))
        times: dict[str, list[float]] = {config_key(c): [] for c in finalists}
        for _ in range(self.options.rounds):
            for c in finalists:
                q = self.evaluator.time(c)
                if q is not None:  # None: the worker crashed on it this time; leave it out
                    times[config_key(c)].append(q[1])
        medians = {k: statistics.median(v) for k, v in times.items() if v}
        if not medians:
            return res
        wkey = min(medians, key=medians.__getitem__)
        res.winner = next(c for c in finalists if config_key(c) == wkey)
        res.time_us = medians[wkey]
        res.default_us = medians.get(dkey) if default_ok else None
        self.ctx.store.set_winner(self.point_id, res.winner, res.time_us, self.default,
                                  res.default_us, cost.bytes, cost.flops, len(self.results))
        return res
