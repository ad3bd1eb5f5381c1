"""Where a study starts: the default, and the winners of the nearest tuned points (stored in the
database or in the lookup tables, other dims included), moved into the space where they lie
outside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_replay import synth_spec

import fusetune
from fusetune import gpus
from fusetune.db.store import PointKey, Store
from fusetune.kernels import get_spec
from fusetune.spec import Point
from fusetune.tuner.seeds import (
    neighbour_winners,
    point_distance,
    start_configs,
    weights_distance,
)
from fusetune.tuner.space import Param, SearchSpace, config_key, load_space, make_plan, search_plan

FFN = {"dim": 4096, "hidden": 11008}
A100 = "a100-80gb"


def key(dims: dict[str, int], batch: int = 1, seq: int = 1, dtype: str = "float16",
        weights: str = "", backend: str = "cuda", gpu: str = "h100-sxm") -> PointKey:
    return PointKey(gpu, "ffn", dims, batch, seq, dtype, weights, backend, "k", "3.6", "2.11")


def stored_winner(store: Store, k: PointKey, block_n: int) -> int:
    pid = store.point_id(k)
    store.set_winner(pid, {"BLOCK_N": block_n}, 1.0, {"BLOCK_N": 0}, None, 1, 1, 1)
    return pid


def test_point_distance_counts_factors_of_two_in_rows_dims_and_another_dtype() -> None:
    assert point_distance(FFN, 1, "float16", FFN, 1, "float16") == 0
    assert point_distance(FFN, 1, "float16", FFN, 16, "float16") == 4
    assert point_distance(FFN, 4096, "float16", FFN, 1, "float16") == 12
    wider = {"dim": 4096, "hidden": 22017}  # 1 + hidden twice as large
    assert point_distance(FFN, 1, "float16", wider, 1, "float16") == pytest.approx(1.0)
    assert point_distance(FFN, 1, "float16", FFN, 1, "bfloat16") == 1
    # qkv's interleaved flag (0 or 1) keeps the two layouts apart.
    qkv = {"dim": 4096, "head_dim": 128, "interleaved": 1, "n_heads": 32, "n_kv_heads": 32}
    assert point_distance(qkv, 1, "float16", {**qkv, "interleaved": 0}, 1, "float16") == 1
    assert point_distance(FFN, 1, "float16", {"dim": 4096}, 1, "float16") is None


def test_neighbours_come_nearest_first_from_other_rows_and_other_dims(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    me = key(FFN)
    own = stored_winner(store, me, 99)
    stored_winner(store, key(FFN, batch=16), 16)  # distance 4
    stored_winner(store, key({"dim": 4096, "hidden": 14336}), 3)  # distance 0.38
    stored_winner(store, key(FFN, seq=4096), 128)  # distance 12 > MAX_DISTANCE: too far
    stored_winner(store, key(FFN, weights="fp8-e4m3"), 7)  # FP8 for 16-bit weights: never
    stored_winner(store, key(FFN, gpu=A100), 5)  # another GPU: never
    got = neighbour_winners(store, me, own, limit=5, use_tables=False)
    assert got == [{"BLOCK_N": 3}, {"BLOCK_N": 16}]
    assert neighbour_winners(store, me, own, limit=1, use_tables=False) == [{"BLOCK_N": 3}]
    # Another stored version of this very shape: the search takes it, a replay does not.
    stored_winner(store, PointKey("h100-sxm", "ffn", FFN, 1, 1, "float16", "", "cuda", "old",
                                  "3.5", "2.10"), 42)
    assert neighbour_winners(store, me, own, limit=1, use_tables=False) == [{"BLOCK_N": 42}]
    assert neighbour_winners(store, me, own, limit=1, use_tables=False,
                             same_shape=False) == [{"BLOCK_N": 3}]


def test_points_without_an_optional_dim_are_near_those_with_it(sqlite_url: str) -> None:
    # qkv's plain points (qk_norm left out: 0) seed those with q/k norms at the same dims, one
    # apart, and the reverse; without optional_dims their dims have other names.
    store = Store(sqlite_url)
    plain = {"dim": 4096, "head_dim": 128, "interleaved": 0, "n_heads": 32, "n_kv_heads": 8}
    normed = {**plain, "qk_norm": 1}
    optional = get_spec("qkv").optional_dims
    assert optional == {"qk_norm": 0}

    def qkv(dims: dict[str, int], rows: int) -> PointKey:
        return PointKey("h100-sxm", "qkv", dims, rows, 1, "float16", "", "cuda", "k", "3.6",
                        "2.11")

    stored_winner(store, qkv(plain, 1), 16)
    stored_winner(store, qkv(normed, 64), 64)  # 6 apart: farther
    me = qkv(normed, 1)
    assert neighbour_winners(store, me, None, use_tables=False) == [{"BLOCK_N": 64}]
    assert neighbour_winners(store, me, None, use_tables=False,
                             optional_dims=optional) == [{"BLOCK_N": 16}, {"BLOCK_N": 64}]
    assert neighbour_winners(store, qkv(plain, 4), None, use_tables=False,
                             optional_dims=optional) == [{"BLOCK_N": 16}, {"BLOCK_N": 64}]


def test_among_equally_near_points_the_one_of_more_rows_seeds_first(sqlite_url: str) -> None:
    # 64 rows lie 6 factors of two from both 1 and 4096 rows: the 4096-row winner comes first
    # (as the lookup rounds up), whichever was stored first.
    store = Store(sqlite_url)
    stored_winner(store, key(FFN, seq=4096), 4096)
    stored_winner(store, key(FFN), 1)
    me = key(FFN, batch=64)
    assert neighbour_winners(store, me, None, limit=1, use_tables=False) == [{"BLOCK_N": 4096}]
    assert neighbour_winners(store, me, None, limit=2, use_tables=False) == [
        {"BLOCK_N": 4096}, {"BLOCK_N": 1}]


def test_the_other_fp8_format_seeds_an_fp8_point_one_step_farther(
        sqlite_url: str, tmp_path: Path, fresh_tables: None) -> None:
    assert weights_distance("fp8-e5m2", "fp8-e5m2") == 0
    assert weights_distance("fp8-e5m2", "fp8-e4m3") == 1
    assert weights_distance("fp8-e5m2", "") is None
    assert weights_distance("", "fp8-e4m3") is None
    store = Store(sqlite_url)
    e5m2 = key(FFN, weights="fp8-e5m2")
    own = store.point_id(e5m2)
    stored_winner(store, key(FFN, weights="fp8-e4m3"), 7)  # distance 1
    stored_winner(store, key(FFN, batch=4, weights="fp8-e5m2"), 4)  # distance 2
    stored_winner(store, key(FFN), 99)  # 16-bit weights: never
    assert neighbour_winners(store, e5m2, own, limit=5, use_tables=False) == [
        {"BLOCK_N": 7}, {"BLOCK_N": 4}]
    # An FP8 point of one format is the other's neighbour, not its very shape: a replay of the
    # e5m2 grid may start from the e4m3 winner.
    assert neighbour_winners(store, e5m2, own, limit=1, use_tables=False,
                             same_shape=False) == [{"BLOCK_N": 7}]
    # The lookup tables' entries of the other FP8 format count too (after the database's).
    e4m3_entry = {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512, "GROUP_M": 1, "PASSES": 1,
                  "SPLIT_K": 1, "num_warps": 2, "num_stages": 1}
    fusetune.load_tables(table_file(tmp_path / "t.yaml", [
        {"dims": FFN, "dtype": "float16", "batch": 1, "seq": 1, "weights": "fp8-e4m3",
         "config": e4m3_entry}]))
    a100 = key(FFN, weights="fp8-e5m2", gpu=A100)
    got = neighbour_winners(store, a100, store.point_id(a100), limit=5)
    assert [c["BLOCK_N"] for c in got] == [4]
    assert neighbour_winners(store, key(FFN, gpu=A100), None, limit=5) == []


def table_file(path: Path, entries: list[dict[str, object]]) -> Path:
    # For a GPU fusetune ships no tables for: these entries are the only ones.
    path.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {},
                                    "gpus": {A100: {"ffn": entries}}}))
    return path


def test_the_lookup_tables_entries_seed_a_search_of_another_model(
        sqlite_url: str, tmp_path: Path, fresh_tables: None) -> None:
    spec = get_spec("ffn")
    gemv = spec.default_config(Point.make("ffn", FFN, 1, 1, "float16"), gpus.resolve(A100))
    shipped = {**gemv, "BLOCK_N": 2, "BLOCK_K": 2048, "UNROLL_K": 1, "num_warps": 8}
    fusetune.load_tables(table_file(tmp_path / "t.yaml", [
        {"dims": FFN, "dtype": "float16", "batch": 1, "seq": 1, "config": shipped},
        {"dims": FFN, "dtype": "float16", "batch": 1, "seq": 4096, "config": gemv}]))
    store = Store(sqlite_url)
    llama3 = key({"dim": 4096, "hidden": 14336}, gpu=A100)
    pid = store.point_id(llama3)
    # The tables' entry of the nearest shape (Llama-2-7B's ffn at one row) comes first; the
    # prefill entry is too far. The database's winners come first among equals.
    assert neighbour_winners(store, llama3, pid, limit=2) == [shipped]
    stored_winner(store, key(FFN, gpu=A100), 5)
    assert neighbour_winners(store, llama3, pid, limit=2) == [{"BLOCK_N": 5}, shipped]
    assert neighbour_winners(store, llama3, pid, use_tables=False) == [{"BLOCK_N": 5}]
    # Winners of this very shape (stored, or a table's entry) seed a search, not a replay of
    # its grid.
    assert neighbour_winners(store, key(FFN, gpu=A100), None) == [{"BLOCK_N": 5}, shipped]
    assert neighbour_winners(store, key(FFN, gpu=A100), None, same_shape=False) == []
    # Tables hold GPU configs: a search on the interpreter does not start from them.
    assert neighbour_winners(store, key({"dim": 4096, "hidden": 14336}, backend="interpreter",
                                        gpu=A100), None) == []


SPACE = SearchSpace("synth", (Param("A", "pow2", (4, 8, 16)), Param("B", "values", (1, 3, 5)),
                              Param("num_warps", "pow2", (8, 16, 32, 64))), "synthetic")


def test_nearest_moves_each_parameter_to_the_closest_value_of_the_space() -> None:
    assert SPACE.nearest({"A": 8, "B": 3, "num_warps": 16}) == {"A": 8, "B": 3, "num_warps": 16}
    assert SPACE.nearest({"A": 512, "B": 9, "num_warps": 1}) == {"A": 16, "B": 5, "num_warps": 8}
    # Powers of two in log2 (2 is one step from 4, 32 two steps from 8); ties to the smaller.
    assert SPACE.nearest({"A": 2, "B": 2, "num_warps": 128}) == {"A": 4, "B": 1, "num_warps": 64}


def test_start_configs_move_seeds_outside_the_space_into_it() -> None:
    point = Point.make("synth", {"dim": 8}, 1, 1, "float16")
    default = {"A": 64, "B": 3, "num_warps": 8}  # outside (A), the space holds A=16
    spec = synth_spec(default=default)  # any config fits up to 1024 threads
    plan = make_plan(SPACE, spec, point, gpus.INTERPRETER)  # num_warps 64: 2048 threads
    assert config_key({"A": 4, "B": 1, "num_warps": 64}) in plan.infeasible
    seeds = [{"A": 8, "B": 1, "num_warps": 16},  # in the space: as it is
             {"A": 16, "B": 3, "num_warps": 8},  # the same as the default's nearest: once
             {"A": 2, "B": 1, "num_warps": 128},  # nearest is infeasible: left out
             {"A": 8, "C": 1}]  # keys of another kernel version: left out
    got = start_configs(spec, point, SPACE, plan, default, seeds)
    assert got == [default, {"A": 16, "B": 3, "num_warps": 8}, {"A": 8, "B": 1, "num_warps": 16}]


def test_a_winner_stored_before_a_flag_existed_seeds_with_the_flags_default(
        sqlite_url: str, tmp_path: Path, fresh_tables: None) -> None:
    # Databases written before SPREAD, THREAD_SUM and UNFUSED hold winners without them: such
    # a winner ran with all three 0 and seeds the search as that config (it was dropped as an
    # unknown shape), the same config as its twin in a lookup table (one neighbour, not two).
    spec = get_spec("ffn")
    point = Point.make("ffn", FFN, 1, 1, "float16")
    gpu = gpus.resolve("h100")
    space = load_space(spec)
    plan = search_plan(space, spec, point, gpu)  # sampled: the space of millions
    default = spec.canonical(spec.default_config(point, gpu), point)
    old = {"BLOCK_M": 1, "BLOCK_N": 2, "BLOCK_K": 2048, "GROUP_M": 1, "PASSES": 1,
           "SPLIT_K": 1, "UNROLL_K": 1, "TMA": 0, "num_warps": 8,
           "num_stages": 1}
    filled = {**old, "SPREAD": 0, "THREAD_SUM": 0, "UNFUSED": 0}
    other = {**filled, "BLOCK_N": 4}
    fusetune.load_tables(table_file(tmp_path / "t.yaml", [
        {"dims": FFN, "dtype": "float16", "batch": 1, "seq": 2, "config": old},
        {"dims": FFN, "dtype": "float16", "batch": 1, "seq": 16, "config": other}]))
    store = Store(sqlite_url)
    pid = store.point_id(key(FFN, gpu=A100))  # one row: as far from 4 rows as 16 rows are
    store.set_winner(pid, old, 1.0, old, None, 1, 1, 1)
    me = key(FFN, batch=4, gpu=A100)
    assert neighbour_winners(store, me, None, flags=spec.flags, use_tables=False) == [filled]
    # The stored winner is the table's 2-row entry: the next nearest point gets its place.
    neighbours = neighbour_winners(store, me, None, flags=spec.flags)
    assert neighbours == [filled, other]
    got = start_configs(spec, point, space, plan, default, neighbours[:1])
    # (the unfused form, ffn's other algorithm, right after the default)
    assert got == [default, spec.canonical({**default, "UNFUSED": 1}, point), filled]
