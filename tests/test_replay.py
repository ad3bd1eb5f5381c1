"""`fusetune evaluate-search`: the exhaustive grid, and search strategies replayed against it.

Replays are checked on synthetic grids whose answer is known (where the optimum is, how many
evaluations a uniformly random order needs on average); the grid and the command run on
Triton's interpreter at a tiny space (cli_helpers.run_interpreted: in this process where it runs
the interpreter, else in subprocesses).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import random
import statistics
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from cli_helpers import invoke, run_interpreted
from rich.console import Console

from fusetune import cli, gpus
from fusetune.db.store import PointKey, Store
from fusetune.spec import Config, Cost, KernelSpec, Point, Resources
from fusetune.tuner.grid import GridError, Measured, StoredGrid, load_grid
from fusetune.tuner.replay import (
    THRESHOLDS,
    ReplayRun,
    StrategySummary,
    replay_once,
    replay_strategies,
)
from fusetune.tuner.sampling import STRATEGIES, Proposer, Strategy
from fusetune.tuner.search import open_storage
from fusetune.tuner.space import Param, SearchSpace, config_key, make_plan

HAS_SCIPY = importlib.util.find_spec("scipy") is not None

# A tiny rmsnorm space: at dim=256 and one row, 20 distinct configs (BLOCK_D 64 and 128 loop over
# the row, so num_stages matters there; BLOCK_D 256 does the row in one pass).
RMS_SPACE = """\
kernel: rmsnorm
params:
  BLOCK_D: {pow2: [64, 256]}
  ROWS: {pow2: [1, 2]}
  num_warps: {pow2: [1, 8]}
  num_stages: {values: [1, 2]}
"""
RMS_POINT = ("--dim", "256", "--batch", "1", "--seq", "1", "--dtype", "float16")


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "console", Console(highlight=False, width=250))
    monkeypatch.setattr(cli, "err", Console(stderr=True, highlight=False, width=250))


# ---- synthetic grids ---------------------------------------------------------------------------


def synth_spec(canonical: Callable[[Config, Point], Config] | None = None,
               default: Config | None = None) -> KernelSpec:
    """A kernel that never runs: three parameters, more than 1024 threads cannot fit."""
    def unused(*_args: object) -> None:
        raise AssertionError("a replay must not run kernels")

    return KernelSpec(
        name="synth", description="synthetic", dim_names=("dim",),
        config_keys=("A", "B", "num_warps"), pow2_keys=("A", "num_warps"),
        make_inputs=unused, make_outputs=unused, reference=unused, launch=unused,
        default_config=lambda p, g: dict(default or {"A": 1, "B": 1, "num_warps": 16}),
        resources=lambda c, p: Resources(0, 32, 32 * c["num_warps"]),
        cost=lambda p: Cost(1, 1), canonical=canonical or (lambda c, p: dict(c)),
        dims_from_model=lambda m: {"dim": m.dim})


def synth_space(a: tuple[int, ...], b: tuple[int, ...], warps: tuple[int, ...]) -> SearchSpace:
    return SearchSpace("synth", (Param("A", "pow2", a), Param("B", "values", b),
                                 Param("num_warps", "pow2", warps)), "synthetic")


POINT = Point.make("synth", {"dim": 8}, 1, 1, "float16")


def synth_grid(spec: KernelSpec, space: SearchSpace, time_of: Callable[[Config], float | None],
               failed: Callable[[Config], bool] = lambda c: False) -> StoredGrid:
    """Every feasible config stored: `time_of(config)` µs, or a compile error where `failed`."""
    plan = make_plan(space, spec, POINT, gpus.INTERPRETER)
    measured = {config_key(c): Measured("compile_error") if failed(c)
                else Measured("ok", time_of(c), 0.5) for c in plan.feasible}
    default = spec.canonical(spec.default_config(POINT, gpus.INTERPRETER), POINT)
    return StoredGrid(POINT, plan, measured, default)


def bowl(c: Config) -> float:
    """Smooth in log2 space, optimum at A=32, B=3, num_warps=8."""
    a, w = math.log2(c["A"]), math.log2(c["num_warps"])
    return 10 + (a - 5) ** 2 + (c["B"] - 3) ** 2 + (w - 3) ** 2


# ---- replays on synthetic grids ----------------------------------------------------------------


def test_random_needs_n_plus_1_over_k_plus_1_and_pruned_configs_are_free() -> None:
    # 36 raw configs: 12 cannot fit (num_warps=64), 24 are timed; 2 are the best, 10 failed to
    # compile. A uniformly random order of the 24 hits one of the 2 after (24+1)/(2+1) = 8.33
    # evaluations on average. Counting pruned configs as evaluations would give (36+1)/3 = 12.3,
    # treating failed ones as free (14+1)/3 = 5.
    spec = synth_spec()
    space = synth_space((1, 2, 4, 8), (1, 2, 3), (16, 32, 64))
    good = [{"A": 2, "B": 1, "num_warps": 16}, {"A": 8, "B": 3, "num_warps": 32}]
    failed_keys = set(sorted(config_key(c) for c in make_plan(space, spec, POINT, gpus.INTERPRETER)
                             .feasible if c not in good)[:10])
    grid = synth_grid(spec, space, lambda c: 1.0 if c in good else 2.0,
                      lambda c: config_key(c) in failed_keys)
    assert grid.size == 24 and len(grid.plan.infeasible) == 12 and grid.count_within(0.02) == 2
    runs = [replay_once(grid, space, spec, STRATEGIES["random"], seed, grid.size)
            for seed in range(300)]
    hits = [r.reached[0.02] for r in runs]
    assert all(h is not None for h in hits)
    assert abs(statistics.fmean(hits) - 25 / 3) < 1.2, statistics.fmean(hits)
    for r in runs:  # stopped at the hit; only timed configs (failed ones too) are in the order
        assert r.evaluations == r.reached[0.02] == len(r.order) == len(set(r.order))
        assert not set(r.order) & set(grid.plan.infeasible)
        assert r.best_us == 1.0


@pytest.mark.parametrize("name", ["random", "tpe", "fusetune", "fusetune-cold", "fusetune-batch",
                                  "gp"])
def test_every_strategy_reaches_the_known_optimum(name: str) -> None:
    if name == "gp" and not HAS_SCIPY:
        pytest.skip("GPSampler needs scipy")
    spec = synth_spec()
    space = synth_space((1, 2, 4, 8, 16, 32, 64), (1, 2, 3, 4), (4, 8, 16, 32, 64))
    grid = synth_grid(spec, space, bowl)
    assert grid.optimum == ({"A": 32, "B": 3, "num_warps": 8}, 10.0)
    for seed in range(2 if name == "gp" else 4):
        run = replay_once(grid, space, spec, STRATEGIES[name], seed, grid.size)
        r2, r5, r10 = (run.reached[t] for t in THRESHOLDS)
        assert r2 is not None and r10 <= r5 <= r2 == run.evaluations <= grid.size, run
        assert run.best_us <= 10.0 * 1.02
        assert len(run.order) == len(set(run.order)) == run.evaluations


def test_a_batch_holds_distinct_configs_and_repeats_in_it_fail() -> None:
    # 4 configs: a batch of 3 asks until it has 3 distinct ones; a proposal of one already in
    # the batch fails (it has no value yet) and is not evaluated twice
    spec = synth_spec()
    space = synth_space((1, 2), (1, 2), (4,))
    plan = make_plan(space, spec, POINT, gpus.INTERPRETER)
    study = optuna.create_study(sampler=STRATEGIES["fusetune-batch"].sampler(0, 4))
    known: dict[str, float] = {}
    proposer = Proposer(study, space, spec, POINT, plan, known.get, random.Random(0), 100)
    first = proposer.next_batch(3)
    assert len(first) == 3 and len({p.key for p in first}) == 3
    for p in first:
        known[p.key] = 1.0
        study.tell(p.trial, 1.0)
    rest = proposer.next_batch(3)  # one config is left
    assert [p.key for p in rest] == [k for k in map(config_key, plan.feasible) if k not in known]
    failed = study.get_trials(states=(optuna.trial.TrialState.FAIL,))
    assert failed and all(t.user_attrs["status"] == "repeat" for t in failed)
    known[rest[0].key] = 1.0
    study.tell(rest[0].trial, 1.0)
    assert proposer.next_batch(2) == []  # nothing new left: the asks run out


def test_guided_samplers_beat_random_on_a_smooth_landscape() -> None:
    spec = synth_spec()
    space = synth_space((1, 2, 4, 8, 16, 32, 64, 128), (1, 2, 3, 4, 5), (1, 2, 4, 8, 16, 32))
    grid = synth_grid(spec, space, bowl)
    names = ["random", "fusetune-cold"] + (["gp"] if HAS_SCIPY else [])
    summaries = {s.strategy.name: s for s in replay_strategies(
        grid, space, spec, [STRATEGIES[n] for n in names], seeds=6 if HAS_SCIPY else 10)}
    random_median = summaries["random"].median(0.02)
    assert random_median is not None and random_median > 60  # 240 configs, 1 within 2%
    for name in names[1:]:
        median = summaries[name].median(0.02)
        assert median is not None and median < random_median / 2, (name, median)


def test_the_search_strategy_starts_from_the_default_and_the_neighbours_winners() -> None:
    space = synth_space((1, 2, 4, 8, 16, 32, 64), (1, 2, 3, 4), (4, 8, 16, 32))
    best = {"A": 32, "B": 3, "num_warps": 8}
    # The default is the optimum: the search strategy is there at its first evaluation.
    spec = synth_spec(default=best)
    grid = synth_grid(spec, space, bowl)
    seeded = [replay_once(grid, space, spec, STRATEGIES["fusetune"], s, grid.size)
              for s in range(5)]
    assert [r.reached[0.02] for r in seeded] == [1] * 5
    cold = [replay_once(grid, space, spec, STRATEGIES["fusetune-cold"], s, grid.size)
            for s in range(5)]
    assert statistics.fmean(r.reached[0.02] for r in cold) > 3

    # A poor default; a neighbouring point's winner is this point's optimum: second evaluation.
    spec = synth_spec(default={"A": 1, "B": 1, "num_warps": 32})
    grid = synth_grid(spec, space, bowl)
    grid.neighbours = [best, {"A": 1, "B": 4, "num_warps": 4}]
    for seed in range(3):
        run = replay_once(grid, space, spec, STRATEGIES["fusetune"], seed, grid.size)
        assert run.order[:2] == [config_key(grid.default), config_key(best)]
        assert run.reached[0.02] == 2
    # A neighbour's winner that this space cannot hold (A = 512) leads to its nearest config in
    # the space (A = 64), evaluated in its turn.
    grid.neighbours = [{"A": 512, "B": 3, "num_warps": 8}, best]
    for seed in range(3):
        run = replay_once(grid, space, spec, STRATEGIES["fusetune"], seed, grid.size)
        assert run.order[:3] == [config_key(grid.default),
                                 config_key({"A": 64, "B": 3, "num_warps": 8}), config_key(best)]
        assert run.reached[0.02] == 3


def test_configs_outside_the_space_are_reached_through_the_configs_that_collapse_onto_them(
        ) -> None:
    # Canonical configs have A=2, a value the space (A in 4..64) does not hold: the default, the
    # nudges of a sampler that keeps repeating, all go through a config of the space.
    spec = synth_spec(canonical=lambda c, p: {**c, "A": 2}, default={"A": 4, "B": 4,
                                                                     "num_warps": 4})
    space = synth_space((4, 8, 16, 32, 64), (1, 2, 3, 4), (1, 2, 4, 8))
    grid = synth_grid(spec, space, lambda c: 5.0 if c["B"] == 2 and c["num_warps"] == 8 else 9.0)
    assert grid.size == 16 and all(c["A"] == 2 for c in grid.plan.feasible)
    import optuna

    study = optuna.create_study()
    proposer = Proposer(study, space, spec, POINT, grid.plan, {}.get, random.Random(0), 100)
    assert proposer.enqueue([grid.default]) == []  # enqueued, not run outside the study
    first = proposer.next()
    assert first is not None and first.config == {"A": 2, "B": 4, "num_warps": 4}
    for seed in range(3):
        run = replay_once(grid, space, spec, STRATEGIES["fusetune"], seed, grid.size,
                          stop_within=None)
        assert sorted(run.order) == sorted(config_key(c) for c in grid.plan.feasible)


def test_summary_statistics() -> None:
    strategy = STRATEGIES["random"]
    runs = [ReplayRun("random", i, 0, 0, 1.0, {0.02: e, 0.05: e, 0.10: 1}, sampler_s=0.5)
            for i, e in enumerate([1, 3, None, 8])]
    s = StrategySummary(strategy, runs, budget=10, grid_size=30)
    assert s.median(0.02) == 5.5  # median of 1, 3, 8, >10
    assert s.mean(0.02) == (5.5, True)  # (1 + 3 + 10 + 8) / 4, a lower bound
    assert s.mean(0.10) == (1.0, False)
    assert s.within_grid_fraction == 0.5  # 1 and 3 are within 10% of 30 configs
    assert s.median_seconds(0.02, 2.0) == pytest.approx((3 * 2 + 0.5 + 8 * 2 + 0.5) / 2)
    s.runs = runs[2:] + runs[2:3]
    assert s.median(0.02) is None  # two of three runs never got there


def test_an_incomplete_grid_is_refused_with_the_count() -> None:
    spec = synth_spec(default={"A": 1, "B": 1, "num_warps": 4})
    space = synth_space((1, 2, 4), (1, 2), (4, 8))
    grid = synth_grid(spec, space, bowl)
    replay_once(grid, space, spec, STRATEGIES["random"], 0, 12)
    del grid.measured[config_key(grid.plan.feasible[3])]
    with pytest.raises(GridError, match=r"incomplete: 1 of 12 configs .* --grid"):
        replay_once(grid, space, spec, STRATEGIES["random"], 0, 12)
    # The default config is timed too when the space cannot express it (the search runs it).
    spec = synth_spec(default={"A": 1, "B": 1, "num_warps": 16})
    grid = synth_grid(spec, space, bowl)
    assert grid.missing() == [{"A": 1, "B": 1, "num_warps": 16}]
    other = synth_grid(spec, synth_space((16, 32), (1, 2), (4, 8)), bowl)  # another space's
    other.plan, other.kernel_hash = grid.plan, "abc"
    with pytest.raises(GridError, match=r"another space and another version of the kernel"):
        other.require_complete("def")


# ---- the command on stored grids ---------------------------------------------------------------


def run_cli(cwd: Path, *args: str) -> str:
    proc = run_interpreted(cwd, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def rms_setup(tmp_path: Path) -> tuple[KernelSpec, SearchSpace, Path]:
    from fusetune.kernels import get_spec
    from fusetune.tuner.space import load_space

    path = tmp_path / "rms.yaml"
    path.write_text(RMS_SPACE)
    spec = get_spec("rmsnorm")
    return spec, load_space(spec, path), path


def store_synthetic_grid(url: str, spec: KernelSpec, space: SearchSpace, batch: int = 1
                         ) -> tuple[int, Config]:
    """Stores made-up times for every config of the tiny rmsnorm space (as the interpreter's
    results); returns the point id and the fastest config."""
    point = Point.make("rmsnorm", {"dim": 256}, batch, 1, "float16")
    plan = make_plan(space, spec, point, gpus.INTERPRETER)
    store = Store(url)
    pid = store.point_id(PointKey("interpreter", "rmsnorm", {"dim": 256}, batch, 1, "float16",
                                  "", "interpreter", spec.source_hash, "t", "v"))
    times = {config_key(c): 10.0 + i for i, c in enumerate(plan.feasible)}
    best = plan.feasible[7]
    times[config_key(best)] = 5.0
    for c in plan.feasible:
        store.record(pid, config_key(c), c, "ok", time_us=times[config_key(c)], compile_s=0.1)
    return pid, best


def test_replay_of_a_stored_grid_on_the_command_line(sqlite_url: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    spec, space, path = rms_setup(tmp_path)
    pid, best = store_synthetic_grid(sqlite_url, spec, space)
    base = ("evaluate-search", "--kernel", "rmsnorm", "--backend", "interpreter", "--no-grid",
            "--space", str(path), *RMS_POINT, "--db", sqlite_url)
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    r = invoke(*base, "--seeds", "10", "--strategies", "random,fusetune", "--markdown", str(md),
               "--json", str(js))
    assert r.exit_code == 0, r.output
    text = " ".join(f"{k}={v}" for k, v in best.items())
    assert f"optimum: 5.00 µs with {text}" in r.output
    assert "grid: 20 distinct feasible configs" in r.output
    assert "grid wall time: not recorded; compiling and checking: 2 s" in r.output
    for name in ("random", "fusetune"):
        assert f"│ {name}" in r.output
    doc = json.loads(js.read_text())
    (p,) = doc["points"]
    assert p["grid"]["size"] == 20 and p["grid"]["optimum"]["config"] == best
    assert p["point"]["source"] == f"stored point {pid}"
    assert [s["name"] for s in p["strategies"]] == ["random", "fusetune"]
    for s in p["strategies"]:
        assert len(s["runs"]) == 10 and s["budget"] == 20
        assert all(run["reached"]["2%"] is not None for run in s["runs"])
        assert all(run["best_us"] == 5.0 for run in s["runs"])
    assert "| random | 10 |" in md.read_text()

    # gp without scipy: skipped with a message, the rest runs
    import fusetune.tuner.sampling as sampling

    real = sampling.importlib.util.find_spec
    monkeypatch.setattr(sampling.importlib.util, "find_spec",
                        lambda name, *a: None if name == "scipy" else real(name, *a))
    r = invoke(*base, "--seeds", "2", "--strategies", "gp,random", "--json", str(js))
    assert r.exit_code == 0, r.output
    assert "gp skipped: needs scipy, not installed (pip install scipy)" in r.output
    assert [s["name"] for s in json.loads(js.read_text())["points"][0]["strategies"]] == \
        ["random"]
    assert "scipy" in json.loads(js.read_text())["points"][0]["skipped"]["gp"]


def test_replay_errors_name_the_bad_value(sqlite_url: str, tmp_path: Path) -> None:
    spec, space, path = rms_setup(tmp_path)
    pid, _ = store_synthetic_grid(sqlite_url, spec, space)
    base = ("evaluate-search", "--kernel", "rmsnorm", "--backend", "interpreter", "--no-grid",
            "--space", str(path), "--dim", "256", "--seq", "1", "--dtype", "float16",
            "--db", sqlite_url)
    r = invoke(*base, "--batch", "1", "--strategies", "random,bayes")
    assert r.exit_code == 2
    assert "unknown strategy 'bayes'" in r.output and "random, tpe, gp, fusetune" in r.output
    r = invoke(*base, "--batch", "4")
    assert r.exit_code == 1
    assert "no stored point rmsnorm dim=256 b=4 s=1 float16 on interpreter" in r.output
    assert 'interpreter {"dim":256} b=1 s=1 float16' in r.output  # what there is
    store = Store(sqlite_url)
    with store.session() as s:
        from fusetune.db.models import ResultRow

        s.delete(s.query(ResultRow).filter_by(point_id=pid).first())
        s.commit()
    r = invoke(*base, "--batch", "1")
    assert r.exit_code == 1
    assert "incomplete: 1 of 20 configs have no stored result" in r.output


@pytest.mark.slow
def test_grid_resumes_from_stored_results_then_replays(sqlite_url: str, tmp_path: Path) -> None:
    _, _, path = rms_setup(tmp_path)
    point = ("--backend", "interpreter", "--space", str(path), *RMS_POINT, "--db", sqlite_url)
    run_cli(tmp_path, "search", "--kernel", "rmsnorm", *point, "--trials", "5")
    store = Store(sqlite_url)
    ((row, _),) = [(p, None) for p in store.points()]
    before = {k: (r.id, r.time_us) for k, r in store.results(row.id).items()}
    assert len(before) == 5

    js = tmp_path / "r.json"
    cmd = ("evaluate-search", "--kernel", "rmsnorm", *point, "--seeds", "3",
           "--strategies", "random,fusetune", "--json", str(js))
    out = run_cli(tmp_path, *cmd)
    assert "15 timed in" in out  # the 5 configs the search stored are not timed again
    after = store.results(row.id)
    assert len(after) == 20 and all(r.status == "ok" for r in after.values())
    assert {k: (r.id, r.time_us) for k, r in after.items() if k in before} == before
    doc = json.loads(js.read_text())["points"][0]
    assert doc["grid"]["size"] == 20 and doc["grid"]["wall_extrapolated"] is True
    assert min(r.time_us for r in after.values()) == doc["grid"]["optimum"]["time_us"]
    assert [len(s["runs"]) for s in doc["strategies"]] == [3, 3]
    assert len(Store(sqlite_url).winners()) == 1

    out = run_cli(tmp_path, *cmd)  # complete: nothing is timed again
    assert "0 timed in" in out
    assert {k: r.id for k, r in store.results(row.id).items()} == {k: r.id for k, r in
                                                                   after.items()}
    storage = open_storage(sqlite_url)
    attrs = storage.get_study_user_attrs(storage.get_study_id_from_name(row.study_name))
    assert attrs["grid_timed"] == 15 and attrs["grid_eval_s"] > 0


@pytest.mark.slow
def test_the_replayed_search_strategy_is_what_the_search_does(sqlite_url: str,
                                                              tmp_path: Path) -> None:
    """A search that covers the whole space leaves a complete grid; replaying the search's
    strategy with the search's seed on it proposes the same configs in the same order."""
    spec, space, path = rms_setup(tmp_path)
    run_cli(tmp_path, "search", "--kernel", "rmsnorm", "--backend", "interpreter", "--space",
            str(path), *RMS_POINT, "--db", sqlite_url, "--trials", "20", "--seed", "3")
    store = Store(sqlite_url)
    (row,) = store.points()
    results = sorted(store.results(row.id).values(), key=lambda r: r.id)
    searched = [r.config_key for r in results if r.status != "infeasible"]
    assert len(searched) == 20
    grid = load_grid(store, open_storage(sqlite_url), row, spec, space)
    run = replay_once(grid, space, spec, STRATEGIES["fusetune"], 3, grid.size, stop_within=None)
    assert run.order == searched
    other = replay_once(grid, space, spec, STRATEGIES["fusetune"], 4, grid.size,
                        stop_within=None)
    assert other.order != searched  # the comparison can fail


def test_strategies_help_names_the_defaults() -> None:
    from fusetune.tuner.sampling import DEFAULT_STRATEGIES

    r = invoke("evaluate-search", "--help")
    assert r.exit_code == 0
    assert f"Default: {','.join(DEFAULT_STRATEGIES)}." in " ".join(r.output.split())
    for name in STRATEGIES:
        assert name in r.output
    assert isinstance(STRATEGIES["fusetune"], Strategy) and STRATEGIES["fusetune"].seeded


# ---- the climb ---------------------------------------------------------------------------------


def test_neighbours_move_one_parameter_one_step() -> None:
    spec = synth_spec()
    space = synth_space((1, 2, 4, 8), (1, 2, 3), (16, 32, 64))
    plan = make_plan(space, spec, POINT, gpus.INTERPRETER)
    study = optuna.create_study()
    prop = Proposer(study, space, spec, POINT, plan, lambda k: None, random.Random(0), 10)
    got = {config_key(c) for c in prop.neighbours(space.to_params(
        {"A": 2, "B": 1, "num_warps": 32}))}
    want = {config_key(c) for c in ({"A": 1, "B": 1, "num_warps": 32},
                                    {"A": 4, "B": 1, "num_warps": 32},
                                    {"A": 2, "B": 2, "num_warps": 32},
                                    {"A": 2, "B": 1, "num_warps": 16},
                                    {"A": 2, "B": 1, "num_warps": 64})}
    assert got == want  # B=1 has no lower value; never two parameters at once
    # Neighbours that collapse onto the config itself are left out.
    flat = synth_spec(canonical=lambda c, p: {**c, "B": 1})
    prop = Proposer(study, space, flat, POINT, make_plan(space, flat, POINT, gpus.INTERPRETER),
                    lambda k: None, random.Random(0), 10)
    keys = [config_key(c) for c in prop.neighbours(space.to_params(
        {"A": 2, "B": 2, "num_warps": 32}))]
    assert len(keys) == len(set(keys)) == 4


def test_climb_reaches_an_optimum_two_steps_away_through_the_second_best() -> None:
    # From the default (A=4, B=2, num_warps=32) every single step is slower, but A=2 (second
    # best after the default) combined with num_warps=16 is the optimum: a climb from the two
    # best configs gets there after the default's and A=2's neighbourhoods, without the climb
    # TPE needs many more evaluations on this flat landscape.
    default = {"A": 4, "B": 2, "num_warps": 32}
    spec = synth_spec(default=default)
    space = synth_space((1, 2, 4, 8, 16, 32), (1, 2, 3, 4), (4, 8, 16, 32))

    def time_of(c: Config) -> float:
        if c == {"A": 2, "B": 2, "num_warps": 16}:
            return 5.0
        if c == default:
            return 10.0
        return 11.0 if c["A"] == 2 else 12.0 + 0.01 * (c["A"] + c["B"] + c["num_warps"])

    grid = synth_grid(spec, space, time_of)
    runs = [replay_once(grid, space, spec, STRATEGIES["fusetune"], s, grid.size)
            for s in range(5)]
    for r in runs:
        # The default, its 6 neighbours, then at most A=2's 5 new neighbours.
        assert r.reached[0.02] is not None and r.reached[0.02] <= 1 + 6 + 5, r.order
        assert r.order[0] == config_key(default)
    tpe = [replay_once(grid, space, spec, STRATEGIES["fusetune-tpe"], s, grid.size)
           for s in range(5)]
    assert statistics.median(r.reached[0.02] for r in tpe) > 12  # the comparison can fail


def test_a_grid_stored_before_a_flag_existed_replays_with_the_flags_default(
        sqlite_url: str) -> None:
    # The grid's configs were stored without the flag F that the kernel gained later (with
    # default 0): they are today's configs with F = 0, so the grid is still complete.
    spec = synth_spec(default={"A": 4, "B": 1, "num_warps": 8, "F": 0})
    old = synth_space((4, 8), (1, 3), (8,))
    store = Store(sqlite_url)
    pid = store.point_id(PointKey("h100-sxm", "synth", {"dim": 8}, 1, 1, "float16", "",
                                  "interpreter", "k", "3.6", "2.11"))
    for c in make_plan(old, spec, POINT, gpus.INTERPRETER).feasible:
        store.record(pid, config_key(c), c, "ok", time_us=bowl(c))
    flagged = dataclasses.replace(spec, config_keys=(*spec.config_keys, "F"), flags={"F": 0})
    space = SearchSpace("synth", (*old.params, Param("F", "values", (0,))), "synthetic")
    (row,) = store.points()
    grid = load_grid(store, open_storage(sqlite_url), row, flagged, space)
    assert grid.missing() == []
    best, t = grid.optimum
    assert best == {"A": 8, "B": 3, "num_warps": 8, "F": 0} and t == bowl(best)


@pytest.mark.parametrize("when", ["before its attributes", "before its tell"])
def test_a_trial_another_search_finished_first_is_left_to_it(tmp_path: Path, when: str) -> None:
    # On SQLite two searches can be handed the same enqueued trial: when the other one tells it
    # first, this one's answer of a repeat is dropped (its result stands), no error
    spec = synth_spec()
    space = synth_space((1, 2), (1, 2), (4,))
    plan = make_plan(space, spec, POINT, gpus.INTERPRETER)
    url = f"sqlite:///{tmp_path / 'o.db'}"
    study = optuna.create_study(study_name="s", storage=url,
                                sampler=STRATEGIES["fusetune-batch"].sampler(0, 4))
    other = optuna.load_study(study_name="s", storage=url)

    def finish_elsewhere(*_: object) -> None:
        # the other search finishes the trial this one was just handed
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            other.tell(t.number, 2.0)

    def known(key: str) -> float | None:
        if when == "before its attributes":
            finish_elsewhere()
        return 1.0

    on_repeat = finish_elsewhere if when == "before its tell" else None
    proposer = Proposer(study, space, spec, POINT, plan, known, random.Random(0), 3,
                        on_repeat=on_repeat)
    assert proposer.next_batch(2) == []  # every ask a repeat (3 asks), none raised
    assert [t.value for t in study.trials] == [2.0, 2.0, 2.0]  # the other search's results
