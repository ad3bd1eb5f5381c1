"""Lookup tables: validation of the YAML files, lookup rules, sources, the cached fast path."""

from __future__ import annotations

import copy
import os
import re
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from cli_helpers import invoke

import fusetune
from fusetune import gpus, runtime, tables
from fusetune.kernels import get_spec
from fusetune.spec import Point

pytestmark = pytest.mark.usefixtures("fresh_tables")

SPEC = get_spec("rmsnorm")
DIMS = {"dim": 64}


def cfg(block_d: int = 64, rows: int = 1, warps: int = 4, stages: int = 1) -> dict[str, int]:
    return {"BLOCK_D": block_d, "ROWS": rows, "num_warps": warps, "num_stages": stages}


CFG_A = cfg(warps=1)
CFG_B = cfg(warps=2, rows=2)
CFG_C = cfg(warps=8, rows=4)
CFG_I = cfg(warps=16, rows=2)


def entry(batch: int = 1, seq: int = 1, config: dict[str, int] | None = None,
          dtype: str = "float16", dim: int = 64, **extra: Any) -> dict[str, Any]:
    e: dict[str, Any] = {"dims": {"dim": dim}, "dtype": dtype, "batch": batch, "seq": seq,
                         "config": dict(config or CFG_A)}
    e.update(extra)
    return e


def doc(gpu_entries: dict[str, list[dict[str, Any]]], kernel: str = "rmsnorm") -> dict[str, Any]:
    return {"schema_version": 1, "provenance": {"generator": "test"},
            "gpus": {g: {kernel: es} for g, es in gpu_entries.items()}}


def write(path: Path, document: dict[str, Any] | str) -> Path:
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return path


def default_for(rows: int, gpu: str = "h100", dtype: str = "float16", dim: int = 64
                ) -> dict[str, int]:
    point = Point.make("rmsnorm", {"dim": dim}, 1, max(rows, 1), dtype)
    return SPEC.canonical(SPEC.default_config(point, gpus.resolve(gpu)), point)


def fusetune_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, fusetune.FusetuneWarning)]


# ---- validation ----------------------------------------------------------------------------


def test_valid_table_loads(tmp_path: Path) -> None:
    path = write(tmp_path / "t.yaml", doc({
        "h100-sxm": [entry(1, 1, CFG_A, time_us=3.5, default_us=4, triton="3.1", torch="2.4",
                           backend="cuda", weights=""),
                     entry(16, 1, CFG_B)],
        "interpreter": [entry(1, 1, CFG_I)],
    }))
    t = fusetune.load_tables(path)
    assert len(t) == 3
    assert t.sources == [str(path)]
    key = ("h100-sxm", "rmsnorm", (("dim", 64),), "float16", "", "")
    assert t.groups[key] == [(1, CFG_A), (16, CFG_B)]


def _bad_second_entry(change) -> dict[str, Any]:
    d = doc({"h100-sxm": [entry(1, 1, CFG_A), entry(16, 1, CFG_B)]})
    change(d["gpus"]["h100-sxm"]["rmsnorm"][1])
    return d


def _set_block(value: Any):
    return lambda e: e["config"].__setitem__("BLOCK_D", value)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda e: e.pop("config"), r"missing field config"),
        (_set_block(64.5), r"config: BLOCK_D=64\.5 must be a positive integer"),
        (_set_block("64"), r"config: BLOCK_D='64' must be a positive integer"),
        (_set_block(96), r"config: BLOCK_D=96 must be a power of two"),
        (_set_block(True), r"BLOCK_D=True"),
        (lambda e: e["config"].pop("ROWS"), r"missing ROWS"),
        (lambda e: e["config"].__setitem__("SPLIT", 2), r"unknown SPLIT"),
        (lambda e: e.__setitem__("note", "hand-tuned"), r"unknown field note"),
        (lambda e: e.__setitem__("dtype", "float64"), r"dtype 'float64' is not one of"),
        (lambda e: e.__setitem__("batch", 0), r"batch=0 must be a positive integer"),
        (lambda e: e.__setitem__("dims", {"hidden": 64}), r"dims must be a mapping of dim"),
        (lambda e: e["dims"].__setitem__("dim", -1), r"dims\.dim=-1"),
        # a switch's value outside its choices keys nothing any lookup asks for
        (lambda e: e["dims"].__setitem__("residual", 2),
         r"dims: residual=2 is none of rmsnorm's choices: 0 \(no residual\), 1 \(a resid"),
        (lambda e: e.__setitem__("time_us", "fast"), r"time_us='fast' must be a number"),
    ],
    ids=["no-config", "float-block", "str-block", "non-pow2-block", "bool-block",
         "missing-key", "unknown-key", "unknown-field", "bad-dtype", "zero-batch", "bad-dims",
         "negative-dim", "bad-switch", "str-time"],
)
def test_bad_entry_named_in_error(tmp_path: Path, change, match: str) -> None:
    path = write(tmp_path / "bad.yaml", _bad_second_entry(change))
    with pytest.raises(fusetune.TableError) as info:
        fusetune.load_tables(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "gpus.h100-sxm.rmsnorm[1]" in msg
    assert re.search(match, msg), msg


def test_quoted_block_in_yaml_text_rejected(tmp_path: Path) -> None:
    text = yaml.safe_dump(doc({"h100-sxm": [entry(1, 1, CFG_A), entry(16, 1, CFG_B)]}))
    text = text.replace("BLOCK_D: 64", 'BLOCK_D: "64"', 2)
    assert text.count('BLOCK_D: "64"') == 2
    path = write(tmp_path / "q.yaml", text)
    with pytest.raises(fusetune.TableError, match=r"gpus\.h100-sxm\.rmsnorm\[0\]: config: BLOCK_D"):
        fusetune.load_tables(path)


def test_unknown_kernel_named(tmp_path: Path) -> None:
    path = write(tmp_path / "k.yaml", doc({"h100-sxm": [entry()]}, kernel="layernorm"))
    with pytest.raises(fusetune.TableError,
                       match=r"gpus\.h100-sxm\.layernorm: unknown kernel 'layernorm'; valid: "
                             r"ffn, linear, lola, moe, qkv, rmsnorm, rmsnorm_bwd, rope"):
        fusetune.load_tables(path)


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_wrong_schema_version(tmp_path: Path, version: Any) -> None:
    d = doc({"h100-sxm": [entry()]})
    d["schema_version"] = version
    path = write(tmp_path / "v.yaml", d)
    with pytest.raises(fusetune.TableError, match=r"schema_version .* is not supported"):
        fusetune.load_tables(path)


@pytest.mark.parametrize("missing", ["schema_version", "provenance", "gpus"])
def test_missing_top_level_field(tmp_path: Path, missing: str) -> None:
    d = doc({"h100-sxm": [entry()]})
    del d[missing]
    with pytest.raises(fusetune.TableError, match=f"missing top-level field '{missing}'"):
        fusetune.load_tables(write(tmp_path / "m.yaml", d))


def test_python_tag_rejected_and_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = yaml.safe_dump(doc({"h100-sxm": [entry(1, 1, CFG_A)]}))
    evil = (f'gpus:\n  h100-sxm:\n    rmsnorm:\n    - dims: {{dim: 64}}\n      dtype: float16\n'
            f'      batch: 1\n      seq: 1\n'
            f'      config: !!python/object/apply:os.system ["touch {marker}"]\n')
    text = text.split("gpus:")[0] + evil
    path = write(tmp_path / "evil.yaml", text)
    with pytest.raises(fusetune.TableError) as info:
        fusetune.load_tables(path)
    assert not marker.exists()
    msg = str(info.value)
    assert str(path) in msg
    assert "python/object/apply:os.system" in msg
    # the same with the brief's harmless command: rejected too
    path2 = write(tmp_path / "evil2.yaml", text.replace(f"touch {marker}", "echo hi"))
    with pytest.raises(fusetune.TableError, match="rejected"):
        fusetune.load_tables(path2)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(fusetune.TableError, match="does not exist"):
        fusetune.load_tables(tmp_path / "nope.yaml")


def test_table_error_is_value_error() -> None:
    assert issubclass(fusetune.TableError, ValueError)


def test_failed_load_keeps_previous_tables(tmp_path: Path) -> None:
    good = write(tmp_path / "good.yaml", doc({"h100-sxm": [entry(1, 1, CFG_B)]}))
    bad = write(tmp_path / "bad.yaml", _bad_second_entry(lambda e: e.pop("config")))
    fusetune.load_tables(good)
    with pytest.raises(fusetune.TableError):
        fusetune.load_tables(bad)
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == CFG_B


# ---- lookup --------------------------------------------------------------------------------


def test_exact_rows(tmp_path: Path) -> None:
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({
        "h100-sxm": [entry(1, 1, CFG_A), entry(16, 1, CFG_B), entry(1, 512, CFG_C)]})))
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == CFG_A
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=16, gpu="h100") == CFG_B
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=512, gpu="h100-sxm") == CFG_C


@pytest.mark.parametrize(
    ("rows", "expected"),
    [(1, CFG_A), (2, CFG_B), (15, CFG_B), (16, CFG_B),  # the next tuned row count up
     (17, CFG_C), (300, CFG_C), (512, CFG_C)],
)
def test_rounds_up_to_the_next_tuned_row_count(tmp_path: Path, rows: int,
                                               expected: dict[str, int]) -> None:
    # A config tuned for more rows serves fewer (its tiles partly masked); one tuned for fewer
    # would read the weights once per row-block.
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({
        "h100-sxm": [entry(1, 1, CFG_A), entry(16, 1, CFG_B), entry(1, 512, CFG_C)]})))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)  # in range: no warning
        assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=rows, gpu="h100") == expected


def test_outside_range_default_and_warns_once(tmp_path: Path) -> None:
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({
        "h100-sxm": [entry(16, 1, CFG_A), entry(1, 512, CFG_C)]})))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = fusetune.lookup("rmsnorm", DIMS, "float16", rows=1024, gpu="h100")
        assert first == default_for(1024)
        assert first not in (CFG_A, CFG_C)
        msgs = fusetune_warnings(record)
        assert len(msgs) == 1
        assert "h100-sxm" in msgs[0] and "tuned rows 16..512, asked 1024" in msgs[0]
        # the same call again, and another uncovered row count of the same group: no warning
        assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1024, gpu="h100") == first
        assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, gpu="h100") == default_for(4)
        assert len(fusetune_warnings(record)) == 1


def _suggested(msg: str) -> list[str]:
    m = re.search(r"`fusetune (search [^`]*)`", msg)
    assert m, msg
    return shlex.split(m.group(1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors map to the interpreter")
def test_missing_entry_warning_suggests_a_search_that_runs_and_points_at_the_caller(
        tmp_path: Path) -> None:
    # The suggested command tunes exactly the missing point; the interpreter is a backend,
    # not a --gpu. The warning names the caller's line, not fusetune's own source.
    x = torch.randn(7, 64, dtype=torch.float16)
    w1, w3 = (torch.randn(128, 64, dtype=torch.float16) / 8 for _ in range(2))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = _line() + 1
        fusetune.ffn(x, torch.ones(64, dtype=torch.float16), w1, w3, eps=1e-6)
    ours = [w for w in record if issubclass(w.category, fusetune.FusetuneWarning)]
    assert ours and {(w.filename, w.lineno) for w in ours} == {(__file__, line)}
    # About ffn only: its norm pass (rmsnorm's kernel, at 7 rows a pass of its own) is part
    # of the ffn the caller asked for, whose lookup speaks for it.
    (msg,) = [str(w.message) for w in ours]
    assert "for ffn on" in msg
    args = _suggested(msg)
    assert args == ["search", "--kernel", "ffn", "--backend", "interpreter", "--dims",
                    "dim=64,hidden=128", "--batch", "7", "--seq", "1", "--dtype", "float16"]
    db = f"sqlite:///{tmp_path}/ft.db"
    r = invoke(*args, "--trials", "1", "--db", db)
    assert r.exit_code == 0, r.output
    from fusetune.db.store import Store

    ((p, _),) = Store(db).winners()
    assert (p.gpu, p.kernel, p.dims, p.batch, p.seq, p.dtype, p.weights) == (
        "interpreter", "ffn", '{"dim":64,"hidden":128}', 7, 1, "float16", "")


def test_missing_entry_warning_suggests_the_gpu_and_weights() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = _line() + 1
        fusetune.lookup("ffn", FFN_DIMS, "bfloat16", rows=5, weights="fp8-e4m3", gpu="h100")
    (w,) = [w for w in record if issubclass(w.category, fusetune.FusetuneWarning)]
    assert (w.filename, w.lineno) == (__file__, line)
    args = _suggested(str(w.message))
    assert args == ["search", "--kernel", "ffn", "--gpu", "h100-sxm", "--dims",
                    "dim=640,hidden=1728", "--batch", "5", "--seq", "1", "--dtype", "bfloat16",
                    "--weights", "fp8-e4m3"]
    r = invoke(*args, "--dry-run")  # no H100 here: its plan shows the same point
    assert r.exit_code == 0, r.output
    assert re.search(r"│ 5 +│ 1 +│ bfloat16 +│ 5 ", r.output), r.output


def _line() -> int:
    """The line number of the caller's line."""
    frame = sys._getframe(1)
    return frame.f_lineno


# No shipped entry has these dims, and none lies near enough to lend its config (the shipped
# ffn entries are Llama-2-7B's, 4096 -> 11008: runtime.NEARBY_DISTANCE away and more).
FFN_DIMS = {"dim": 640, "hidden": 1728}
# The matmul kernels' one-row structure (BLOCK_M = 1: a GEMV that reads the weights once per
# row) and tensor-core tiles.
FFN_GEMV = {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512, "GROUP_M": 1, "PASSES": 1,
            "SPLIT_K": 1, "THREAD_SUM": 1, "num_warps": 2, "num_stages": 1}
FFN_TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 2,
             "SPLIT_K": 1, "THREAD_SUM": 0, "num_warps": 8, "num_stages": 3}


def ffn_entry(batch: int, seq: int, config: dict[str, int]) -> dict[str, Any]:
    return {"dims": dict(FFN_DIMS), "dtype": "float16", "batch": batch, "seq": seq,
            "config": dict(config)}


def ffn_config(rows: int) -> dict[str, int]:
    got = fusetune.lookup("ffn", FFN_DIMS, "float16", rows=rows, gpu="h100")
    return {k: got[k] for k in FFN_GEMV}


@pytest.mark.parametrize(("rows", "expected"),
                         [(1, FFN_GEMV),  # the one-row structure's one row
                          # past the GEMV's row: the next entry up
                          (2, FFN_TILES), (16, FFN_TILES), (64, FFN_TILES),
                          (256, FFN_TILES)])
def test_lookup_skips_a_structure_that_cannot_serve_the_rows(tmp_path: Path, rows: int,
                                                             expected: dict[str, int]) -> None:
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({
        "h100-sxm": [ffn_entry(1, 1, FFN_GEMV), ffn_entry(1, 256, FFN_TILES)]}, kernel="ffn")))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)  # a tuned config serves
        assert ffn_config(rows) == expected


@pytest.mark.parametrize(("rows", "tuned"), [(17, True), (64, True), (4096, True),
                                             (16, False), (2, False)])
def test_matmul_entry_serves_fewer_than_row_reach_times_fewer_rows(
        tmp_path: Path, rows: int, tuned: bool) -> None:
    # A 4096-row tile serves 17 rows and more (4096 < 256 · 17); at 16 rows and fewer, with only
    # the one-row entry below it, the default heuristic runs, with a warning that says why.
    assert get_spec("ffn").row_reach == 256
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({
        "h100-sxm": [ffn_entry(1, 1, FFN_GEMV), ffn_entry(1, 4096, FFN_TILES)]}, kernel="ffn")))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = fusetune.lookup("ffn", FFN_DIMS, "float16", rows=rows, gpu="h100")
    point = Point.make("ffn", FFN_DIMS, 1, rows, "float16")
    ffn = get_spec("ffn")
    default = ffn.canonical(ffn.default_config(point, gpus.resolve("h100")), point)
    if tuned:
        assert {k: got[k] for k in FFN_TILES} == FFN_TILES
        assert not fusetune_warnings(record)
    else:
        assert got == default
        assert {k: got[k] for k in FFN_TILES} != FFN_TILES
        (msg,) = fusetune_warnings(record)
        assert (f"tuned rows 1..4096, asked {rows} (no tuned config there can serve that many "
                "rows; an entry tuned for R rows serves more than R/256)") in msg


def test_elementwise_kernels_round_up_any_distance(tmp_path: Path) -> None:
    # rmsnorm (and rope) have no row reach: a 4096-row entry serves 2 rows.
    assert get_spec("rmsnorm").row_reach is None and get_spec("rope").row_reach is None
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({
        "h100-sxm": [entry(1, 1, CFG_A), entry(1, 4096, CFG_C)]})))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)
        assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=2, gpu="h100") == CFG_C


def test_default_where_no_tuned_structure_serves_the_rows(tmp_path: Path) -> None:
    # Both entries are one-row configs (a hand-written table may hold one at 64 rows): at 16
    # rows neither serves, so the default heuristic runs, with a warning that says why.
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({
        "h100-sxm": [ffn_entry(1, 1, FFN_GEMV), ffn_entry(64, 1, FFN_GEMV)]}, kernel="ffn")))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = fusetune.lookup("ffn", FFN_DIMS, "float16", rows=16, gpu="h100")
    assert got["BLOCK_M"] > 1
    point = Point.make("ffn", FFN_DIMS, 1, 16, "float16")
    ffn = get_spec("ffn")
    assert got == ffn.canonical(ffn.default_config(point, gpus.resolve("h100")), point)
    (msg,) = fusetune_warnings(record)
    assert ("tuned rows 1..64, asked 16 (no tuned config there can serve that many rows; an "
            "entry tuned for R rows serves more than R/256)") in msg


def test_other_dtype_uses_default(tmp_path: Path) -> None:
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({"h100-sxm": [entry(16, 1, CFG_C)]})))
    with pytest.warns(fusetune.FusetuneWarning, match="no tuned entries"):
        got = fusetune.lookup("rmsnorm", DIMS, "bfloat16", rows=16, gpu="h100")
    assert got == default_for(16, dtype="bfloat16")
    assert got != CFG_C
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=16, gpu="h100") == CFG_C


def test_near_dims_carry_over_far_dims_use_default(tmp_path: Path) -> None:
    wide = cfg(block_d=128, warps=8, rows=4)
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({"h100-sxm": [
        entry(16, 1, wide, dtype="float32", dim=128)]})))
    # Half the width: the entry's config, made canonical for the point, without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)
        got = fusetune.lookup("rmsnorm", {"dim": 64}, "float32", rows=16, gpu="h100")
    point = Point.make("rmsnorm", {"dim": 64}, 16, 1, "float32")
    assert got == SPEC.canonical(wide, point)
    # 32 times narrower: too far to be a better guess than the default heuristic.
    with pytest.warns(fusetune.FusetuneWarning):
        got = fusetune.lookup("rmsnorm", {"dim": 4}, "float32", rows=16, gpu="h100")
    assert got == default_for(16, dtype="float32", dim=4)
    # Twice the width: near, but its block would walk the row in two passes, not hold it
    # whole as where it won (tests/test_coverage.py has that rule).
    with pytest.warns(fusetune.FusetuneWarning):
        got = fusetune.lookup("rmsnorm", {"dim": 256}, "float32", rows=16, gpu="h100")
    assert got == default_for(16, dtype="float32", dim=256)


def test_env_var_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = write(tmp_path / "a.yaml", doc({"h100-sxm": [entry(1, 1, CFG_B)]}))
    b = write(tmp_path / "b.yaml", doc({"h100-sxm": [entry(64, 1, CFG_C)]}))
    monkeypatch.setenv(tables.ENV_VAR, str(a))
    tables.reset()
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == CFG_B
    monkeypatch.setenv(tables.ENV_VAR, os.pathsep.join([str(a), str(b)]))
    tables.reset()
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == CFG_B
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=64, gpu="h100") == CFG_C


def test_load_tables_replaces_env_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    a = write(tmp_path / "a.yaml", doc({"h100-sxm": [entry(1, 1, CFG_B)]}))
    b = write(tmp_path / "b.yaml", doc({"h100-sxm": [entry(1, 1, CFG_C)]}))
    monkeypatch.setenv(tables.ENV_VAR, str(a))
    tables.reset()
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == CFG_B
    fusetune.load_tables(b)
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == CFG_C


def test_load_tables_overrides_shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shipped_text = yaml.safe_dump(doc({"h100-sxm": [entry(1, 1, CFG_A), entry(1, 512, CFG_A)]}))
    monkeypatch.setattr(runtime, "_shipped", tables.parse_tables(shipped_text, "shipped.yaml"))
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == CFG_A
    fusetune.load_tables(write(tmp_path / "user.yaml", doc({
        "h100-sxm": [entry(1, 1, CFG_B), entry(4, 1, CFG_B)]})))
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == CFG_B
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, gpu="h100") == CFG_B
    # past the user table's range the shipped table still answers (no default heuristic)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)
        assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=256, gpu="h100") == CFG_A


def test_gpu_picks_its_entries(tmp_path: Path) -> None:
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({
        "h100-sxm": [entry(4, 1, CFG_C)], "interpreter": [entry(4, 1, CFG_I)]})))
    h100 = fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, gpu="h100")
    interp = fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, gpu="interpreter")
    assert h100 == CFG_C
    assert interp == CFG_I
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, gpu="cpu") == CFG_I
    with pytest.warns(fusetune.FusetuneWarning):
        assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, gpu="3090") == default_for(
            4, gpu="3090")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors map to the interpreter")
def test_cpu_device_uses_interpreter_entries(tmp_path: Path) -> None:
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({
        "h100-sxm": [entry(4, 1, CFG_C)], "interpreter": [entry(4, 1, CFG_I)]})))
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=4) == CFG_I
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=4,
                           device=torch.device("cpu")) == CFG_I


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs the interpreter")
def test_rmsnorm_launches_with_table_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    from fusetune.kernels import rmsnorm as mod

    fusetune.load_tables(write(tmp_path / "t.yaml", doc({"interpreter": [entry(4, 1, CFG_I)]})))
    seen: list[dict[str, int]] = []
    real = mod._launch_2d
    monkeypatch.setattr(mod, "_launch_2d", lambda x, w, y, eps, c, r=None: (
        seen.append(dict(c)), real(x, w, y, eps, c, r)))
    x = torch.randn(2, 2, 64, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)
        fusetune.rmsnorm(x, torch.ones(64, dtype=torch.float16), eps=1e-6)
    assert seen == [CFG_I]


def test_lookup_returns_a_copy(tmp_path: Path) -> None:
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({"h100-sxm": [entry(1, 1, CFG_B)]})))
    got = fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100")
    got["ROWS"] = 999
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == CFG_B


def test_lookup_argument_errors() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        fusetune.lookup("rmsnorm", DIMS, "float64", rows=1, gpu="h100")
    with pytest.raises(ValueError, match="rows=-1"):
        fusetune.lookup("rmsnorm", DIMS, "float16", rows=-1, gpu="h100")
    with pytest.raises(gpus.UnknownGpuError):
        fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="v100")


@pytest.mark.parametrize(("dims", "match"), [
    ({"dim": 4096}, r"ffn: missing dim hidden; ffn's dims are dim, hidden"),
    ({}, r"ffn: missing dims dim, hidden; ffn's dims are dim, hidden"),
    ({"dim": 4096, "hidden": 11000, "heads": 32},
     r"ffn: unknown dim heads; ffn's dims are dim, hidden"),
    ({"dim": 4096, "hiden": 11000},
     r"ffn: missing dim hidden, unknown dim hiden; ffn's dims are dim, hidden"),
    ({"dim": 4096, "hidden": 11000.0}, r"ffn: dims\.hidden=11000\.0 must be a non-negative int"),
    ({"dim": -1, "hidden": 11000}, r"ffn: dims\.dim=-1 must be a non-negative integer"),
    # a value the kernel does not take is an error, not a miss that serves the default
    ({"dim": 4096, "hidden": 11000, "act": 3},
     r"ffn: dims: act=3 is none of ffn's choices: 0 \(silu\), 1 \(gelu_tanh\)"),
])
def test_lookup_names_missing_and_unknown_dims(dims: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fusetune.lookup("ffn", dims, "float16", rows=1, gpu="h100")
    with pytest.raises(ValueError, match=r"unknown kernel 'fnn'; valid: ffn, .*rmsnorm"):
        fusetune.lookup("fnn", FFN_DIMS, "float16", rows=1, gpu="h100")


@pytest.mark.parametrize(("kernel", "dims", "match"), [
    ("qkv", {"dim": 4096, "n_heads": 32, "n_kv_heads": 8, "head_dim": 127, "interleaved": 0},
     r"qkv: dims: head_dim=127 must be even"),
    ("qkv", {"dim": 4096, "n_heads": 32, "n_kv_heads": 8, "head_dim": 128, "interleaved": 0,
             "qk_norm": 2}, r"qkv: dims: qk_norm=2 is none of qkv's choices"),
    ("moe", {"dim": 2048, "experts": 4, "hidden": 768, "top_k": 8},
     r"moe: dims: top_k=8 must be at most experts=4"),
])
def test_lookup_refuses_dims_the_kernel_does_not_take(kernel: str, dims: dict[str, int],
                                                      match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fusetune.lookup(kernel, dims, "bfloat16", rows=1, gpu="h100")
    with pytest.raises(ValueError, match=match):
        fusetune.resolve(kernel, dims, "bfloat16", rows=1, gpu="h100")


def test_reset_forgets_loaded_tables(tmp_path: Path) -> None:
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({"h100-sxm": [entry(1, 1, CFG_B)]})))
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == CFG_B
    tables.reset()
    with pytest.warns(fusetune.FusetuneWarning):
        assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == default_for(1)


def test_merge_keeps_rows_sorted(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", doc({"h100-sxm": [entry(1, 512, CFG_C)]}))
    b = write(tmp_path / "b.yaml", doc({"h100-sxm": [entry(1, 1, CFG_A), entry(64, 1, CFG_B)]}))
    t = fusetune.load_tables(a, b)
    key = ("h100-sxm", "rmsnorm", (("dim", 64),), "float16", "", "")
    assert [r for r, _ in t.groups[key]] == [1, 64, 512]
    assert t.sources == [str(a), str(b)]


def test_cached_config_is_fast(tmp_path: Path) -> None:
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({"interpreter": [entry(4, 1, CFG_I)]})))
    dims = (("dim", 64),)
    device = torch.device("cpu")
    first = runtime.cached_config(SPEC, dims, "float16", 4, device=device)
    assert first == CFG_I

    def per_call_us(call: Callable[[], object], n: int = 2000) -> float:
        # The best of 5 loops: the call's own cost, not a parallel test run's share of the CPU.
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        return best

    us = per_call_us(lambda: runtime.cached_config(SPEC, dims, "float16", 4, device=device))
    assert us < 20, f"cached_config takes {us:.1f} µs per call"
    us = per_call_us(lambda: fusetune.lookup("rmsnorm", DIMS, "float16", rows=4,
                                             gpu="interpreter"))
    assert us < 20, f"lookup takes {us:.1f} µs per call"


def test_cached_config_is_shared_but_lookup_copies(tmp_path: Path) -> None:
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({"interpreter": [entry(4, 1, CFG_I)]})))
    dims = (("dim", 64),)
    a = runtime.cached_config(SPEC, dims, "float16", 4, device="cpu")
    b = runtime.cached_config(SPEC, dims, "float16", 4, device="cpu")
    assert a is b
    c = fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, gpu="interpreter")
    assert c == a and c is not a
    assert copy.deepcopy(a) == CFG_I


def test_lookup_accepts_string_devices(tmp_path: Path) -> None:
    fusetune.load_tables(write(tmp_path / "t.yaml", doc({"interpreter": [entry(4, 1, CFG_I)]})))
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, device="cpu") == CFG_I
    if torch.cuda.is_available():
        want = fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, device=torch.device("cuda:0"))
        assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, device="cuda:0") == want
    else:
        # the same answer as for torch.device("cuda:0"): no GPU, said plainly
        with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
            fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, device=torch.device("cuda:0"))
        with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
            fusetune.lookup("rmsnorm", DIMS, "float16", rows=4, device="cuda:0")


def test_gpu_aliases_in_tables_resolve_to_canonical_names(tmp_path: Path) -> None:
    # A table written under an alias ("h100", "RTX 3090") serves the canonical GPU; a name
    # outside the catalogue (a device-name slug) stays as written.
    path = write(tmp_path / "t.yaml", doc({"h100": [entry(1, 1, CFG_B)],
                                           "RTX 3090": [entry(1, 1, CFG_C)],
                                           "nvidia-a40": [entry(1, 1, CFG_I)]}))
    t = fusetune.load_tables(path)
    assert {k[0] for k in t.groups} == {"h100-sxm", "rtx-3090", "nvidia-a40"}
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100-sxm") == CFG_B
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="3090") == CFG_C


def test_tables_keyed_by_a_device_slug_serve_the_catalogued_gpu(tmp_path: Path) -> None:
    # A table exported while the catalogue lacked the L40S keys it by its device name's slug;
    # the GPU now in the catalogue, the entries serve it under its canonical name.
    path = write(tmp_path / "t.yaml", doc({"nvidia-l40s": [entry(1, 1, CFG_I)]}))
    t = fusetune.load_tables(path)
    assert {k[0] for k in t.groups} == {"l40s"}
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="l40s") == CFG_I
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="NVIDIA L40S") == CFG_I


@pytest.mark.parametrize("key", ["rtx9999", "h100x", "a10", "l40", "3090-ti"])
def test_unknown_gpu_key_refused(tmp_path: Path, key: str) -> None:
    # A misspelled GPU would leave every entry under it dead: refused like an unknown field,
    # by the loader and by the first lookup of FUSETUNE_TABLES (which checks no kernel yet).
    path = write(tmp_path / "t.yaml", doc({"h100-sxm": [entry(1, 1, CFG_B)],
                                           key: [entry(1, 1, CFG_C)]}))
    with pytest.raises(fusetune.TableError) as info:
        fusetune.load_tables(path)
    msg = str(info.value)
    assert str(path) in msg and f"gpus.{key}: unknown GPU {key!r}" in msg, msg
    for name in ("h100-sxm (h100", "rtx-3090 (3090", "interpreter (cpu)", "nvidia-"):
        assert name in msg, msg
    with pytest.raises(fusetune.TableError, match=f"unknown GPU {key!r}"):
        tables.parse_tables(path.read_text(), str(path))
    with pytest.raises(fusetune.TableError, match=f"unknown GPU {key!r}"):
        runtime.parse_tables(path.read_text(), str(path), None)


@pytest.mark.parametrize(("device_name", "key"), [
    ("NVIDIA A40", "nvidia-a40"), ("NVIDIA RTX A6000", "nvidia-rtx-a6000"),
    ("Tesla T4", "tesla-t4"), ("Tesla V100-SXM2-16GB", "tesla-v100-sxm2-16gb"),
    ("Quadro RTX 8000", "quadro-rtx-8000"), ("NVIDIA GeForce RTX 3080 Ti",
                                             "nvidia-geforce-rtx-3080-ti"),
    ("NVIDIA TITAN RTX", "nvidia-titan-rtx"), ("", "cuda-0")])
def test_tables_of_gpus_outside_the_catalogue_load(tmp_path: Path, device_name: str,
                                                   key: str) -> None:
    # `fusetune export` keys a GPU outside the catalogue by its device name's slug (the name
    # gpus.spec_from_device gives it, which the runtime looks up on that device); the device
    # name as the driver reports it is taken for that slug.
    assert gpus.match_device_name(device_name) is None
    assert (gpus._slugify(device_name) or "cuda-0") == key
    for written in (key, device_name or key):
        fusetune.load_tables(write(tmp_path / "t.yaml", doc({written: [entry(1, 1, CFG_C)]})))
        assert fusetune.tables.tuned_entries(key, "rmsnorm") == [
            ((("dim", 64),), "float16", 1, CFG_C)]


def test_gpus_a_table_lists_as_outside_the_catalogue_load(tmp_path: Path) -> None:
    # A device whose name begins otherwise ("Orin" on a Jetson): export lists the GPUs outside
    # the catalogue in the provenance, and the loader takes the names it lists.
    d = doc({"orin": [entry(1, 1, CFG_C)]})
    with pytest.raises(fusetune.TableError, match=r"gpus\.orin: unknown GPU 'orin'"):
        fusetune.load_tables(write(tmp_path / "t.yaml", d))
    d["provenance"]["uncatalogued_gpus"] = ["orin"]
    fusetune.load_tables(write(tmp_path / "t.yaml", d))
    assert fusetune.tables.tuned_entries("orin", "rmsnorm") == [
        ((("dim", 64),), "float16", 1, CFG_C)]
    d["provenance"]["uncatalogued_gpus"] = "orin"
    with pytest.raises(fusetune.TableError,
                       match=r"provenance\.uncatalogued_gpus must be a list of GPU names"):
        fusetune.load_tables(write(tmp_path / "t.yaml", d))


def test_shipped_tables_are_valid_for_every_kernel() -> None:
    # The runtime checks a kernel's shipped entries when that kernel is first looked up; here
    # every file is checked whole against the registry's specs.
    from importlib import resources

    files = [f for f in resources.files("fusetune.shipped_tables").iterdir()
             if f.name.endswith(".yaml")]
    assert files
    for f in files:
        assert len(tables.parse_tables(f.read_text(), f.name)) > 0


def shipped_entries() -> Iterator[tuple[str, str, str, list[dict[str, Any]]]]:
    """(file name, GPU, kernel, entries) of every shipped table, the files in name order."""
    from importlib import resources

    for f in sorted(resources.files("fusetune.shipped_tables").iterdir(), key=lambda f: f.name):
        if f.name.endswith(".yaml"):
            for gpu, kernels in yaml.safe_load(f.read_text())["gpus"].items():
                for kernel, entries in kernels.items():
                    yield f.name, gpu, kernel, entries


def test_shipped_tables_hold_each_lookup_key_once() -> None:
    # Two shipped entries of one key (GPU, kernel, dims, dtype, weights, activations, rows)
    # would leave the answer to the files' order: the newer measurement must replace the older.
    where: dict[tuple[Any, ...], str] = {}
    for name, gpu, kernel, entries in shipped_entries():
        for i, e in enumerate(entries):
            key = (gpu, kernel, tuple(sorted(e["dims"].items())), e["dtype"],
                   e.get("weights", ""), e.get("activations", ""), e["batch"] * e["seq"])
            here = f"{name}: gpus.{gpu}.{kernel}[{i}]"
            assert key not in where, f"{here} repeats {where[key]}"
            where[key] = here


def test_shipped_entries_were_tuned_on_the_kernels_source() -> None:
    # An entry that records a source hash is served only with that source (the kernel's, or
    # that of what its config runs): a change to a kernel (or a function in its SOURCES)
    # without searching its shipped points again would leave them unserved. Entries without
    # one (older files) are served as they are.
    from fusetune.kernels import get_spec

    for name, gpu, kernel, entries in shipped_entries():
        spec = get_spec(kernel)
        stale = [i for i, e in enumerate(entries)
                 if e.get("source") is not None and not spec.runs_source(e["source"], e["config"])]
        assert not stale, (f"{name}: gpus.{gpu}.{kernel}: {len(stale)} entries tuned on another "
                           "source of the kernel: search them again")


def test_shipped_marginal_flags_follow_the_export_rule() -> None:
    # An entry's `marginal` decides whether its winner or the default runs: each flag is what
    # `export` writes from the entry's own two medians (entries without one were exported
    # before winners were judged, and are served as they are).
    from fusetune.export import is_marginal

    for name, gpu, kernel, entries in shipped_entries():
        off = [i for i, e in enumerate(entries) if "marginal" in e
               and e["marginal"] != is_marginal(e["time_us"], e["default_us"])]
        assert not off, f"{name}: gpus.{gpu}.{kernel}: entries {off} flagged otherwise"


def test_env_tables_checked_at_the_kernels_first_lookup(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # FUSETUNE_TABLES is read by the first launch, which knows its own kernel only: another
    # kernel's bad entry is named when that kernel is looked up.
    bad = dict(ffn_entry(1, 1, FFN_GEMV), config={**FFN_GEMV, "BLOCK_N": 3})
    d = doc({"h100-sxm": [entry(1, 1, CFG_B)]})
    d["gpus"]["h100-sxm"]["ffn"] = [bad]
    path = write(tmp_path / "env.yaml", d)
    monkeypatch.setenv(tables.ENV_VAR, str(path))
    tables.reset()
    assert fusetune.lookup("rmsnorm", DIMS, "float16", rows=1, gpu="h100") == CFG_B
    with pytest.raises(fusetune.TableError,
                       match=rf"{re.escape(str(path))}: gpus\.h100-sxm\.ffn\[0\]: config: "
                             r"BLOCK_N=3 must be a power of two"):
        fusetune.lookup("ffn", FFN_DIMS, "float16", rows=1, gpu="h100")
    with pytest.raises(fusetune.TableError, match="BLOCK_N=3"):
        fusetune.load_tables(path)  # loaded by name: checked whole at once
