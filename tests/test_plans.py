"""The points' plans made ahead in spawned processes (tuner/plans.py) are the plans a tuner
would make itself."""

from __future__ import annotations

import dataclasses

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
