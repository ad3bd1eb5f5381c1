"""How configs are picked: the samplers a study can use, and the ask loop around them.

`SEARCH_STRATEGY` is what `fusetune search` runs (`BATCH_SEARCH_STRATEGY` when it compiles
ahead). `fusetune evaluate-search` replays them and the other strategies against stored timings
through the same `Proposer` and the same sampler factories, so that what is measured there is
what the search does.
"""

from __future__ import annotations

import importlib.util
import math
import random
import warnings
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from fusetune.spec import Config, KernelSpec, Point
from fusetune.tuner.space import PointPlan, SearchSpace, config_key

# Repeats in a row (the sampler proposing configs already known) before an untried config is
# enqueued: small spaces get covered instead of sampled again and again.
REPEATS_BEFORE_NUDGE = 3
# Configs asked at a time by a search that compiles ahead (--compile-workers): they compile in
# parallel while the GPU times them one by one; the sampler sees their results after the batch.
SEARCH_BATCH = 4
# A climbing strategy expands the neighbourhoods of the best configs so far, best first, this
# many of them: an optimum two steps from the default can lie beyond the second best, where one
# parameter pays only together with another (a smaller BLOCK_K with more stages).
CLIMB_FROM = 2


def max_asks(target: int) -> int:
    """Asks after which a study that keeps proposing known configs is stopped."""
    return 20 * target + 100


def _search_sampler(seed: int, target: int) -> optuna.samplers.BaseSampler:
    # Multivariate TPE models the tile sizes jointly (they interact through shared memory and
    # occupancy); few random start-up trials because the default and neighbours' winners are
    # enqueued first and the budget is small. The constant liar counts the trials still
    # running (a batch asked ahead, other searches' trials) as bad, so the configs asked
    # together differ; with no trial running it changes nothing.
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                      n_startup_trials=max(4, min(10, target // 4)))


@dataclass(frozen=True)
class Strategy:
    """A way of choosing configs: an Optuna sampler, whether the study starts from the
    default config and the neighbouring points' winners, and how many configs are asked at a
    time (the sampler learns their results only after the whole batch)."""

    name: str
    description: str
    make: Callable[[int, int], optuna.samplers.BaseSampler]  # (seed, target evaluations)
    seeded: bool = False
    needs: tuple[str, ...] = ()  # modules the sampler imports when it runs
    batch: int = 1
    climb: bool = False  # the best config's one-step neighbours first (see Proposer)

    def missing(self) -> list[str]:
        """The modules this strategy needs that are not installed."""
        return [m for m in self.needs if importlib.util.find_spec(m) is None]

    def sampler(self, seed: int, target: int) -> optuna.samplers.BaseSampler:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return self.make(seed, target)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("random", "optuna RandomSampler",
             lambda seed, _n: optuna.samplers.RandomSampler(seed=seed)),
    Strategy("tpe", "optuna TPESampler with its defaults (multivariate since optuna 5.0)",
             lambda seed, _n: optuna.samplers.TPESampler(seed=seed)),
    Strategy("gp", "optuna GPSampler (Gaussian process; needs torch and scipy)",
             lambda seed, _n: optuna.samplers.GPSampler(seed=seed), needs=("torch", "scipy")),
    Strategy("fusetune", "what `fusetune search` does: the default config and the nearest "
             "points' winners first, then a climb through the one-step neighbours of the best "
             f"{CLIMB_FROM} configs so far, then multivariate TPE", _search_sampler, seeded=True,
             climb=True),
    Strategy("fusetune-tpe", "fusetune without the climb: the start configs, then multivariate "
             "TPE", _search_sampler, seeded=True),
    Strategy("fusetune-cold", "the search's sampler alone: no start configs, no climb",
             _search_sampler),
    Strategy("fusetune-batch", "what `fusetune search` does when it compiles ahead: "
             f"fusetune, with {SEARCH_BATCH} configs asked at a time", _search_sampler,
             seeded=True, batch=SEARCH_BATCH, climb=True),
)}
SEARCH_STRATEGY = STRATEGIES["fusetune"]  # one config at a time
BATCH_SEARCH_STRATEGY = STRATEGIES["fusetune-batch"]  # with compile workers
DEFAULT_STRATEGIES = ("random", "tpe", "gp", "fusetune", "fusetune-batch")


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


@dataclass
class Proposal:
    trial: optuna.trial.Trial
    config: Config
    key: str


class Proposer:
    """Asks a study for configs the way the search does, until it gets one not known yet.

    Suggested configs are made canonical for the point. A config whose value is known (done
    before, or pruned) is answered at once with that value: a repeat costs no evaluation. After
    `REPEATS_BEFORE_NUDGE` repeats in a row an untried feasible config, chosen at random, is
    enqueued. `known(key)` is the objective value of a config (None if not known yet); the caller
    evaluates each proposal and tells the study. `on_repeat(trial, key)` may annotate the trial
    of a repeat before it is told. `next_batch(n)` asks for n distinct configs at once.

    With `climb`, whenever nothing is enqueued, the untried feasible one-step neighbours (each
    parameter moved to its next value up or down, one at a time) of the best config so far whose
    neighbours were not enqueued yet, among the CLIMB_FROM best, are enqueued: a best-first
    climb from the start configs. Once the CLIMB_FROM best configs' neighbours are all known,
    the sampler proposes.
    """

    def __init__(self, study: optuna.Study, space: SearchSpace, spec: KernelSpec, point: Point,
                 plan: PointPlan, known: Callable[[str], float | None], rng: random.Random,
                 limit: int, on_repeat: Callable[[optuna.Trial, str], None] | None = None,
                 climb: bool = False) -> None:
        self.study, self.space, self.spec, self.point, self.plan = study, space, spec, point, plan
        self.known, self.rng, self.limit, self.on_repeat = known, rng, limit, on_repeat
        self.climb = climb
        self._climbed: set[str] = set()  # configs whose neighbours were enqueued
        self.asks = 0
        self._repeats = 0
        self._waiting = {
            # An enqueued trial keeps its parameters in system_attrs until it is asked for.
            config_key(self._canonical(t.system_attrs.get("fixed_params") or t.params))
            for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        }

    def _canonical(self, params: dict[str, int]) -> Config:
        return self.spec.canonical(self.space.from_params(params), self.point)

    def params_of(self, config: Config) -> dict[str, int] | None:
        """Optuna parameters that reach `config` (itself or a config of the space that
        collapses onto it), or None if the space cannot express it."""
        params = self.space.to_params(config)
        if params is None:
            raw = self.plan.raw_of(config_key(config))
            params = None if raw is None else self.space.to_params(raw)
        return params

    def enqueue(self, configs: Iterable[Config]) -> list[Config]:
        """Enqueues the configs that are neither known nor waiting, in order; returns those the
        space cannot express (the caller evaluates them directly)."""
        direct: list[Config] = []
        for c in configs:
            key = config_key(c)
            if self.known(key) is not None or key in self._waiting:
                continue
            params = self.params_of(c)
            if params is None:
                direct.append(c)
                continue
            self.study.enqueue_trial(params)
            self._waiting.add(key)
        return direct

    def neighbours(self, params: dict[str, int]) -> list[Config]:
        """The distinct configs one step away from the config of Optuna `params`: each
        parameter moved to its next value up or down, made canonical; itself left out."""
        own = config_key(self._canonical(params))
        out: dict[str, Config] = {}
        for p in self.space.params:
            values = ([v.bit_length() - 1 for v in p.values] if p.kind == "pow2"
                      else list(p.values))
            i = values.index(params[p.optuna_name])
            for j in (i - 1, i + 1):
                if 0 <= j < len(values):
                    c = self._canonical({**params, p.optuna_name: values[j]})
                    if (key := config_key(c)) != own:
                        out.setdefault(key, c)
        return list(out.values())

    def _climb(self, pending: Collection[str]) -> None:
        """Enqueues the untried feasible neighbours of the best config so far, once per best
        config (see the class)."""
        done = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.value is not None and math.isfinite(t.value)]
        if not done:
            return
        names = {p.optuna_name for p in self.space.params}
        seen: set[str] = set()
        for t in sorted(done, key=lambda t: t.value):
            if set(t.params) != names:
                continue
            key = config_key(self._canonical(t.params))
            if key in seen:
                continue
            seen.add(key)
            if len(seen) > CLIMB_FROM:
                return
            if key in self._climbed:
                continue
            self._climbed.add(key)
            todo = [c for c in self.neighbours(t.params)
                    if self.plan.pruned(k := config_key(c)) is None and k not in pending
                    and self.known(k) is None]
            if self.enqueue(todo) or todo:
                return

    def _nudge(self, pending: Collection[str] = ()) -> None:
        choice = self.plan.untried(
            self.rng, lambda key: self.known(key) is not None or key in pending)
        if choice is not None:
            params = self.params_of(choice)
            if params is not None:
                self.study.enqueue_trial(params)

    def next(self, pending: Collection[str] = ()) -> Proposal | None:
        """The next config to evaluate, or None once `limit` asks brought nothing new.
        `pending`: keys of configs proposed already and not evaluated yet (a batch); a trial
        proposing one of them again fails, as it has no value to be told yet."""
        while self.asks < self.limit:
            if self.climb and not self._waiting:
                self._climb(pending)
            self.asks += 1
            trial = self.study.ask()
            config = self.spec.canonical(self.space.suggest(trial), self.point)
            key = config_key(config)
            self._waiting.discard(key)
            try:
                trial.set_user_attr("config", config)
                if key in pending:
                    trial.set_user_attr("repeat_of", key)
                    trial.set_user_attr("status", "repeat")
                    self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
                else:
                    value = self.known(key)
                    if value is None:
                        self._repeats = 0
                        return Proposal(trial, config, key)
                    # Never redone: the known value answers (repeats happen in small spaces).
                    trial.set_user_attr("repeat_of", key)
                    if self.on_repeat is not None:
                        self.on_repeat(trial, key)
                    self.study.tell(trial, value, skip_if_finished=True)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # another search was handed this very enqueued trial (on SQLite, Optuna's
                # queue has no row locks) and finished it first: its result stands
            self._repeats += 1
            if self._repeats >= REPEATS_BEFORE_NUDGE:
                self._nudge(pending)
                self._repeats = 0
        return None

    def next_batch(self, n: int) -> list[Proposal]:
        """Up to `n` proposals of distinct configs, asked one after the other before any is
        told (fewer once `limit` asks brought nothing new)."""
        out: list[Proposal] = []
        keys: set[str] = set()
        while len(out) < n:
            proposal = self.next(keys)
            if proposal is None:
                break
            out.append(proposal)
            keys.add(proposal.key)
        return out
