"""Where a config comes from (exact, rows, nearby, default), marginal entries, and `fusetune
coverage` over the points of a patched model."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

import fusetune
from fusetune import cli, gpus, runtime
from fusetune.kernels import get_spec
from fusetune.runtime import NEARBY_DISTANCE
from fusetune.spec import Point, check_fits

FFN = get_spec("ffn")
TILES = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 2, "SPLIT_K": 1,
         "num_warps": 8, "num_stages": 3}
GEMV = {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512, "GROUP_M": 1, "PASSES": 1, "SPLIT_K": 1,
        "THREAD_SUM": 1, "num_warps": 2, "num_stages": 1}


def table(tmp_path: Path, entries: list[dict[str, Any]], kernel: str = "ffn") -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {},
                                    "gpus": {"h100": {kernel: entries}}}))
    return path


def ffn_entry(dim: int, hidden: int, rows: int, config: dict[str, int], **extra: Any
              ) -> dict[str, Any]:
    return {"dims": {"dim": dim, "hidden": hidden}, "dtype": "bfloat16", "batch": 1,
            "seq": rows, "config": config, **extra}


def resolve(dim: int, hidden: int, rows: int) -> Any:
    return fusetune.resolve("ffn", {"dim": dim, "hidden": hidden}, "bfloat16", rows=rows,
                            gpu="h100", warn=False)


def test_sources_exact_rows_nearby_default(tmp_path: Path, fresh_tables: None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_shipped", runtime.Tables())  # this table's entries only
    fusetune.load_tables(table(tmp_path, [
        ffn_entry(4096, 14336, 1, GEMV, time_us=80.0, default_us=90.0),
        ffn_entry(4096, 14336, 64, TILES, time_us=100.0, default_us=150.0)]))
    exact = resolve(4096, 14336, 1)
    assert (exact.source, exact.rows, exact.speedup) == ("exact", 1, pytest.approx(1.125))
    assert exact.config == FFN.validate_config(GEMV)
    rows = resolve(4096, 14336, 48)  # the 64-row tiles serve 48 rows
    assert (rows.source, rows.rows) == ("rows", 64)
    # Other dims nearby (Qwen2.5-7B's width, Llama-3's entries): carried over, made canonical
    # for the point and within the GPU's limits.
    near = resolve(3584, 18944, 64)
    assert (near.source, near.rows, dict(near.dims)) == ("nearby", 64,
                                                          {"dim": 4096, "hidden": 14336})
    p = Point.make("ffn", {"dim": 3584, "hidden": 18944}, 1, 64, "bfloat16")
    assert near.config == FFN.canonical(FFN.validate_config(TILES), p)
    assert check_fits(FFN.resources(near.config, p), gpus.resolve("h100")) is None
    # Too far away (16x the width and the rows): the default heuristic.
    far = resolve(256, 688, 4)
    assert far.source == "default" and far.rows is None
    assert far.config == FFN.canonical(FFN.default_config(
        Point.make("ffn", {"dim": 256, "hidden": 688}, 1, 4, "bfloat16"),
        gpus.resolve("h100")), Point.make("ffn", {"dim": 256, "hidden": 688}, 1, 4, "bfloat16"))
    assert NEARBY_DISTANCE < 8
    # lookup answers what resolve does
    assert fusetune.lookup("ffn", {"dim": 3584, "hidden": 18944}, "bfloat16", rows=64,
                           gpu="h100") == near.config


def test_nearby_skips_configs_the_point_cannot_run(tmp_path: Path, fresh_tables: None) -> None:
    # A one-row (GEMV) entry serves one row only: at 2 rows of other dims it is no candidate,
    # and the next nearest that is one answers.
    fusetune.load_tables(table(tmp_path, [ffn_entry(4096, 14336, 1, GEMV),
                                          ffn_entry(4096, 11008, 4, TILES)]))
    near = resolve(4096, 12288, 2)
    assert near.source == "nearby" and dict(near.dims) == {"dim": 4096, "hidden": 11008}


def test_one_row_takes_only_one_row_entries_of_other_dims(tmp_path: Path, fresh_tables: None,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # Tiles tuned for 4 rows read the weights at the tiles' pace at one row, where the default's
    # one-row structure is faster: a one-row point of other dims does not take them.
    monkeypatch.setattr(runtime, "_shipped", runtime.Tables())  # this table's entries only
    assert FFN.one_row_structure and not get_spec("rmsnorm").one_row_structure
    fusetune.load_tables(table(tmp_path, [ffn_entry(4096, 11008, 4, TILES)]))
    assert resolve(4096, 12288, 1).source == "default"
    assert resolve(4096, 12288, 2).source == "nearby"  # more rows: the tiles serve
    fusetune.load_tables(table(tmp_path, [ffn_entry(4096, 11008, 4, TILES),
                                          ffn_entry(4096, 14336, 1, GEMV)]))
    near = resolve(4096, 12288, 1)
    assert (near.source, near.rows, dict(near.dims)) == ("nearby", 1,
                                                          {"dim": 4096, "hidden": 14336})


def test_nearby_skips_tiles_that_overhang_the_point(tmp_path: Path, fresh_tables: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A 2048-wide K slice (8 splits of 256) divides 4096 columns and overhangs 5120 (a sixth of
    # its loop masked): no carry-over there, the default heuristic; unsplit 256-wide steps
    # divide both, and carry.
    monkeypatch.setattr(runtime, "_shipped", runtime.Tables())  # this table's entries only
    split = {**TILES, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 8}
    fusetune.load_tables(table(tmp_path, [ffn_entry(4096, 14336, 16, split)]))
    assert FFN.padding is not None
    p = Point.make("ffn", {"dim": 5120, "hidden": 14336}, 1, 16, "bfloat16")
    assert FFN.padding(FFN.canonical(FFN.validate_config(split), p), p) == pytest.approx(1 / 6)
    assert resolve(5120, 14336, 16).source == "default"
    assert resolve(3072 + 1024, 12288, 16).source == "nearby"  # 4096 wide: nothing masked
    fusetune.load_tables(table(tmp_path, [ffn_entry(4096, 14336, 16, {**split, "SPLIT_K": 1})]))
    assert resolve(5120, 14336, 16).source == "nearby"


def test_one_row_carries_only_from_the_same_k_width(tmp_path: Path, fresh_tables: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # The one-row loop's K steps are tuned to its width: another width's one-row config is no
    # candidate at one row (even where its steps divide both), the same width's is.
    monkeypatch.setattr(runtime, "_shipped", runtime.Tables())  # this table's entries only
    assert FFN.one_row_same == ("dim",)
    fusetune.load_tables(table(tmp_path, [ffn_entry(4096, 14336, 1, {**GEMV, "BLOCK_K": 256})]))
    assert resolve(5120, 14336, 1).source == "default"
    assert resolve(2048, 11008, 1).source == "default"
    near = resolve(4096, 11008, 1)
    assert (near.source, dict(near.dims)) == ("nearby", {"dim": 4096, "hidden": 14336})


def test_qkv_carries_only_between_equal_head_widths(tmp_path: Path, fresh_tables: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # qkv's tiles lie over the heads' rotation pairs: a config tuned at head_dim 128 is no
    # candidate at 96 or 256, nor across the pairing, at any row count.
    monkeypatch.setattr(runtime, "_shipped", runtime.Tables())  # this table's entries only
    qkv = get_spec("qkv")
    assert qkv.carry_same == ("head_dim", "interleaved")

    def dims(dim: int, head_dim: int, interleaved: int = 0) -> dict[str, int]:
        return {"dim": dim, "head_dim": head_dim, "interleaved": interleaved,
                "n_heads": dim // head_dim, "n_kv_heads": 8}

    entry = {"dims": dims(4096, 128), "dtype": "bfloat16", "batch": 1, "seq": 1024,
             "config": TILES}
    fusetune.load_tables(table(tmp_path, [entry], "qkv"))

    def source(d: dict[str, int]) -> str:
        return fusetune.resolve("qkv", d, "bfloat16", rows=1024, gpu="h100", warn=False).source

    assert source(dims(5120, 128)) == "nearby"
    assert source(dims(3072, 96)) == "default"
    assert source(dims(4096, 256)) == "default"
    assert source(dims(4096, 128, interleaved=1)) == "default"


def test_a_config_is_not_carried_where_its_row_takes_another_structure(
        tmp_path: Path, fresh_tables: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 4096-wide block tuned where it holds the whole row (one pass) would walk a 5120-wide
    # row in two passes: not the structure that won, so not carried; to narrower rows it
    # still holds them whole (made canonical: the block shrinks to the row).
    monkeypatch.setattr(runtime, "_shipped", runtime.Tables())  # this table's entries only
    cfg = {"BLOCK_D": 4096, "ROWS": 1, "num_warps": 8, "num_stages": 1}
    entry = {"dims": {"dim": 4096}, "dtype": "bfloat16", "batch": 4096, "seq": 1,
             "config": cfg}
    fusetune.load_tables(table(tmp_path, [entry], "rmsnorm"))

    def resolve(dim: int) -> Any:
        return fusetune.resolve("rmsnorm", {"dim": dim}, "bfloat16", rows=4096, gpu="h100",
                                warn=False)

    assert resolve(4096).source == "exact"
    assert resolve(5120).source == "default"
    near = resolve(3072)
    assert (near.source, near.config["BLOCK_D"]) == ("nearby", 4096)
    assert resolve(2048).config["BLOCK_D"] == 2048
    # a two-pass config lends itself to a width it also walks in passes
    two = {**cfg, "BLOCK_D": 2048, "num_stages": 2}
    fusetune.load_tables(table(tmp_path, [{**entry, "config": two}], "rmsnorm"))
    assert resolve(5120).source == "nearby"
    assert resolve(2048).source == "default"  # one pass there


def test_rmsnorm_bwd_lends_no_config_to_other_widths(tmp_path: Path, fresh_tables: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Its configs are fitted to the width and the bytes moved: an entry at 2048 columns serves
    # its own width within its rows' range, and neither another width nor rows below its range.
    monkeypatch.setattr(runtime, "_shipped", runtime.Tables())  # this table's entries only
    bwd = get_spec("rmsnorm_bwd")
    assert bwd.carry_same == ("dim",)
    cfg = {"BLOCK_D": 2048, "ROWS": 2, "PROGRAMS": 256, "num_warps": 8, "num_stages": 3,
           "PREFETCH": 1, "EVICT": 1}
    entry = {"dims": {"dim": 2048}, "dtype": "bfloat16", "batch": 8192, "seq": 1,
             "config": cfg}
    fusetune.load_tables(table(tmp_path, [entry], "rmsnorm_bwd"))

    def source(dim: int, rows: int) -> str:
        return fusetune.resolve("rmsnorm_bwd", {"dim": dim}, "bfloat16", rows=rows, gpu="h100",
                                warn=False).source

    assert source(2048, 8192) == "exact"
    assert source(1024, 8192) == "default"
    assert source(3072, 8192) == "default"
    assert source(2048, 4096) == "default"  # below the tuned range: no other width lends


def test_a_marginal_entry_answers_with_the_default(tmp_path: Path, fresh_tables: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # An entry whose winner did not beat the default beyond the timings' spread: the point is
    # tuned (exact, or rows for fewer rows), marked marginal, and the default heuristic runs.
    monkeypatch.setattr(runtime, "_shipped", runtime.Tables())  # this table's entries only
    fusetune.load_tables(table(tmp_path, [ffn_entry(4096, 14336, 1, GEMV),
                                          ffn_entry(4096, 14336, 64, TILES, time_us=100.0,
                                                    default_us=101.0, marginal=True)]))
    h100 = gpus.resolve("h100")
    for rows, source in ((64, "exact"), (48, "rows")):
        res = resolve(4096, 14336, rows)
        p = Point.make("ffn", {"dim": 4096, "hidden": 14336}, 1, rows, "bfloat16")
        assert (res.source, res.rows, res.marginal) == (source, 64, True)
        assert res.speedup == pytest.approx(1.01)
        default = FFN.canonical(FFN.default_config(p, h100), p)
        assert res.config == default != FFN.canonical(FFN.validate_config(TILES), p)
        assert fusetune.lookup("ffn", {"dim": 4096, "hidden": 14336}, "bfloat16", rows=rows,
                               gpu="h100") == default
    tuned = resolve(4096, 14336, 1)  # the entry beside it is not marginal: its config runs
    assert (tuned.source, tuned.marginal) == ("exact", False)
    assert tuned.config == FFN.validate_config(GEMV)
    lent = resolve(3584, 18944, 64)  # nor does it lend its config to other dims
    assert (lent.source, lent.dims) == ("default", None)
    bad = table(tmp_path, [ffn_entry(4096, 14336, 64, TILES, marginal="yes")])
    with pytest.raises(fusetune.TableError, match=r"marginal='yes' must be true or false"):
        fusetune.load_tables(bad)


def test_export_writes_the_spread_and_marks_marginal_wins(tmp_path: Path) -> None:
    from fusetune.db.store import PointKey, Store
    from fusetune.export import build_tables

    store = Store(f"sqlite:///{tmp_path}/ft.db")
    default = {"BLOCK_D": 64, "ROWS": 1, "num_warps": 4, "num_stages": 1}
    won = {**default, "num_warps": 8}
    # 64: 0.5% below the default, inside a spread of 1 µs; 128: 2% below it, inside the same
    # spread (a win the medians show: the p20-p80 spread is the launches' jitter); 256: 0.5 µs
    # below a default of 50 µs, 1%: not beyond the margin.
    cases = {64: (10.0, 10.05), 128: (10.0, 10.2), 256: (49.5, 50.0), 512: (49.4, 50.0)}
    for dim, (w_us, d_us) in cases.items():
        pid = store.point_id(PointKey("h100-sxm", "rmsnorm", {"dim": dim}, 1, 1, "float16", "",
                                      "cuda", "k", "3.6.0", "2.11"))
        for c, us in ((won, w_us), (default, d_us)):
            store.record(pid, json.dumps(dict(sorted(c.items())), separators=(",", ":")), c,
                         "ok", time_us=us, p20_us=us - 0.5, p80_us=us + 0.5)
        store.set_winner(pid, won, w_us, default, d_us, 1, 1, 2)
    entries = build_tables(store)["gpus"]["h100-sxm"]["rmsnorm"]
    by_dim = {e["dims"]["dim"]: e for e in entries}
    assert [by_dim[d]["marginal"] for d in cases] == [True, False, True, False]
    assert (by_dim[128]["p20_us"], by_dim[128]["p80_us"]) == (9.5, 10.5)
    assert (by_dim[128]["default_p20_us"], by_dim[128]["default_p80_us"]) == (9.7, 10.7)


def test_exported_times_are_the_re_timing_that_picked_the_winner(tmp_path: Path) -> None:
    # The winner was picked by re-timing the finalists and the default interleaved: the
    # entry's medians, and so its `marginal`, are that re-timing's (like with like), not the
    # first timings taken minutes apart. A first timing's spread is written where it brackets
    # the median written.
    from fusetune.db.store import PointKey, Store
    from fusetune.export import build_tables
    from fusetune.tuner.space import config_key

    store = Store(f"sqlite:///{tmp_path}/ft.db")
    default = {"BLOCK_D": 64, "ROWS": 1, "num_warps": 4, "num_stages": 1}
    won = {**default, "num_warps": 8}
    untimed = {**default, "num_warps": 16}  # a winner the database holds no timing of

    def point(dim: int, first: dict[str, tuple[float, ...]], winner: dict[str, int],
              won_us: float, default_us: float | None) -> dict[str, Any]:
        pid = store.point_id(PointKey("h100-sxm", "rmsnorm", {"dim": dim}, 1, 1, "float16", "",
                                      "cuda", "k", "3.6.0", "2.11"))
        for c in (won, default):
            p20, p50, p80 = (*first[config_key(c)], None, None)[:3]
            store.record(pid, config_key(c), c, "ok", time_us=p50, p20_us=p20, p80_us=p80)
        store.set_winner(pid, winner, won_us, default, default_us, 1, 1, 2)
        (e,) = [e for e in build_tables(store)["gpus"]["h100-sxm"]["rmsnorm"]
                if e["dims"]["dim"] == dim]
        return e

    spreads = {config_key(won): (5.5, 6.0, 6.5), config_key(default): (9.0, 10.0, 11.0)}
    # re-timed medians outside the first timings' spreads: written without them
    e = point(64, spreads, won, 5.0, 11.5)
    assert (e["time_us"], e["default_us"], e["marginal"]) == (5.0, 11.5, False), e
    assert not {"p20_us", "p80_us", "default_p20_us", "default_p80_us"} & set(e), e
    # inside them: written with them
    e = point(128, spreads, won, 6.2, 9.5)
    assert (e["p20_us"], e["time_us"], e["p80_us"]) == (5.5, 6.2, 6.5), e
    assert (e["default_p20_us"], e["default_us"], e["default_p80_us"]) == (9.0, 9.5, 11.0), e
    # the first timings had the default ahead, the re-timing the winner by 3%: the winner runs
    first = {config_key(won): (10.0, 10.3, 10.6), config_key(default): (9.8, 10.1, 10.4)}
    e = point(256, first, won, 9.8, 10.1)
    assert (e["time_us"], e["default_us"], e["marginal"]) == (9.8, 10.1, False), e
    # and a re-timing within 1%: marginal, whatever the first timings said
    first = {config_key(won): (9.0, 9.2, 9.4), config_key(default): (10.0, 10.3, 10.6)}
    assert point(512, first, won, 10.05, 10.1)["marginal"] is True
    # no stored timing of the winner: its re-timed median, and no spread
    e = point(1024, spreads, untimed, 5.0, 11.5)
    assert e["time_us"] == 5.0 and "p20_us" not in e and "p80_us" not in e, e
    # a default not re-timed (the winner row has no median of it): its stored timing's
    e = point(2048, spreads, won, 6.2, None)
    assert (e["default_p20_us"], e["default_us"], e["default_p80_us"]) == (9.0, 10.0, 11.0), e
    assert e["marginal"] is False
    # stored timings without percentiles (a database of an older fusetune)
    e = point(4096, {config_key(won): (None, 6.0), config_key(default): (None, 10.0)}, won,
              5.0, 11.5)
    assert (e["time_us"], e["default_us"], e["marginal"]) == (5.0, 11.5, False), e
    assert not {"p20_us", "p80_us", "default_p20_us", "default_p80_us"} & set(e), e


def test_coverage_says_how_to_tune_the_default_points(tmp_path: Path, fresh_tables: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Points the lookup answers with the default heuristic: the command that tunes them, with
    # coverage's own model, GPU, rows and numerics, and one that `search` takes.
    monkeypatch.setattr(runtime, "_shipped", runtime.Tables())  # no table at all
    args = ["coverage", "--model", "tiny", "--gpu", "rtx-5090", "--rows", "1,16", "--dtype",
            "float16", "--weights", "fp8-e4m3"]
    r = CliRunner().invoke(cli.main, args)
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert re.fullmatch(r"0 exact; 0 rows; 0 nearby; (\d+) default", lines[-2]), lines[-2]
    n = int(lines[-2].split("; ")[-1].split()[0])
    command = ("fusetune search --kernel all --model tiny --gpu rtx-5090 --rows 1,16 --dtype "
               "float16 --weights fp8-e4m3")
    assert lines[-1] == (f"The {n} default points have no tuned config on rtx-5090: tune them "
                         f"with `{command}`, then `fusetune export TABLE` and read it with "
                         "--tables (or FUSETUNE_TABLES)."), lines[-1]
    planned = CliRunner().invoke(cli.main, [*command.split()[1:], "--dry-run"])
    assert planned.exit_code == 0, planned.output
    assert planned.output.count("Plan for ") == n // 2  # a plan per kernel and dims, 2 rows each
    training = CliRunner().invoke(cli.main, ["coverage", "--model", "tiny", "--gpu", "l40s",
                                             "--training", "--rows", "4096"])
    assert training.exit_code == 0, training.output
    assert ("`fusetune search --kernel training --model tiny --gpu l40s --rows 4096`"
            in training.output), training.output
    # Every point tuned: nothing to say.
    from fusetune import coverage as coverage_module

    real = coverage_module.coverage

    def tuned(*a: Any, **k: Any) -> list[coverage_module.CoverageRow]:
        return [dataclasses.replace(row, source="exact", tuned_rows=row.rows)
                for row in real(*a, **k)]

    monkeypatch.setattr(coverage_module, "coverage", tuned)
    covered = CliRunner().invoke(cli.main, args)
    assert covered.exit_code == 0, covered.output
    assert covered.output.strip().splitlines()[-1] == f"{n} exact; 0 rows; 0 nearby; 0 default"
    assert "fusetune search" not in covered.output
    as_json = CliRunner().invoke(cli.main, [*args, "--json"])
    assert as_json.exit_code == 0 and json.loads(as_json.output), as_json.output


def test_coverage_names_each_points_source(tmp_path: Path, fresh_tables: None) -> None:
    path = table(tmp_path, [ffn_entry(4096, 14336, 1, GEMV, time_us=80.0, default_us=90.0),
                            ffn_entry(4096, 14336, 64, TILES)])
    r = CliRunner().invoke(cli.main, ["coverage", "--model", "llama-3-8b", "--gpu", "h100",
                                      "--rows", "1,16,4096", "--tables", str(path), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert {(x["kernel"], x["use"]) for x in rows} == {
        ("qkv", "qkv"), ("ffn", "gate_up"), ("linear", "o_proj"), ("linear", "down_proj"),
        ("rmsnorm", "norm")}
    ffn = {x["rows"]: x for x in rows if x["kernel"] == "ffn"}
    assert ffn[1]["source"] == "exact" and ffn[1]["speedup"] == pytest.approx(1.125)
    assert ffn[16]["source"] == "rows" and ffn[16]["tuned_rows"] == 64
    assert all(x["source"] in ("exact", "rows", "nearby", "default") for x in rows)
    shown = CliRunner().invoke(cli.main, ["coverage", "--model", "llama-3-8b", "--gpu", "h100",
                                          "--rows", "1", "--tables", str(path)])
    assert shown.exit_code == 0 and "gate_up" in shown.output and "1.12×" in shown.output
    bad = CliRunner().invoke(cli.main, ["coverage", "--model", "phi-9", "--gpu", "h100"])
    assert bad.exit_code != 0 and "unknown model 'phi-9'; valid:" in bad.output


def test_coverage_of_the_training_path(tmp_path: Path, fresh_tables: None) -> None:
    # --training: the kernels of the training path, at a step's token rows by default;
    # swiglu_bwd entries at 4096 and 16384 rows answer those exactly and 8192 by rows (float16:
    # the shipped tables hold bfloat16 entries of these points).
    def entry(rows: int) -> dict[str, Any]:
        return {"dims": {"hidden": 14336}, "dtype": "float16", "batch": rows, "seq": 1,
                "config": {"BLOCK": 512, "ROWS": 4, "num_warps": 16}}

    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {"h100": {
        "swiglu_bwd": [entry(4096), entry(16384)]}}}))
    r = CliRunner().invoke(cli.main, ["coverage", "--model", "llama-3-8b", "--gpu", "h100",
                                      "--training", "--dtype", "float16", "--tables", str(path),
                                      "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert {(x["kernel"], x["use"]) for x in rows} == {
        ("rmsnorm", "norm"), ("rmsnorm_bwd", "norm"), ("rope", "q"), ("rope", "k"),
        ("rope_bwd", "q"), ("rope_bwd", "k"), ("swiglu", "gate"), ("swiglu_bwd", "gate")}
    assert {x["rows"] for x in rows} == {4096, 8192, 16384}
    glu = {x["rows"]: x["source"] for x in rows if x["kernel"] == "swiglu_bwd"}
    assert glu == {4096: "exact", 8192: "rows", 16384: "exact"}
    shown = CliRunner().invoke(cli.main, ["coverage", "--model", "llama-3-8b", "--gpu", "h100",
                                          "--training", "--rows", "8192", "--tables",
                                          str(path)])
    assert shown.exit_code == 0 and "(training)" in shown.output, shown.output
    fp8 = CliRunner().invoke(cli.main, ["coverage", "--model", "llama-3-8b", "--gpu", "h100",
                                        "--training", "--weights", "fp8-e4m3"])
    assert fp8.exit_code == 2 and "the training path runs 16-bit weights" in fp8.output


def test_coverage_counts_a_marginal_entry_as_tuned(tmp_path: Path, fresh_tables: None) -> None:
    # A point tuned and found no better than the default heuristic is covered: exact (rows for
    # fewer rows), with the marginal flag, and the lookup's config is the default's.
    path = table(tmp_path, [ffn_entry(4096, 14336, 1, GEMV, time_us=89.0, default_us=90.0,
                                      marginal=True),
                            ffn_entry(4096, 14336, 64, TILES, time_us=100.0, default_us=150.0)])
    args = ["coverage", "--model", "llama-3-8b", "--gpu", "h100", "--rows", "1,64",
            "--tables", str(path)]
    r = CliRunner().invoke(cli.main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    ffn = {x["rows"]: x for x in json.loads(r.output) if x["kernel"] == "ffn"}
    assert (ffn[1]["source"], ffn[1]["tuned_rows"], ffn[1]["marginal"]) == ("exact", 1, True)
    assert (ffn[64]["source"], ffn[64]["marginal"]) == ("exact", False)
    p = Point.make("ffn", {"dim": 4096, "hidden": 14336}, 1, 1, "bfloat16")
    assert fusetune.lookup("ffn", {"dim": 4096, "hidden": 14336}, "bfloat16", rows=1,
                           gpu="h100") == FFN.canonical(FFN.default_config(
                               p, gpus.resolve("h100")), p)
    shown = CliRunner().invoke(cli.main, args)
    assert shown.exit_code == 0, shown.output
    line = next(x for x in shown.output.splitlines() if "gate_up" in x and "│ 1 " in x)
    assert re.search(r"│ exact\s+│ rows 1 \(marginal: the default config runs\)", line), line
    last = shown.output.strip().splitlines()[-1]
    assert re.match(r"\d+ exact; \d+ rows; \d+ nearby; \d+ default \(\d+ of the exact and "
                    r"rows marginal: the default config runs\)", last), last
