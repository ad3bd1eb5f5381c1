"""A search on several devices at once (`fusetune search --devices`), without GPUs: the devices
are injected as contexts, each with its own worker — in-process fakes with deterministic timings
(to compare with a one-device search exactly), or interpreter worker subprocesses."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner
from old_schema import create_first_results_table
from optuna.trial import TrialState
from rich.console import Console

from fusetune import cli, gpus
from fusetune.db.store import Store
from fusetune.gpus import GpuNotFoundError, VisibleGpu, match_device_name, select_devices
from fusetune.kernels import get_spec
from fusetune.spec import Config, Point
from fusetune.tuner import study
from fusetune.tuner.bench import Outcome
from fusetune.tuner.devices import DeviceSearch, PointQueue
from fusetune.tuner.search import open_storage
from fusetune.tuner.space import config_key, load_space, make_plan
from fusetune.tuner.study import (
    INTERRUPTED,
    Context,
    PointResult,
    PointTuner,
    Progress,
    SearchOptions,
)
from fusetune.tuner.worker import Worker

SPEC = get_spec("rmsnorm")
SPACE = load_space(SPEC)
# Feasible configs per point on the interpreter at dim 64, in this order: 6, 18, 12, 24.
POINTS = [Point.make("rmsnorm", {"dim": 64}, b, s, "float16") for s in (1, 2) for b in (1, 3)]


@pytest.fixture(autouse=True)
def _quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device finishing a point looks this often whether the other devices' trials there
    ended (study.WAIT_POLL_S, 0.5 s, allows for other processes and hosts): the devices here
    are threads of this process, a poll costs them a few queries. The same code runs, it waits
    less. (CLAIM_DELAY_S stays: the instant between a device's ask and its claim can take
    longer than a fraction of a second on a loaded machine.)"""
    monkeypatch.setattr(study, "WAIT_POLL_S", 0.02)


def fake_us(point: Point, config: Config) -> float:
    """A config's time at a point: deterministic, distinct, the same on every device."""
    return 10.0 + zlib.crc32(f"{point.label} {config_key(config)}".encode()) % 10_000 / 100


class FakeWorker:
    """Stands in for a device's worker process: every config is right, its time `fake_us`.
    Evaluations are logged (device, point, config key) to catch any config run twice."""

    def __init__(self, device: str, log: list[tuple[str, str, str]], delay_s: float = 0.005
                 ) -> None:
        self.device, self.log, self.delay_s = device, log, delay_s
        self.cancel: threading.Event | None = None
        self.point: Point | None = None
        self.closed = False

    def set_point(self, point: Point, seed: int) -> None:
        self.point = point

    def _wait(self) -> None:
        time.sleep(self.delay_s)
        if self.cancel is not None and self.cancel.is_set():
            raise KeyboardInterrupt("the search is stopping")

    def evaluate(self, config: Config) -> Outcome:
        assert self.point is not None
        self._wait()
        self.log.append((self.device, self.point.label, config_key(config)))
        t = fake_us(self.point, config)
        return Outcome("ok", time_us=t, p20_us=t, p80_us=t, rel_err=0.0, compile_s=0.0)

    def timing(self, config: Config) -> tuple[float, float, float]:
        assert self.point is not None
        self._wait()
        t = fake_us(self.point, config)
        return t, t, t

    def close(self) -> None:
        self.closed = True


def contexts(url: str, workers: Sequence[object]) -> list[Context]:
    """One context per device ("dev:0", ...): its own Store, Optuna storage and worker."""
    return [Context(SPEC, SPACE, gpus.INTERPRETER, "interpreter", f"dev:{i}", Store(url),
                    open_storage(url), "t", "v", w)  # type: ignore[arg-type]
            for i, w in enumerate(workers)]


def fake_search(url: str, n_devices: int, points: Sequence[Point], trials: int,
                log: list[tuple[str, str, str]], delay_s: float = 0.005) -> DeviceSearch:
    workers = [FakeWorker(f"dev:{i}", log, delay_s) for i in range(n_devices)]
    return DeviceSearch(contexts(url, workers), points, SearchOptions(trials=trials, rounds=1))


def stored(url: str) -> dict[tuple[int, int], dict[str, tuple[str, float | None, str | None]]]:
    """(batch, seq) -> config key -> (status, µs, device), from the database."""
    store = Store(url)
    return {(p.batch, p.seq): {k: (r.status, r.time_us, r.device)
                               for k, r in store.results(p.id).items()}
            for p in store.points()}


def winners(url: str) -> dict[tuple[int, int], str]:
    return {(p.batch, p.seq): config_key(w.config) for p, w in Store(url).winners()}


def target(point: Point, trials: int) -> int:
    return min(trials, len(make_plan(SPACE, SPEC, point, gpus.INTERPRETER).feasible))


def test_queue_hands_out_each_point_once_then_joins_open_ones() -> None:
    q = PointQueue(POINTS[:2])
    a, b = q.take("a"), q.take("b")
    assert a is not None and b is not None
    assert (a.index, a.joined, b.index, b.joined) == (0, False, 1, False)
    c = q.take("c")  # every point started: joins the earliest with the fewest devices
    assert c is not None and (c.index, c.joined) == (0, True)
    d = q.take("c")
    assert d is not None and (d.index, d.joined) == (1, True)
    assert q.take("c") is None  # joined both already
    q.sampled(1)
    j = q.take("a")  # its own point 0 is not joinable by it; point 1 is picking its winner
    assert j is None
    assert q.take("d") is not None and q.take("d") is None


@pytest.mark.slow
def test_two_devices_pick_the_winners_of_one(tmp_path: Path) -> None:
    # Spaces covered whole (trials above every point's size): whatever the order the configs
    # are run in, the results and winners of two devices must be those of one.
    log1: list[tuple[str, str, str]] = []
    log2: list[tuple[str, str, str]] = []
    one, two = f"sqlite:///{tmp_path}/one.db", f"sqlite:///{tmp_path}/two.db"
    points = POINTS[:3]  # 6, 18 and 12 configs
    res1 = fake_search(one, 1, points, 40, log1).run()
    search = fake_search(two, 2, points, 40, log2)
    res2 = search.run()
    # every point finished once, in the grid's order, with the same winner
    assert [r.point for r in res2] == points
    assert [(r.point, r.winner, r.n_evaluated) for r in res2] == \
        [(r.point, r.winner, r.n_evaluated) for r in res1]
    assert winners(two) == winners(one) and len(winners(two)) == len(points)
    # the same results, each config evaluated once, by one device
    s1, s2 = stored(one), stored(two)
    assert {p: set(r) for p, r in s2.items()} == {p: set(r) for p, r in s1.items()}
    assert max(Counter((p, k) for _, p, k in log2).values()) == 1
    assert len(log2) == len(log1) == sum(len(r) for r in s2.values())
    # both devices got work; the database says which device ran each config
    devices = Counter(d for r in s2.values() for (_, _, d) in r.values())
    assert set(devices) == {"dev:0", "dev:1"}, devices
    assert devices == Counter(d for d, _, _ in log2)
    assert {s.device: s.evaluated for s in search.stats.values()} == dict(devices)
    assert sum(s.points for s in search.stats.values()) == len(points)
    assert all(w.closed for w in (c.worker for c in search.contexts))  # type: ignore[union-attr]


def test_contexts_kept_open_serve_another_search(tmp_path: Path) -> None:
    # close_contexts=False: the caller's contexts (their workers) outlive the run, for the
    # next search on them (`search --kernel all`: one search per kernel and dims).
    url = f"sqlite:///{tmp_path}/ft.db"
    log: list[tuple[str, str, str]] = []
    workers = [FakeWorker(f"dev:{i}", log) for i in range(2)]
    ctxs = contexts(url, workers)
    for points in (POINTS[:2], POINTS[2:]):
        search = DeviceSearch(ctxs, points, SearchOptions(trials=3, rounds=1),
                              close_contexts=False)
        assert [r.point for r in search.run()] == points
        assert not any(w.closed for w in workers)
    assert len(winners(url)) == len(POINTS)
    assert {d for d, _, _ in log} == {"dev:0", "dev:1"}


def test_each_winner_is_the_best_stored_result(tmp_path: Path) -> None:
    # Sampled spaces: two devices may sample other configs than one (a point may start before
    # its neighbours' winners exist), but the selection is the same: the fastest stored config.
    url = f"sqlite:///{tmp_path}/ft.db"
    log: list[tuple[str, str, str]] = []
    trials = 5
    results = fake_search(url, 2, POINTS, trials, log).run()
    by_label = stored(url)
    assert len(results) == len(POINTS)
    for res in results:
        rows = by_label[(res.point.batch, res.point.seq)]
        best = min(rows, key=lambda k: rows[k][1] or float("inf"))
        assert res.winner is not None and config_key(res.winner) == best
        assert target(res.point, trials) <= len(rows) <= target(res.point, trials) + 1
    assert max(Counter((p, k) for _, p, k in log).values()) == 1



def test_a_free_device_joins_a_point_without_running_a_config_twice(db_url: str) -> None:
    # One point, three devices: the two that find no point to start join the first one's.
    # Every config runs once (the claims of one process's threads are live for each other),
    # the budget is shared, and the device that took the point picks the winner.
    url = db_url
    log: list[tuple[str, str, str]] = []
    point = Point.make("rmsnorm", {"dim": 64}, 3, 2, "float16")  # 24 feasible configs
    trials = 20
    search = fake_search(url, 3, [point], trials, log, delay_s=0.15)
    (res,) = search.run()
    assert max(Counter(k for _, _, k in log).values()) == 1, Counter(k for _, _, k in log)
    assert trials <= len(log) <= trials + 2
    ran = Counter(d for d, _, _ in log)
    assert len(ran) == 3, ran  # the two others joined and ran configs too
    assert sorted((s.points, s.joined) for s in search.stats.values()) == [(0, 1), (0, 1),
                                                                          (1, 0)]
    rows = next(iter(stored(url).values()))
    assert res.winner is not None
    assert config_key(res.winner) == min(rows, key=lambda k: rows[k][1] or float("inf"))
    assert len(winners(url)) == 1
    storage = open_storage(url)
    study = optuna.load_study(study_name=Store(url).points()[0].study_name, storage=storage)
    assert not study.get_trials(states=(TrialState.RUNNING,))


def test_a_trial_failed_as_stale_meanwhile_keeps_the_stored_result(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A device's trial finds its config's result stored by another device; while it notes
    # that, a third device starting on the point fails the trial as stale (it looked
    # unclaimed). The first device goes on: the stored result stands, nothing is raised.
    log: list[tuple[str, str, str]] = []
    (ctx,) = contexts(db_url, [FakeWorker("dev:0", log)])
    point = POINTS[0]
    tuner = PointTuner(ctx, point, SearchOptions(trials=4, rounds=1))
    config = make_plan(SPACE, SPEC, point, gpus.INTERPRETER).feasible[0]
    tuner.evaluate(config)
    study = optuna.create_study(storage=ctx.storage, study_name=tuner.key.study_name,
                                direction="minimize", load_if_exists=True)
    trial = study.ask()
    note = trial.set_user_attr

    def note_then_fail(key: str, value: object) -> None:
        note(key, value)
        if key == "repeat_of":
            study.tell(trial.number, state=TrialState.FAIL)

    monkeypatch.setattr(trial, "set_user_attr", note_then_fail)
    assert tuner._run_trial(study, trial, config, 4)
    assert len(log) == 1  # evaluated once, by `evaluate`
    assert study.trials[trial.number].state == TrialState.FAIL
    assert config_key(config) in Store(db_url).results(tuner.point_id)


def test_contexts_are_checked(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ft.db"
    log: list[tuple[str, str, str]] = []
    ctxs = contexts(url, [FakeWorker("x", log), FakeWorker("y", log)])
    ctxs[1].device = ctxs[0].device
    with pytest.raises(ValueError, match="devices given twice: dev:0"):
        DeviceSearch(ctxs, POINTS, SearchOptions())
    ctxs[1].device, ctxs[1].worker = "dev:1", None
    with pytest.raises(ValueError, match=r"dev:1: .* worker process per device"):
        DeviceSearch(ctxs, POINTS, SearchOptions())


# ---- interpreter workers (subprocesses), as `search --devices` runs them ----------------------


@pytest.fixture
def interpreter_workers() -> Iterator[list[Worker]]:
    workers = [Worker("rmsnorm", "interpreter", "cpu", timeout_s=120) for _ in range(2)]
    yield workers
    for w in workers:
        w.close()


def study_trials(url: str) -> dict[str, list[optuna.trial.FrozenTrial]]:
    storage = open_storage(url)
    return {p.study_name: optuna.load_study(study_name=p.study_name, storage=storage)
            .get_trials() for p in Store(url).points()}


@pytest.mark.slow
def test_two_interpreter_workers_share_the_points(db_url: str,
                                                  interpreter_workers: list[Worker]) -> None:
    url = db_url
    trials = 8
    search = DeviceSearch(contexts(url, interpreter_workers), POINTS,
                          SearchOptions(trials=trials, rounds=1))
    results = search.run()
    assert [r.point for r in results] == POINTS
    store = Store(url)
    assert len(store.winners()) == len(POINTS)
    devices: Counter[str | None] = Counter()
    for p in store.points():
        rows = store.results(p.id)
        point = Point.make("rmsnorm", {"dim": 64}, p.batch, p.seq, "float16")
        assert target(point, trials) <= len(rows) <= target(point, trials) + 1
        assert all(r.status == "ok" for r in rows.values()), rows
        devices.update(r.device for r in rows.values())
    assert set(devices) == {"dev:0", "dev:1"}, devices
    for name, trials_ in study_trials(url).items():
        assert not [t for t in trials_ if t.state == TrialState.RUNNING], name
        # one evaluation per config: the trials told a measured value name each config once
        measured = Counter(config_key(t.user_attrs["config"]) for t in trials_
                           if t.state == TrialState.COMPLETE and "repeat_of" not in t.user_attrs)
        assert measured and max(measured.values()) == 1, measured.most_common(3)
    assert all(store.running(p.id) == {} for p in store.points())
    for res in results:  # the winner is one of the point's correct stored results
        pid = store.point_id(search.contexts[0].key(res.point))
        assert res.winner is not None and config_key(res.winner) in store.results(pid)


def test_results_of_an_earlier_version_get_the_device_column(db_url: str) -> None:
    from fusetune.db.store import PointKey

    # ft_results as it was made before it had a device column
    create_first_results_table(db_url)

    store = Store(db_url)
    pid = store.point_id(PointKey("h200", "rmsnorm", {"dim": 8}, 1, 1, "float16", "", "cuda",
                                  "h", "t", "v"))
    store.record(pid, "a", {"A": 1}, "ok", time_us=1.0, device="cuda:1")
    store.record(pid, "b", {"A": 2}, "infeasible")
    assert {k: r.device for k, r in Store(db_url).results(pid).items()} == {"a": "cuda:1",
                                                                            "b": None}


# ---- choosing the devices: `--devices` --------------------------------------------------------

H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def visible(*names: str) -> list[VisibleGpu]:
    out = []
    for i, name in enumerate(names):
        spec = match_device_name(name)
        assert spec is not None
        out.append(VisibleGpu(i, name, spec))
    return out


def test_select_devices_all_and_indices() -> None:
    three = visible(H100, H100, H100)
    assert [g.index for g in select_devices("all", None, three)] == [0, 1, 2]
    assert [g.index for g in select_devices(" 2, 0,2 ", None, three)] == [2, 0]
    assert [g.index for g in select_devices("all", "h100", visible(A100, H100, H100))] == [1, 2]
    assert [g.index for g in select_devices("ALL", None, three[:1])] == [0]  # one GPU: as today


@pytest.mark.parametrize(("devices", "gpu", "seen", "expected"), [
    ("0,x", None, (H100,), ["--devices '0,x'", "'all'", "0,1"]),
    ("-1", None, (H100,), ["--devices '-1'", "indices"]),
    ("", None, (H100,), ["--devices ''"]),
    ("0,3,5", None, (H100, H100), ["devices 3, 5 not visible", "cuda:0 'NVIDIA H100 80GB HBM3' "
                                   "(h100-sxm), cuda:1"]),
    ("all", None, (H100, A100), ["different GPU models (a100-80gb, h100-sxm)", "cuda:0 "
                                 f"'{H100}' (h100-sxm), cuda:1 '{A100}' (a100-80gb)",
                                 "--gpu NAME --devices all"]),
    ("1,0", None, (H100, A100), ["different GPU models", "a100-80gb", "h100-sxm"]),
    ("0,1", "a100", (H100, A100), ["not a100-80gb: cuda:0", "h100-sxm"]),
    ("all", "h200", (H100, A100), ["no visible h200", "visible GPUs: cuda:0"]),
    ("all", None, (), ["no CUDA GPU is visible", "without --devices"]),
])
def test_select_devices_errors_name_what_is_there(devices: str, gpu: str | None,
                                                  seen: tuple[str, ...],
                                                  expected: list[str]) -> None:
    with pytest.raises((ValueError, GpuNotFoundError)) as info:
        select_devices(devices, gpu, visible(*seen))
    for text in expected:
        assert text in str(info.value), str(info.value)


@pytest.fixture
def wide_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "console", Console(highlight=False, width=200))
    monkeypatch.setattr(cli, "err", Console(stderr=True, highlight=False, width=200))


def search_cli(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "rmsnorm", "--db", "sqlite://",
                                      *args])
    # a clean message, not a traceback
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r.exit_code, r.output


@pytest.mark.parametrize(("args", "seen", "expected"), [
    (["--backend", "interpreter", "--devices", "0,1"], (H100, H100),
     ["--devices 0,1 selects CUDA devices", "interpreter backend", "leave out --devices"]),
    (["--devices", "all"], (), ["no CUDA GPU is visible", "without --devices"]),
    (["--devices", "0,2"], (H100, H100), ["device 2 not visible", "cuda:0", "cuda:1"]),
    (["--devices", "all"], (H100, A100), ["different GPU models (a100-80gb, h100-sxm)"]),
    (["--devices", "0,1", "--gpu", "h100"], (H100, A100), ["not h100-sxm: cuda:1"]),
    # the same model on every device: selected, then refused only because this process runs
    # Triton's interpreter
    (["--devices", "all"], (H100, H100), ["TRITON_INTERPRET is set"]),
])
def test_search_devices_errors(monkeypatch: pytest.MonkeyPatch, wide_cli: None,
                               args: list[str], seen: tuple[str, ...],
                               expected: list[str]) -> None:
    monkeypatch.setattr(gpus, "visible_gpus", lambda: visible(*seen))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code, output = search_cli(*args)
    assert code != 0
    for text in expected:
        assert text in output, output


def test_search_devices_dry_run_plans_without_devices(wide_cli: None) -> None:
    code, output = search_cli("--devices", "all", "--gpu", "h100", "--dry-run", "--dim", "64",
                              "--batch", "1", "--seq", "1", "--dtype", "float16")
    assert code == 0, output
    assert "--devices all is ignored with --dry-run" in output
    assert "Plan for rmsnorm on h100-sxm" in output


class StopAfter:
    """A display that stops the search after `n` trials have finished, on any device: with
    `stop()`, or as Ctrl-C does (SIGINT, which Python turns into KeyboardInterrupt in the main
    thread, the one waiting in `run`)."""

    def __init__(self, n: int, how: str) -> None:
        self.n, self.how, self.seen, self.search = n, how, 0, None
        self.lock = threading.Lock()

    def start(self, device: str, point: Point, joined: bool) -> Progress:
        def update(done: int, total: int, msg: str) -> None:
            with self.lock:
                self.seen += 1
                if self.seen == self.n:
                    if self.how == "sigint":
                        os.kill(os.getpid(), signal.SIGINT)
                    else:
                        assert self.search is not None
                        self.search.stop()
        return update

    def done(self, device: str, point: Point, result: PointResult | None) -> None:
        pass


@contextlib.contextmanager
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as in a terminal, for the block: a process started in
    the background by a shell without job control inherits SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stop", "sigint"])
def test_stopping_leaves_the_database_resumable(tmp_path: Path, how: str,
                                                interpreter_workers: list[Worker]) -> None:
    url = f"sqlite:///{tmp_path}/ft.db"
    trials = 8
    display = StopAfter(5, how)
    search = DeviceSearch(contexts(url, interpreter_workers), POINTS,
                          SearchOptions(trials=trials, rounds=1), display)
    display.search = search  # type: ignore[assignment]
    t0 = time.monotonic()
    with ctrl_c_raises(), pytest.raises(KeyboardInterrupt):
        search.run()
    assert time.monotonic() - t0 < 120
    store = Store(url)
    before = {p.id: store.results(p.id) for p in store.points()}
    n_before = sum(len(r) for r in before.values())
    # stopped at once: beyond the 5 trials, at most one that each other device just finished
    assert 5 <= n_before <= 5 + len(interpreter_workers) - 1, n_before
    # a stopped evaluation is no result: nothing recorded as crashed or timed out
    assert {r.status for rows in before.values() for r in rows.values()} == {"ok"}
    for trials_ in study_trials(url).values():
        assert not [t for t in trials_ if t.state == TrialState.RUNNING]
        for t in trials_:
            if t.state == TrialState.FAIL and t.user_attrs.get("status") == "interrupted":
                assert t.user_attrs["reason"] == INTERRUPTED
    assert all(store.running(p.id) == {} for p in store.points())
    # the same search again: resumes, keeps what was stored, finishes every point
    workers = [Worker("rmsnorm", "interpreter", "cpu", timeout_s=120) for _ in range(2)]
    try:
        results = DeviceSearch(contexts(url, workers), POINTS,
                               SearchOptions(trials=trials, rounds=1)).run()
    finally:
        for w in workers:
            w.close()
    assert len(results) == len(POINTS) and all(r.winner for r in results)
    for pid, rows in before.items():
        after = store.results(pid)
        assert {k: r.id for k, r in rows.items()} == {k: after[k].id for k in rows}
    assert len(store.winners()) == len(POINTS)


def test_one_device_tuner_records_its_device(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ft.db"
    log: list[tuple[str, str, str]] = []
    (ctx,) = contexts(url, [FakeWorker("dev:0", log)])
    res = PointTuner(ctx, POINTS[0], SearchOptions(trials=3, rounds=1)).run()
    assert res.winner is not None
    assert {d for (_, _, d) in next(iter(stored(url).values())).values()} == {"dev:0"}


# ---- on a machine with two GPUs or more (`pytest -m gpu`) -------------------------------------


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
def test_a_worker_runs_on_its_own_device() -> None:
    # The worker's kernels must launch on its device, not on the process's default one.
    if cuda_devices() < 2:
        pytest.skip("needs two CUDA devices")
    last = cuda_devices() - 1
    point = Point.make("rmsnorm", {"dim": 4096}, 4, 16, "float16")
    config = SPEC.default_config(point, gpus.visible_gpus()[last].spec)
    w = Worker("rmsnorm", "cuda", f"cuda:{last}", timeout_s=300)
    try:
        w.set_point(point, 0)
        out = w.evaluate(config)
        assert out.status == "ok", out
        q = w.timing(config)
        assert not isinstance(q, Outcome), q
    finally:
        w.close()


@pytest.mark.gpu
def test_search_on_every_device(tmp_path: Path) -> None:
    import subprocess
    import sys

    if cuda_devices() < 2:
        pytest.skip("needs two CUDA devices")
    url = f"sqlite:///{tmp_path}/ft.db"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "fusetune.cli", "search", "--kernel", "rmsnorm", "--dim", "4096",
         "--batch", "1,4,16,64", "--seq", "1", "--dtype", "float16", "--trials", "6",
         "--devices", "all", "--db", url],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = stored(url)
    assert len(s) == 4 and len(winners(url)) == 4
    devices = {d for rows in s.values() for (_, _, d) in rows.values()} - {None}
    # each device took a point at least (with more devices than points, the others joined)
    assert devices <= {f"cuda:{i}" for i in range(cuda_devices())}, devices
    assert len(devices) >= min(cuda_devices(), 4), devices


@pytest.mark.slow
def test_search_devices_command_end_to_end(monkeypatch: pytest.MonkeyPatch, wide_cli: None,
                                           tmp_path: Path) -> None:
    # `search --devices` as the command runs it, with the device layer swapped for two CPU
    # "devices" (interpreter workers): progress, the summary and what each device did.
    from fusetune.tuner.search import Target

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(cli, "choose_target", lambda *a: Target(
        "interpreter", gpus.INTERPRETER, "cpu:0", devices=("cpu:0", "cpu:1")))
    url = f"sqlite:///{tmp_path}/ft.db"
    r = CliRunner().invoke(cli.main, [
        "search", "--kernel", "rmsnorm", "--devices", "0,1", "--dim", "64", "--batch", "1,3",
        "--seq", "1,2", "--dtype", "float16", "--trials", "4", "--trial-timeout", "120",
        "--db", url])
    assert r.exit_code == 0, r.output
    assert "on 2× interpreter (cpu:0, cpu:1, interpreter)" in r.output, r.output
    assert "Winners on interpreter" in r.output
    per_device = re.search(r"Per device: cpu:0 (\d) points, joined \d+, (\d+) configs run; "
                           r"cpu:1 (\d) points, joined \d+, (\d+) configs run", r.output)
    assert per_device, r.output
    points0, run0, points1, run1 = map(int, per_device.groups())
    assert points0 + points1 == 4 and points0 and points1
    s = stored(url)
    assert len(s) == 4 and len(winners(url)) == 4
    assert Counter(d for rows in s.values() for (_, _, d) in rows.values()) == \
        {"cpu:0": run0, "cpu:1": run1}
