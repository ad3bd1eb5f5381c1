"""Tuning one point: an Optuna study (resumable), every result stored, finalists re-timed."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import optuna
from optuna.trial import TrialState

from fusetune.db.models import WinnerRow
from fusetune.db.store import PointKey, Store
from fusetune.gpus import GpuSpec
from fusetune.spec import Config, Cost, KernelSpec, Point
from fusetune.tuner.bench import DeviceLostError, Evaluator, Outcome, round_order
from fusetune.tuner.compile_ahead import COMPILED, CompileAhead
from fusetune.tuner.liveness import ClaimedElsewhere, Heartbeat, is_stale
from fusetune.tuner.sampling import (
    BATCH_SEARCH_STRATEGY,
    SEARCH_STRATEGY,
    Proposal,
    Proposer,
    max_asks,
)
from fusetune.tuner.seeds import neighbour_winners, start_configs
from fusetune.tuner.space import PointPlan, SearchSpace, config_key, make_plan, search_plan
from fusetune.tuner.worker import Worker, resolve_spec

INTERRUPTED = "interrupted: the search stopped while this trial ran; it is tried again on resume"
WAIT_POLL_S = 0.5  # how often a finishing search looks whether others' trials on its point ended
CLAIM_DELAY_S = 2.0  # ample time for a live search to claim the trial it has just asked for
NOT_RUN = "skipped: asked with a batch, the search stopped before running it"


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
    # Compile processes that compile the configs ahead of `device` (None: it compiles them)
    compiler: CompileAhead | None = None

    def for_kernel(self, spec: KernelSpec, space: SearchSpace, spec_ref: str) -> Context:
        """This context for the points of another kernel: the same device, database
        connections, worker and compile processes. The processes serve `spec_ref` (`spec`'s
        registered name, or "module:attribute") from their next point on, so one context of
        those sharing them is in use at a time; close only one of them."""
        assert resolve_spec(spec_ref).name == spec.name, (spec_ref, spec.name)
        if self.worker is not None:
            self.worker.spec_ref = spec_ref
        if self.compiler is not None:
            self.compiler.spec_ref = spec_ref
        return dataclasses.replace(self, spec=spec, space=space)

    def close(self) -> None:
        """Stops the worker and the compile processes."""
        if self.worker is not None:
            self.worker.close()
        if self.compiler is not None:
            self.compiler.close()

    def key(self, point: Point) -> PointKey:
        return PointKey(
            gpu=self.gpu.name, kernel=point.kernel, dims=point.dim, batch=point.batch,
            seq=point.seq, dtype=point.dtype, weights=point.weights, backend=self.backend,
            kernel_hash=self.spec.source_hash, triton_version=self.triton_version,
            torch_version=self.torch_version, activations=point.activations)


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
    compile_s: float = 0.0  # seconds this run's evaluations spent compiling (and checking)
    compiled_ahead: int = 0  # of this run's evaluations, those compiled ahead (see Context)
    # Finalists whose re-timing failed, config key -> why (they are left out of the choice)
    retime_failed: dict[str, str] = field(default_factory=dict)

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
    if not others_live and any(t.number not in claims for t in running):
        # ... unless that search is in that very instant (two searches starting on a point
        # together): look again once it has had the time to claim.
        time.sleep(CLAIM_DELAY_S)
        claims = store.running(point_id)
        others_live = any(not is_stale(c, None) for c in claims.values())
    study_id = storage.get_study_id_from_name(study.study_name)
    failed = 0
    for t in running:
        claim = claims.get(t.number)
        unclaimed_and_alone = claim is None and not others_live
        if not unclaimed_and_alone and not is_stale(claim, _utc(t.datetime_start)):
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


def sampling_study(key: PointKey, space: SearchSpace) -> str:
    """The name of the Optuna study a search of the point samples in: the point's own, and,
    for a space that is a list of configs, the list's hash. Its one parameter is the config's
    index in the list, so another list (a config added, the order changed) samples in a study
    of its own; the results stored for the point are reused whatever the study."""
    if space.choices is None:
        return key.study_name
    listed = json.dumps([config_key(c) for c in space.choices])
    return f"{key.study_name}/configs={hashlib.sha256(listed.encode()).hexdigest()[:12]}"


def _utc(t: datetime | None) -> datetime | None:
    """Optuna stores its trials' times naive, in the local time of the process that wrote them."""
    return t.astimezone(timezone.utc) if t is not None and t.tzinfo is None else t


def _fail(study: optuna.Study, trial: optuna.Trial, status: str, reason: str) -> None:
    """Reports a trial failed, unless another search finished it meanwhile."""
    try:
        trial.set_user_attr("status", status)
        trial.set_user_attr("reason", reason[:1000])
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
    except optuna.exceptions.UpdateFinishedTrialError:
        pass


class PointTuner:
    """Runs the study of one point; see `run`."""

    def __init__(self, ctx: Context, point: Point, options: SearchOptions,
                 progress: Progress | None = None, *, exhaustive: bool = False) -> None:
        self.ctx, self.point, self.options = ctx, point, options
        self.progress = progress or (lambda done, target, msg: None)
        self.spec = ctx.spec
        # The exhaustive grid needs every config of the space; a search samples large spaces.
        self.plan: PointPlan = (make_plan if exhaustive else search_plan)(
            ctx.space, ctx.spec, point, ctx.gpu)
        self.key = ctx.key(point)
        self.point_id = ctx.store.point_id(self.key)
        self.results = ctx.store.results(self.point_id)
        self.default = self.spec.canonical(self.spec.default_config(point, ctx.gpu), point)
        self._evaluator: Evaluator | Worker | None = None
        self.n_new = 0
        self.compile_s = 0.0  # in the evaluating process (its outcomes' compile_s), this run
        self.compiled_ahead = 0  # configs evaluated after the compile processes compiled them

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

    def _store(self, config: Config, out: Outcome, trial_number: int | None,
               device: str | None = None) -> None:
        key = config_key(config)
        self.results[key] = self.ctx.store.record(
            self.point_id, key, config, out.status, out.reason, time_us=out.time_us,
            p20_us=out.p20_us, p80_us=out.p80_us, rel_err=out.rel_err, compile_s=out.compile_s,
            trial_number=trial_number, device=device, n_regs=out.n_regs, n_spills=out.n_spills,
            smem_bytes=out.smem_bytes)

    def compile_ahead(self, configs: Iterable[Config]) -> None:
        """Has the context's compile processes (if any) compile `configs`, in this order, ahead
        of their evaluation; pruned and stored configs are left out."""
        if self.ctx.compiler is not None:
            self.ctx.compiler.submit(self.point, [
                c for c in configs if self.plan.pruned(config_key(c)) is None
                and config_key(c) not in self.results])

    def _compiled_ahead(self, config: Config) -> bool:
        """Waits for the config's compile ahead, if a process has it; whether it is done."""
        if self.ctx.compiler is None:
            return False
        cancel = getattr(self.ctx.worker, "cancel", None)  # a device search stopping
        return self.ctx.compiler.wait(self.point, config, cancel) == COMPILED

    def _evaluate(self, config: Config, trial_number: int | None) -> Outcome:
        key = config_key(config)
        device = None  # a pruned config runs nowhere
        why = self.plan.pruned(key)
        if why is not None:
            out = Outcome("infeasible", why)
        else:
            device = self.ctx.device
            ahead = self._compiled_ahead(config)
            try:
                out = self.evaluator.evaluate(config)
            except DeviceLostError as exc:
                self._store(config, Outcome("crashed", str(exc)), trial_number, device)
                raise
            self.n_new += 1
            self.compiled_ahead += ahead
            self.compile_s += out.compile_s or 0.0
        self._store(config, out, trial_number, device)
        return out

    # -- the study -----------------------------------------------------------------------------

    def _evaluated_feasible(self) -> int:
        return sum(1 for key in self.results if self.plan.is_feasible(key))

    def _refresh(self) -> None:
        """Takes in what other searches on this point stored meanwhile (in place: callers may
        hold `results`)."""
        self.results.update(self.ctx.store.results(self.point_id))

    def _claims_elsewhere(self) -> dict[int, str]:
        """Claim id -> config key of the configs, not stored yet, that other live searches are
        evaluating on this point right now."""
        return {c.id: c.config_key for c in self.ctx.store.running(self.point_id).values()
                if c.config_key is not None and c.config_key not in self.results
                and not is_stale(c, None)}

    def evaluate(self, config: Config) -> Outcome:
        """Evaluates one config outside any study (the exhaustive grid) and stores the result."""
        return self._evaluate(config, None)

    def run(self) -> PointResult:
        """Samples the point's configs up to its budget, then picks and stores its winner."""
        self.sample()
        return self.finish()

    def sample(self) -> None:
        """Evaluates configs until the point's budget is reached (with the configs any other
        search stored or is evaluating on it), the time budget is spent or the sampler has
        nothing new. A search that joins a point another one is tuning calls only this: the
        other one picks the winner from every result (`finish`)."""
        ctx, opts = self.ctx, self.options
        target = self.plan.target(opts.trials)
        # Compiling ahead: configs are asked a batch at a time, compiled in parallel, timed in turn
        strategy = SEARCH_STRATEGY if ctx.compiler is None else BATCH_SEARCH_STRATEGY
        study = optuna.create_study(
            storage=ctx.storage, study_name=sampling_study(self.key, ctx.space),
            direction="minimize",
            load_if_exists=True, sampler=strategy.sampler(opts.seed, target))
        _fail_stale_trials(study, ctx.storage, ctx.store, self.point_id)
        study.set_user_attr("point", self.point.label)
        study.set_user_attr("gpu", ctx.gpu.name)

        def known(key: str) -> float | None:
            return self._value(key) if key in self.results else None

        def on_repeat(trial: optuna.Trial, key: str) -> None:
            trial.set_user_attr("status", self.results[key].status)

        proposer = Proposer(study, ctx.space, self.spec, self.point, self.plan, known,
                            random.Random(opts.seed + len(self.results)), max_asks(target),
                            on_repeat, climb=strategy.climb)
        # The default first, then the nearest points' winners, then their neighbourhoods (the
        # climb); every later config comes from the sampler (which covers small spaces whole:
        # see Proposer). Not for a point that has
        # its budget already: nothing would be asked, the enqueued trials would only wait.
        if strategy.seeded and self._evaluated_feasible() < target:
            neighbours = neighbour_winners(ctx.store, self.key, self.point_id,
                                           flags=self.spec.omitted_values,
                                           optional_dims=self.spec.optional_dims)
            starts = start_configs(self.spec, self.point, ctx.space, self.plan, self.default,
                                   neighbours)
            direct = proposer.enqueue(starts)  # outside the YAML space: run them directly
            self.compile_ahead(direct)
            for c in direct:
                self._evaluate(c, None)

        started = time.monotonic()
        # Steers this search off configs that others are evaluating; seeded per process and
        # thread so that two searches do not steer to the same config.
        elsewhere_rng = random.Random(opts.seed * 1_000_003 + os.getpid()
                                      + threading.get_ident())
        ahead: deque[Proposal] = deque()  # asked with the current batch, not run yet
        try:
            while True:
                # Searches on one point share its budget: the configs any of them stored, and
                # those another one is evaluating right now, count.
                self._refresh()
                busy = {k for k in self._claims_elsewhere().values() if self.plan.is_feasible(k)}
                room = target - self._evaluated_feasible() - len(busy)
                if room <= 0:
                    break
                if (opts.time_budget_s is not None
                        and time.monotonic() - started > opts.time_budget_s):
                    break
                try:
                    if not ahead:
                        ahead.extend(proposer.next_batch(min(strategy.batch, room)))
                        if not ahead:  # the sampler keeps proposing what was done: stop
                            break
                        self.compile_ahead([p.config for p in ahead])
                    proposal = ahead.popleft()
                    if not self._run_trial(study, proposal.trial, proposal.config, target):
                        # The sampler may well propose that config again while it runs
                        # elsewhere (a failed trial teaches it nothing): offer it one nobody has.
                        taken = busy | {proposal.key} | {p.key for p in ahead}
                        other = self.plan.untried(
                            elsewhere_rng, lambda k, t=taken: k in self.results or k in t)
                        if other is not None:
                            proposer.enqueue([other])
                except optuna.exceptions.UpdateFinishedTrialError:
                    # Another search was handed this very trial (on SQLite, Optuna's queue has
                    # no row locks) and finished it; that search stored its result.
                    continue
        finally:
            for p in ahead:  # the budget was reached (or the search stopped) before them
                # (if the database fails now, a later search fails them as stale)
                with contextlib.suppress(Exception):
                    _fail(study, p.trial, "skipped", NOT_RUN)

    def _run_trial(self, study: optuna.Study, trial: optuna.Trial, config: Config,
                   target: int) -> bool:
        """Evaluates the trial's config under a claim, stores the result and tells the study.
        Nothing runs when another search has the config: already stored (the stored value
        answers), or claimed, that is being evaluated now (the trial fails with status
        `claimed`, and this returns False)."""
        key = config_key(config)
        # The claim covers the trial until Optuna has its result: a search starting on this
        # point meanwhile sees a live trial, not a stale one.
        try:
            with Heartbeat(self.ctx.store, self.point_id, trial.number, config_key=key):
                # Stored by another search between this one's refresh and its claim? (A
                # result is stored before its claim is released, so it is visible here.)
                stored = self.ctx.store.result(self.point_id, key)
                if stored is not None:
                    self.results[key] = stored
                    trial.set_user_attr("status", stored.status)
                    trial.set_user_attr("repeat_of", key)
                    # Another search starting on the point may have failed the trial as stale
                    # in the instant between its ask and this claim: the stored result stands.
                    study.tell(trial, self._value(key), skip_if_finished=True)
                    return True
                try:
                    out = self._evaluate(config, trial.number)
                except (KeyboardInterrupt, DeviceLostError) as exc:
                    interrupted = isinstance(exc, KeyboardInterrupt)
                    _fail(study, trial, "interrupted" if interrupted else "crashed",
                          INTERRUPTED if interrupted else str(exc))
                    raise
                self._tell(study, trial, out)
        except ClaimedElsewhere as exc:
            if exc.claim.trial_number != trial.number:  # the trial is ours, its config is not
                _fail(study, trial, "claimed", f"evaluated by another search meanwhile: {exc}")
            return False
        if out.status != "infeasible":
            best = min((self._value(k) for k in self.results), default=math.inf)
            self.progress(self._evaluated_feasible(), target,
                          f"{out.status} best {best:.1f} µs" if best < math.inf else out.status)
        return True

    def _wait_for_others(self) -> None:
        """Waits until the configs other searches are evaluating on this point now are stored,
        so that the winner is picked from every result. Only those: a claim lasts one
        evaluation, and the claim of a process that died goes stale."""
        pending = self._claims_elsewhere()
        while pending:
            self.progress(self._evaluated_feasible(),
                          self.plan.target(self.options.trials),
                          f"waiting for {len(pending)} trial(s) of another search")
            time.sleep(WAIT_POLL_S)
            live = {c.id for c in self.ctx.store.running(self.point_id).values()
                    if not is_stale(c, None)}
            pending = {i: k for i, k in pending.items() if i in live}

    def finish(self) -> PointResult:
        """Re-times the best few beside the default (evaluated first where the point has no
        result of it) and the point's stored winner, if it has one, interleaved; stores the
        fastest as the winner (picked from every stored result of the point, other searches'
        too) and reports the winner the database holds then. A point whose stored winner was
        picked from the results it has now is reported as it is.

        Like with like: the stored winner is replaced only by a pick re-timed beside it in this
        session. Where another search stored a winner meanwhile (two finishing one point at
        once), that one stays and is reported here too (Store.set_winner), so that every search
        shows the winner that is stored and exported."""
        self._wait_for_others()
        self._refresh()
        dkey = config_key(self.default)
        if dkey not in self.results and dkey not in self._claims_elsewhere().values():
            # The default is what every entry is judged by (default_us, `marginal`). A point
            # can reach its budget without it: a search killed while the default ran, resumed.
            self._evaluate(self.default, None)
        seen = self.ctx.store.winner(self.point_id)
        cost = self.spec.cost(self.point)
        res = PointResult(self.point, cost, default_config=self.default,
                          n_evaluated=len(self.results), n_new=self.n_new,
                          statuses=Counter(r.status for r in self.results.values()),
                          compile_s=self.compile_s, compiled_ahead=self.compiled_ahead)
        if seen is not None and self.n_new == 0 and seen.n_evaluated == len(self.results):
            # The stored winner was picked from these very results: a search resumed over
            # finished points (a killed `--points` re-tune) goes on to the unfinished ones
            # instead of compiling and re-timing every finished point's finalists again.
            return _reported(res, seen)
        ok = sorted((r for r in self.results.values() if r.status == "ok" and r.time_us),
                    key=lambda r: r.time_us)
        if not ok:
            return _reported(res, seen)
        finalists = [dict(r.config) for r in ok[: self.options.finalists]]
        default_ok = dkey in self.results and self.results[dkey].status == "ok"
        if default_ok and all(config_key(c) != dkey for c in finalists):
            finalists.append(dict(self.default))
        if seen is not None and all(config_key(c) != config_key(seen.config) for c in finalists):
            finalists.append(dict(seen.config))
        times: dict[str, list[float]] = {config_key(c): [] for c in finalists}
        for r in range(self.options.rounds):
            for c in round_order(finalists, r):
                q = self.evaluator.timing(c)
                if isinstance(q, Outcome):  # it failed this time: left out, with the reason
                    res.retime_failed[config_key(c)] = f"{q.status}: {q.reason}"
                else:
                    times[config_key(c)].append(q[1])
        medians = {k: statistics.median(v) for k, v in times.items() if v}
        if not medians:
            return _reported(res, seen)
        wkey = min(medians, key=medians.__getitem__)
        winner = next(c for c in finalists if config_key(c) == wkey)
        stored = self.ctx.store.set_winner(
            self.point_id, winner, medians[wkey], self.default,
            medians.get(dkey) if default_ok else None, cost.bytes, cost.flops,
            len(self.results), replaces=seen)
        return _reported(res, stored)


def _reported(res: PointResult, stored: WinnerRow | None) -> PointResult:
    """`res` with the point's stored winner (if it has one) as its winner."""
    if stored is not None:
        res.winner, res.time_us = dict(stored.config), stored.time_us
        res.default_us = stored.default_us
    return res
