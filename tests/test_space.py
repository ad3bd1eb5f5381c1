"""Search spaces: parsing, Optuna round trips, plans pruned by a GPU's limits."""

from __future__ import annotations

import pytest
from optuna.trial import FixedTrial

from fusetune import gpus
from fusetune.kernels import get_spec
from fusetune.spec import Point, check_fits
from fusetune.tuner.space import SpaceError, config_key, load_space, make_plan, parse_space

SPEC = get_spec("rmsnorm")

GOOD = """
kernel: rmsnorm
params:
  BLOCK_D: {pow2: [64, 1024]}
  ROWS: {pow2: [1, 4]}
  num_warps: {values: [8, 2, 4, 2]}
  num_stages: {values: [1, 2]}
"""


def test_load_shipped_space() -> None:
    space = load_space(SPEC)
    assert space.kernel == "rmsnorm"
    assert [p.name for p in space.params] == list(SPEC.config_keys)
    by_name = {p.name: p for p in space.params}
    assert by_name["BLOCK_D"].values == tuple(1 << e for e in range(6, 15))
    assert by_name["BLOCK_D"].kind == "pow2"
    assert by_name["ROWS"].values == (1, 2, 4, 8, 16)
    assert by_name["num_warps"].values == (1, 2, 4, 8, 16, 32)
    assert (by_name["num_stages"].kind, by_name["num_stages"].values) == ("values", (1, 2, 3, 4))
    assert space.size == 9 * 5 * 6 * 4
    assert len(list(space.configs())) == space.size


def test_load_user_space(tmp_path) -> None:
    f = tmp_path / "space.yaml"
    f.write_text(GOOD)
    space = load_space(SPEC, f)
    assert space.source == str(f)
    assert space.size == 5 * 3 * 3 * 2
    assert {p.name: p.values for p in space.params}["num_warps"] == (2, 4, 8)
    with pytest.raises(SpaceError, match="does not exist"):
        load_space(SPEC, tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (GOOD.replace("{values: [1, 2]}", "{choice: [1, 2]}"),
         r"num_stages: unknown kind 'choice'; valid: pow2, values, range"),
        (GOOD.replace("[64, 1024]", "[48, 1024]"), r"BLOCK_D: pow2 needs .*\[48, 1024\]"),
        (GOOD.replace("[64, 1024]", "[1024, 64]"), r"BLOCK_D: pow2 needs .*lo <= hi"),
        (GOOD.replace("  num_stages: {values: [1, 2]}\n", ""),
         r"params are BLOCK_D, ROWS, num_warps; a rmsnorm space has exactly .*num_stages"),
        (GOOD + "  SPLIT: {values: [1]}\n", r"params are .*SPLIT"),
        (GOOD.replace("kernel: rmsnorm", "kernel: layernorm"),
         r"kernel is 'layernorm', expected 'rmsnorm'"),
        (GOOD.replace("{values: [8, 2, 4, 2]}", "{values: [3, 4]}"),
         r"num_warps must hold powers of two"),
        (GOOD.replace("{values: [1, 2]}", "{values: []}"), r"num_stages: values needs"),
        ("params: [1, 2", r"not valid YAML"),
    ],
    ids=["unknown-kind", "pow2-not-pow2", "pow2-reversed", "missing-param", "extra-param",
         "wrong-kernel", "values-not-pow2", "empty-values", "bad-yaml"],
)
def test_parse_space_errors(text: str, match: str) -> None:
    with pytest.raises(SpaceError, match=match):
        parse_space(text, SPEC, "my-space.yaml")


def test_parse_space_error_names_source() -> None:
    with pytest.raises(SpaceError, match=r"^my-space\.yaml: "):
        parse_space(GOOD.replace("kernel: rmsnorm", "kernel: x"), SPEC, "my-space.yaml")


def test_suggest_to_params_from_params_round_trip() -> None:
    space = load_space(SPEC)
    config = {"BLOCK_D": 256, "ROWS": 4, "num_warps": 8, "num_stages": 2}
    params = space.to_params(config)
    assert params == {"log2_BLOCK_D": 8, "log2_ROWS": 2, "log2_num_warps": 3, "num_stages": 2}
    assert space.suggest(FixedTrial(params)) == config
    assert space.from_params(params) == config


def test_round_trip_over_the_whole_space() -> None:
    space = load_space(SPEC)
    seen = set()
    for config in space.configs():
        params = space.to_params(config)
        assert params is not None
        assert space.suggest(FixedTrial(params)) == config
        assert space.from_params(params) == config
        seen.add(config_key(config))
    assert len(seen) == space.size


@pytest.mark.parametrize(
    "config",
    [
        {"BLOCK_D": 32, "ROWS": 1, "num_warps": 4, "num_stages": 1},  # below the pow2 range
        {"BLOCK_D": 64, "ROWS": 1, "num_warps": 4, "num_stages": 5},  # not among the values
        {"BLOCK_D": 64, "ROWS": 32, "num_warps": 4, "num_stages": 1},
    ],
)
def test_to_params_outside_space_is_none(config: dict[str, int]) -> None:
    assert load_space(SPEC).to_params(config) is None


def test_config_key_is_order_independent() -> None:
    a = config_key({"ROWS": 1, "BLOCK_D": 64})
    assert a == config_key({"BLOCK_D": 64, "ROWS": 1}) == '{"BLOCK_D":64,"ROWS":1}'


def _plan(gpu: str, d: int = 4096, batch: int = 1, seq: int = 512, dtype: str = "float16"):
    point = Point.make("rmsnorm", {"dim": d}, batch, seq, dtype)
    spec = gpus.resolve(gpu)
    return make_plan(load_space(SPEC), SPEC, point, spec), spec, point


def test_plan_3090_prunes_more_than_h100_for_smem() -> None:
    p3090, g3090, point = _plan("3090")
    ph100, _, _ = _plan("h100")
    assert g3090.smem_per_block == 101376
    assert len(p3090.infeasible) > len(ph100.infeasible)
    assert p3090.pruned_reasons["smem>101376B"] > 0
    assert any("shared-memory" in why for why in p3090.infeasible.values())
    assert not any(k.startswith("smem") for k in ph100.pruned_reasons)
    # the same space, only the limits differ
    assert p3090.distinct == ph100.distinct
    assert sum(p3090.pruned_reasons.values()) == len(p3090.infeasible)
    for config in p3090.feasible:
        res = SPEC.resources(config, point)
        assert res.smem_bytes <= g3090.smem_per_block
        assert check_fits(res, g3090) is None
    for key in p3090.infeasible:
        assert key not in {config_key(c) for c in p3090.feasible}


def test_plan_collapses_equivalent_configs() -> None:
    plan, _, point = _plan("h100")
    assert plan.raw_size == load_space(SPEC).size == 1080
    assert plan.distinct < plan.raw_size
    keys = [config_key(c) for c in plan.feasible] + list(plan.infeasible)
    assert len(keys) == len(set(keys)) == plan.distinct
    for config in plan.feasible:
        assert SPEC.canonical(config, point) == config
    # at rows=1 ROWS collapses to 1 and single-pass stages to 1:
    # 6 looping BLOCK_D x 4 stages + 1 single-pass, x 6 warps
    small, _, _ = _plan("h100", batch=1, seq=1)
    assert small.distinct == (6 * 4 + 1) * 6


def test_plan_small_dim_has_few_distinct_configs() -> None:
    plan, _, _ = _plan("interpreter", d=64, batch=1, seq=1)
    # BLOCK_D collapses to 64 (single pass), ROWS to 1, stages to 1: only num_warps varies
    assert plan.distinct == 6
    assert sorted(c["num_warps"] for c in plan.feasible) == [1, 2, 4, 8, 16, 32]


def test_flags_may_be_left_out_of_a_space() -> None:
    # A matmul space written before a flag existed keeps working: the flag keeps its default.
    from fusetune.kernels import get_spec

    ffn = get_spec("ffn")
    text = """kernel: ffn
params:
  BLOCK_M: {values: [16]}
  BLOCK_N: {values: [64]}
  BLOCK_K: {values: [64]}
  GROUP_M: {values: [1]}
  PASSES: {values: [1, 2]}
  SPLIT_K: {values: [1]}
  num_warps: {values: [4]}
  num_stages: {values: [3]}
"""
    space = parse_space(text, ffn, "old.yaml")
    values = {p.name: p.values for p in space.params}
    assert all(values[flag] == (default,) for flag, default in ffn.flags.items())
    assert space.size == 2
    with pytest.raises(SpaceError, match=r"UNROLL_K, SPREAD, THREAD_SUM, TMA, UNFUSED may be "
                                         r"left out"):
        parse_space(text.replace("  num_stages: {values: [3]}\n", ""), ffn, "old.yaml")


def test_same_as_keys_take_zero_and_may_be_left_out() -> None:
    # moe's DOWN_N, DOWN_K, DOWN_WARPS: 0 is launch 1's value; left out, they keep it
    moe = get_spec("moe")
    text = """kernel: moe
params:
  BLOCK_M: {values: [1]}
  BLOCK_N: {values: [16]}
  BLOCK_K: {values: [64]}
  num_warps: {values: [4]}
  num_stages: {values: [1]}
  DOWN_N: {values: [0, 8]}
"""
    values = {p.name: p.values for p in parse_space(text, moe, "m.yaml").params}
    assert values["DOWN_N"] == (0, 8) and values["DOWN_K"] == (0,)
    assert values["DOWN_WARPS"] == (0,) and values["UNFUSED"] == (0,)
    with pytest.raises(SpaceError, match=r"DOWN_N: values needs a non-empty list of 0 or "
                                         r"positive integers, got \[-8\]"):
        parse_space(text.replace("[0, 8]", "[-8]"), moe, "m.yaml")
    with pytest.raises(SpaceError, match="BLOCK_N: values needs a non-empty list of positive"):
        parse_space(text.replace("BLOCK_N: {values: [16]}", "BLOCK_N: {values: [0]}"), moe,
                    "m.yaml")
    ranged = {p.name: p.values for p in parse_space(
        text.replace("DOWN_N: {values: [0, 8]}", "DOWN_K: {range: [0, 64, 32]}"), moe,
        "m.yaml").params}
    assert ranged["DOWN_K"] == (0, 32, 64) and ranged["DOWN_N"] == (0,)
    with pytest.raises(SpaceError, match="integers with 0 <= lo <= hi"):
        parse_space(text.replace("DOWN_N: {values: [0, 8]}", "DOWN_K: {range: [-1, 64]}"), moe,
                    "m.yaml")


def test_a_sampled_plan_answers_as_the_enumerated_one() -> None:
    # The same point planned both ways (the rmsnorm space is small enough to enumerate): every
    # config gets the same verdict, and what the sampled plan says reaches a config does.
    import random

    from fusetune.tuner.space import SampledPlan

    plan, gpu, point = _plan("3090", d=3000, batch=2, seq=37)
    sampled = SampledPlan(load_space(SPEC), SPEC, point, gpu, sample=200)
    assert sampled.drawn == 200 and 0 < len(sampled.sampled_feasible) <= len(plan.feasible)
    assert sum(sampled.draw_reasons.values()) > 0  # the 3090 prunes some of the space
    for config in plan.feasible:
        key = config_key(config)
        assert sampled.pruned(key) is None and sampled.is_feasible(key)
        raw = sampled.raw_of(key)
        assert raw is None or config_key(SPEC.canonical(raw, point)) == key
    for key, why in plan.infeasible.items():
        assert sampled.pruned(key) == why and not sampled.is_feasible(key)
    # Few trials: the sample shows the space has them; more than the space holds: enumerated.
    assert sampled.target(5) == 5
    assert sampled.target(10_000) == len(plan.feasible) < 10_000
    rng = random.Random(1)
    tried = {config_key(c) for c in plan.feasible[1:]}
    assert sampled.untried(rng, tried.__contains__) == plan.feasible[0]
    assert sampled.untried(rng, lambda key: True) is None


def test_a_search_samples_a_space_of_millions() -> None:
    import random

    from fusetune.tuner.space import ENUMERATE_LIMIT, Plan, SampledPlan, search_plan

    ffn = get_spec("ffn")
    space = load_space(ffn)
    point = Point.make("ffn", {"dim": 4096, "hidden": 11008}, 16, 1, "bfloat16")
    gpu = gpus.resolve("h100")
    assert space.size > ENUMERATE_LIMIT
    plan = search_plan(space, ffn, point, gpu)
    assert isinstance(plan, SampledPlan) and plan.target(40) == 40
    assert isinstance(search_plan(load_space(SPEC), SPEC, point, gpu), Plan)
    rng = random.Random(0)
    for _ in range(20):
        c = plan.untried(rng, lambda key: False)
        assert c is not None and ffn.canonical(c, point) == c
        assert check_fits(ffn.resources(c, point), gpu) is None
    default = ffn.canonical(ffn.default_config(point, gpu), point)
    assert plan.is_feasible(config_key(default))
    too_big = {**default, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 512, "num_stages": 5,
               "PASSES": 2, "THREAD_SUM": 0, "SPREAD": 0, "UNROLL_K": 0, "SPLIT_K": 1}
    key = config_key(ffn.canonical(too_big, point))
    assert plan.pruned(key) is not None and not plan.is_feasible(key)
