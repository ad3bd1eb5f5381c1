"""The winner of a point: what a finishing search prints is what the database holds and exports,
when two searches finish one point at once and when a later search finishes it again."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from fusetune import export, gpus
from fusetune.db.store import Store
from fusetune.kernels import get_spec
from fusetune.spec import Config, Point
from fusetune.tuner.bench import Outcome
from fusetune.tuner.search import open_storage
from fusetune.tuner.space import config_key, load_space, make_plan
from fusetune.tuner.study import Context, PointResult, PointTuner, SearchOptions

SPEC = get_spec("rmsnorm")
SPACE = load_space(SPEC)
POINT = Point.make("rmsnorm", {"dim": 64}, 3, 1, "float16")
DEFAULT = SPEC.canonical(SPEC.default_config(POINT, gpus.INTERPRETER), POINT)
CONFIGS = [c for c in make_plan(SPACE, SPEC, POINT, gpus.INTERPRETER).feasible
           if config_key(c) != config_key(DEFAULT)][:6]


class BiasedTimer:
    """A device whose re-timings favour one config (as run-to-run noise may): `favourite`
    takes 5 µs, the others 8 µs, the default 10 µs. With a barrier, its first re-timing waits
    until every finishing search has started re-timing: their finishes overlap."""

    def __init__(self, favourite: Config, barrier: threading.Barrier | None = None) -> None:
        self.favourite, self.barrier = config_key(favourite), barrier

    def set_point(self, point: Point, seed: int) -> None:
        pass

    def timing(self, config: Config) -> tuple[float, float, float]:
        if self.barrier is not None:
            self.barrier.wait(timeout=60)
            self.barrier = None
        key = config_key(config)
        t = 5.0 if key == self.favourite else 10.0 if key == config_key(DEFAULT) else 8.0
        return t, t, t

    def close(self) -> None:
        pass



def tuner(url: str, worker: BiasedTimer) -> PointTuner:
    ctx = Context(SPEC, SPACE, gpus.INTERPRETER, "interpreter", "cpu", Store(url),
                  open_storage(url), "t", "v", worker)  # type: ignore[arg-type]
    return PointTuner(ctx, POINT, SearchOptions(finalists=3, rounds=1))


@pytest.fixture
def url(db_url: str) -> str:
    """A database (SQLite, PostgreSQL) holding the point's results: three configs and the
    default, all correct."""
    url = db_url
    t = tuner(url, BiasedTimer(CONFIGS[0]))
    for i, c in enumerate([*CONFIGS[:3], DEFAULT]):
        t.ctx.store.record(t.point_id, config_key(c), c, "ok", time_us=6.0 + i)
    return url


def stored(url: str) -> tuple[str, float, float | None]:
    ((_, w),) = Store(url).winners()
    return config_key(w.config), w.time_us, w.default_us


def shown(res: PointResult) -> tuple[str, float | None, float | None]:
    assert res.winner is not None
    return config_key(res.winner), res.time_us, res.default_us


def exported(url: str) -> str:
    ((entry,),) = [es for kernels in export.build_tables(Store(url))["gpus"].values()
                   for es in kernels.values()]
    return config_key(entry["config"])


def in_threads(*calls: Callable[[], PointResult]) -> list[PointResult]:
    out: list[PointResult | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    assert all(r is not None for r in out)
    return out  # type: ignore[return-value]


def test_two_searches_finishing_one_point_at_once_show_the_stored_winner(url: str) -> None:
    # Each device's re-timing favours another config: each search would print its own.
    barrier = threading.Barrier(2)
    a = tuner(url, BiasedTimer(CONFIGS[0], barrier))
    b = tuner(url, BiasedTimer(CONFIGS[1], barrier))
    res_a, res_b = in_threads(a.finish, b.finish)
    assert shown(res_a) == shown(res_b) == stored(url)
    assert stored(url)[0] in (config_key(CONFIGS[0]), config_key(CONFIGS[1]))
    assert exported(url) == stored(url)[0]


def test_a_later_search_replaces_the_winner_only_where_it_beat_it_beside_its_own(
        url: str) -> None:
    first = tuner(url, BiasedTimer(CONFIGS[0])).finish()
    assert shown(first) == stored(url) == (config_key(CONFIGS[0]), 5.0, 10.0)
    # A later search that found nothing new (a killed search resumed over its finished
    # points) reports the stored winner: the winner was picked from these very results.
    again = tuner(url, BiasedTimer(CONFIGS[2])).finish()
    assert shown(again) == stored(url) == (config_key(CONFIGS[0]), 5.0, 10.0)
    # One with a new result re-times the stored winner beside its finalists: its pick is stored.
    later = tuner(url, BiasedTimer(CONFIGS[2]))
    later.ctx.store.record(later.point_id, config_key(CONFIGS[3]), CONFIGS[3], "ok",
                           time_us=20.0)
    assert shown(later.finish()) == stored(url) == (config_key(CONFIGS[2]), 5.0, 10.0)
    assert exported(url) == config_key(CONFIGS[2])


def test_a_later_search_re_times_the_stored_winner_beside_its_finalists(url: str) -> None:
    tuner(url, BiasedTimer(CONFIGS[0])).finish()
    # Configs whose first timing beat the winner's: the later search's finalists. The stored
    # winner is re-timed beside them, still the fastest, and stays.
    later = tuner(url, BiasedTimer(CONFIGS[0]))
    for i, c in enumerate(CONFIGS[3:]):
        later.ctx.store.record(later.point_id, config_key(c), c, "ok", time_us=1.0 + i)
    assert shown(later.finish()) == stored(url) == (config_key(CONFIGS[0]), 5.0, 10.0)


class RecordingTimer(BiasedTimer):
    def __init__(self, favourite: Config) -> None:
        super().__init__(favourite)
        self.order: list[str] = []

    def timing(self, config: Config) -> tuple[float, float, float]:
        self.order.append(config_key(config))
        return super().timing(config)


def test_each_re_timing_round_starts_one_finalist_further_on(url: str) -> None:
    # A timing can depend on what ran just before it: over the rounds each finalist takes
    # each place once, instead of the same one every round.
    timer = RecordingTimer(CONFIGS[0])
    t = tuner(url, timer)
    t.options = SearchOptions(finalists=3, rounds=3)
    t.finish()
    first = timer.order[:4]  # the three fastest results and the default
    assert len(timer.order) == 12 and len(set(first)) == 4
    assert timer.order[4:8] == first[1:] + first[:1]
    assert timer.order[8:] == first[2:] + first[:2]


class EvaluatingTimer(BiasedTimer):
    """BiasedTimer that also evaluates configs (checked and timed once), and counts them."""

    def __init__(self, favourite: Config) -> None:
        super().__init__(favourite)
        self.evaluated: list[str] = []

    def evaluate(self, config: Config) -> Outcome:
        self.evaluated.append(config_key(config))
        t = self.timing(config)[0]
        return Outcome("ok", time_us=t, p20_us=t, p80_us=t)


def test_a_point_that_reached_its_budget_without_the_default_has_it_timed_at_the_finish(
        db_url: str) -> None:
    # A search killed while the default ran, resumed once the point had its budget: the
    # default was never stored. The winner must still be judged against it.
    timer = EvaluatingTimer(CONFIGS[0])
    t = tuner(db_url, timer)
    for i, c in enumerate(CONFIGS[:3]):
        t.ctx.store.record(t.point_id, config_key(c), c, "ok", time_us=6.0 + i)
    res = t.finish()
    assert timer.evaluated == [config_key(DEFAULT)]
    assert shown(res) == stored(db_url) == (config_key(CONFIGS[0]), 5.0, 10.0)
    assert Store(db_url).results(t.point_id)[config_key(DEFAULT)].status == "ok"
    # Stored now: a later finish does not evaluate it again.
    tuner(db_url, timer).finish()
    assert timer.evaluated == [config_key(DEFAULT)]
