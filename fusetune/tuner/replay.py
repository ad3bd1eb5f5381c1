"""Replaying search strategies against a point's stored exhaustive grid: no GPU needed.

Each replay is an in-memory Optuna study whose objective is the stored median time of the
proposed config. Configs go through the search's own `Proposer` (canonical configs, repeats
answered for free, nudges in small spaces): pruned configs cost no evaluation and look infinitely
slow to the sampler, failed ones (compile errors, wrong results, ...) cost one evaluation and
look infinitely slow too, exactly as in `fusetune search`. A replay stops when the best config
found so far is within the tightest threshold of the grid's optimum, or at the budget.
"""

from __future__ import annotations

import math
import random
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import optuna

from fusetune.spec import KernelSpec
from fusetune.tuner.grid import StoredGrid
from fusetune.tuner.sampling import Proposer, Strategy, max_asks
from fusetune.tuner.seeds import start_configs
from fusetune.tuner.space import SearchSpace, config_key

THRESHOLDS = (0.02, 0.05, 0.10)  # "within 2%": best <= 1.02 × the grid's optimum
WITHIN_GRID_FRACTION = 0.10  # "reached 2% within 10% of the grid's size"


@dataclass
class ReplayRun:
    strategy: str
    seed: int
    evaluations: int  # when the run stopped
    asks: int
    best_us: float
    reached: dict[float, int | None]  # threshold -> evaluations when first within it
    order: list[str] = field(default_factory=list)  # config keys, in the order evaluated
    sampler_s: float = 0.0  # seconds the run took: the sampler's own time (lookups are free)


class _Tally:
    """Evaluations so far, the best value, and when each threshold was first reached."""

    def __init__(self, optimum: float) -> None:
        self.optimum = optimum
        self.evaluations = 0
        self.best = math.inf
        self.reached: dict[float, int | None] = dict.fromkeys(THRESHOLDS)
        self.order: list[str] = []

    def add(self, key: str, value: float, cost: int) -> None:
        self.evaluations += cost
        if cost:
            self.order.append(key)
        self.best = min(self.best, value)
        for t in THRESHOLDS:
            if self.reached[t] is None and self.best <= self.optimum * (1 + t):
                self.reached[t] = self.evaluations


def replay_once(grid: StoredGrid, space: SearchSpace, spec: KernelSpec, strategy: Strategy,
                seed: int, budget: int, stop_within: float | None = min(THRESHOLDS)
                ) -> ReplayRun:
    """One run of `strategy` against the stored grid, until the best is within `stop_within`
    of the optimum (None: never) or after `budget` evaluations."""
    grid.require_complete()
    started = time.perf_counter()
    tally = _Tally(grid.optimum[1])
    target = min(budget, grid.size)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", sampler=strategy.sampler(seed, target))
    known: dict[str, float] = {}
    proposer = Proposer(study, space, spec, grid.point, grid.plan, known.get,
                        random.Random(seed), max_asks(target), climb=strategy.climb)

    def evaluate(key: str) -> float:
        value, cost = grid.objective(key)
        known[key] = value
        tally.add(key, value, cost)
        return value

    if strategy.seeded:
        starts = start_configs(spec, grid.point, space, grid.plan, grid.default, grid.neighbours)
        for c in proposer.enqueue(starts):  # outside the space: evaluated directly
            evaluate(config_key(c))
    stop_at = -math.inf if stop_within is None else tally.optimum * (1 + stop_within)
    with warnings.catch_warnings():
        # GPSampler fits pruned and failed configs (told +inf) at the worst finite value.
        warnings.filterwarnings("ignore", message="Clip non-finite values")
        while tally.evaluations < budget and tally.best > stop_at:
            batch = proposer.next_batch(strategy.batch)
            if not batch:
                break
            for proposal in batch:  # told one by one, as the search times them
                if tally.evaluations >= budget or tally.best <= stop_at:
                    break
                study.tell(proposal.trial, evaluate(proposal.key))
    return ReplayRun(strategy.name, seed, tally.evaluations, proposer.asks, tally.best,
                     tally.reached, tally.order, time.perf_counter() - started)


@dataclass
class StrategySummary:
    """The runs of one strategy over several seeds."""

    strategy: Strategy
    runs: list[ReplayRun]
    budget: int
    grid_size: int

    def evaluations(self, threshold: float) -> list[int | None]:
        return [r.reached[threshold] for r in self.runs]

    def median(self, threshold: float) -> float | None:
        """Median evaluations to reach `threshold`; None when more than half the runs did not
        reach it within the budget."""
        vals = [math.inf if e is None else float(e) for e in self.evaluations(threshold)]
        m = statistics.median(vals)
        return None if math.isinf(m) else m

    def mean(self, threshold: float) -> tuple[float, bool]:
        """Mean evaluations to reach `threshold`, and whether some runs did not reach it (they
        count as the budget, so the mean is then a lower bound)."""
        vals = self.evaluations(threshold)
        censored = any(e is None for e in vals)
        return statistics.fmean(self.budget if e is None else e for e in vals), censored

    def fraction_within(self, threshold: float, evaluations: float) -> float:
        """Fraction of runs that reached `threshold` within `evaluations`."""
        vals = self.evaluations(threshold)
        return sum(1 for e in vals if e is not None and e <= evaluations) / len(vals)

    @property
    def sampler_s_per_ask(self) -> float:
        """Mean seconds the sampler took to propose a config (repeats included)."""
        asks = sum(r.asks for r in self.runs)
        return sum(r.sampler_s for r in self.runs) / asks if asks else 0.0

    def median_seconds(self, threshold: float, per_evaluation_s: float) -> float | None:
        """Median seconds a search would take to reach `threshold`: its evaluations at
        `per_evaluation_s` each plus the sampler's own time; None as for `median`."""
        vals = [math.inf if r.reached[threshold] is None
                else r.reached[threshold] * per_evaluation_s + r.sampler_s for r in self.runs]
        m = statistics.median(vals)
        return None if math.isinf(m) else m

    @property
    def within_grid_fraction(self) -> float:
        """Fraction of runs within 2% after at most 10% of the grid's configs."""
        return self.fraction_within(min(THRESHOLDS), WITHIN_GRID_FRACTION * self.grid_size)


ReplayProgress = Callable[[str, int], None]  # (strategy, runs done)


def replay_strategies(grid: StoredGrid, space: SearchSpace, spec: KernelSpec,
                      strategies: Sequence[Strategy], seeds: int, budget: int | None = None,
                      progress: ReplayProgress | None = None) -> list[StrategySummary]:
    """Every strategy for seeds 0..seeds-1; `budget` evaluations per run (default: the whole
    grid, so that every run can reach the optimum)."""
    n = budget if budget is not None else grid.size
    out = []
    for strategy in strategies:
        runs = []
        for seed in range(seeds):
            runs.append(replay_once(grid, space, spec, strategy, seed, n))
            if progress is not None:
                progress(strategy.name, seed + 1)
        out.append(StrategySummary(strategy, runs, n, grid.size))
    return out
