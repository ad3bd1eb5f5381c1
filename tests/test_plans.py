"""The points' plans made ahead in spawned processes (tuner/plans.py) are the plans a tuner
would make itself."""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from pathlib import Path

import pytest

from fusetune import gpus
from fusetune.kernels import get_spec
from fusetune.kernels._spec import Point
from fusetune.tuner.plans import PlansAhead
from fusetune.tuner.space import load_space, make_plan


def _same(a: object, b: object) -> bool:
    return (a.feasible == b.feasible and a.infeasible == b.infeasible  # type: ignore[attr-defined]
            and a.representative == b.representative  # type: ignore[attr-defined]
            and a.pruned_reasons == b.pruned_reasons)  # type: ignore[attr-defined]


def test_plans_made_in_other_processes_match_and_are_shared() -> None:
    spec = get_spec("rmsnorm")
    space = load_space(spec)
    gpu = gpus.resolve("h100")
    points = [Point.make("rmsnorm", {"dim": d}, 1, s, "float16") for d, s in ((4096, 1),
                                                                               (3000, 37))]
    plans = PlansAhead(space, spec, points, gpu, processes=2)
    try:
        assert plans.parallel
        for p in points:
            plan = plans.get(p)
            assert plan.point == p
            assert _same(plan, make_plan(space, spec, p, gpu))
            assert plans.get(p) is plan  # a device joining the point reuses it
        other = Point.make("rmsnorm", {"dim": 128}, 2, 3, "float32")  # not given: made here
        assert _same(plans.get(other), make_plan(space, spec, other, gpu))
    finally:
        plans.close()


def test_a_spec_a_fresh_process_cannot_look_up_plans_here() -> None:
    spec = dataclasses.replace(get_spec("rmsnorm"))  # equal, but not the registered object
    space = load_space(spec)
    gpu = gpus.resolve("h100")
    points = [Point.make("rmsnorm", {"dim": 64}, 1, s, "float32") for s in (1, 5)]
    plans = PlansAhead(space, spec, points, gpu, processes=4)
    assert not plans.parallel
    assert _same(plans.get(points[1]), make_plan(space, spec, points[1], gpu))
    plans.close()


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not). Read from /proc: the pool's own thread
    may reap a worker first, after which multiprocessing's is_alive() stays True."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_close_ends_the_processes_still_planning() -> None:
    # A search stopped in its first seconds must not wait at exit for plans nobody will read
    # (an ffn point's plan takes seconds of CPU).
    from fusetune import models

    spec = get_spec("ffn")
    dims = spec.dims_from_model(models.preset("llama-2-7b"))
    points = [Point.make("ffn", dims, b, 1, "float16") for b in (1, 16)]
    plans = PlansAhead(load_space(spec), spec, points, gpus.resolve("h100"), processes=2)
    children = multiprocessing.active_children()
    assert plans.parallel
    assert children, "the pool started no process"
    t0 = time.monotonic()
    plans.close()
    for proc in children:
        proc.join(timeout=8)  # returns at once where another thread reaped it
        assert not _running(proc.pid), f"{proc} still planning after close()"
    elapsed = time.monotonic() - t0
    assert elapsed < 8, f"close() took {elapsed:.1f} s"  # planning one takes 10-20 s
    assert not plans.parallel
