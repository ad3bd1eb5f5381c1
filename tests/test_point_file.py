"""`fusetune search --points FILE`: the points of a table (its entries for one GPU) or of a
`points:` list, searched in one run; the errors for a file that names no valid point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from fusetune import cli
from fusetune.db.store import Store

FFN = {"dim": 4096, "hidden": 14336}
LINEAR = {"bias": 0, "dim": 14336, "out": 4096, "residual": 1}
CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
          "num_stages": 3}


def entry(dims: dict[str, int], batch: int, seq: int, dtype: str = "bfloat16",
          **extra: Any) -> dict[str, Any]:
    return {"dims": dims, "dtype": dtype, "batch": batch, "seq": seq, "config": CONFIG, **extra}


def table(tmp_path: Path) -> Path:
    path = tmp_path / "tables.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {
        "h100-sxm": {"ffn": [entry(FFN, 1, 1), entry(FFN, 8, 512, "float16"),
                             entry(FFN, 4, 1, weights="fp8-e4m3")],
                     "linear": [entry(LINEAR, 16, 1)]},
        "h200": {"ffn": [entry({"dim": 8192, "hidden": 28672}, 1, 1)]}}}))
    return path


def planned(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Any, list[list[Any]]]:
    """`search --dry-run ARGS`: the result and the points of each planned search."""
    seen: list[list[Any]] = []
    monkeypatch.setattr(cli, "_print_plan", lambda spec, space, points, target, trials:
                        seen.append(list(points)))
    r = CliRunner().invoke(cli.main, ["search", "--dry-run", *args])
    return r, seen


def test_a_tables_entries_for_the_gpu_are_the_points(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    r, seen = planned(monkeypatch, "--kernel", "all", "--gpu", "h100", "--points",
                      str(table(tmp_path)))
    assert r.exit_code == 0, r.output
    assert "4 points of 3 kernels and dims for h100-sxm" in " ".join(r.output.split())
    # Grouped by kernel, dims and weights, in the file's order; h200's entry is not one of them.
    assert [[(p.kernel, p.dim, p.batch, p.seq, p.dtype, p.weights) for p in group]
            for group in seen] == [
        [("ffn", FFN, 1, 1, "bfloat16", ""), ("ffn", FFN, 8, 512, "float16", "")],
        [("ffn", FFN, 4, 1, "bfloat16", "fp8-e4m3")],
        [("linear", LINEAR, 16, 1, "bfloat16", "")]]
    r, seen = planned(monkeypatch, "--kernel", "linear", "--gpu", "h100", "--points",
                      str(table(tmp_path)))
    assert r.exit_code == 0, r.output
    assert [[p.kernel for p in g] for g in seen] == [["linear"]]


def test_a_points_list_takes_rows_or_batch_and_seq(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    path = tmp_path / "points.yaml"
    path.write_text(yaml.safe_dump({"points": [
        {"kernel": "ffn", "dims": FFN, "rows": 1024, "dtype": "bfloat16"},
        {"kernel": "ffn", "dims": FFN, "batch": 2, "seq": 64, "dtype": "bfloat16"},
        {"kernel": "ffn", "dims": FFN, "rows": 1024, "dtype": "bfloat16"},  # a repeat: once
        {"kernel": "qkv", "dims": {"dim": 3072, "head_dim": 96, "interleaved": 0, "n_heads": 32,
                                   "n_kv_heads": 32}, "rows": 1, "dtype": "float16",
         "weights": "fp8-e4m3", "activations": "fp8"}]}))
    r, seen = planned(monkeypatch, "--kernel", "all", "--gpu", "h100", "--points", str(path))
    assert r.exit_code == 0, r.output
    assert [[(p.kernel, p.batch, p.seq, p.weights, p.activations) for p in g] for g in seen] == [
        [("ffn", 1024, 1, "", ""), ("ffn", 2, 64, "", "")], [("qkv", 1, 1, "fp8-e4m3", "fp8")]]


@pytest.mark.parametrize(("doc", "expected"), [
    ({"gpus": {"h200": {}}}, "a table without entries for h100-sxm; it has h200"),
    ({"points": [{"kernel": "ffn", "dims": {"dim": 64}, "rows": 1, "dtype": "bfloat16"}]},
     "entry 1 (ffn): dims {'dim': 64} do not match ffn's dim, hidden"),
    ({"points": [{"kernel": "ffn", "dims": FFN, "rows": 1, "dtype": "bf16"}]},
     "dtype 'bf16'; valid: float16, bfloat16, float32"),
    ({"points": [{"kernel": "ffn", "dims": FFN, "rows": 1, "batch": 2, "dtype": "bfloat16"}]},
     "give rows, or batch and seq, not both"),
    ({"points": [{"kernel": "ffn", "dims": FFN, "rows": 0, "dtype": "bfloat16"}]},
     "rows 0 must be a positive integer"),
    ({"points": [{"kernel": "ffn", "dims": {**FFN, "act": 5}, "rows": 1, "dtype": "bfloat16"}]},
     "entry 1 (ffn): dims: act=5 is none of ffn's choices: 0 (silu), 1 (gelu_tanh)"),
    ({"points": [{"kernel": "ffn", "dims": {**FFN, "hidden": 0}, "rows": 1,
                  "dtype": "bfloat16"}]}, "dims: hidden=0 must be a positive integer"),
    ({"points": [{"kernel": "ffn", "dims": FFN, "rows": 1, "dtype": "bfloat16",
                  "weights": "int4"}]}, "unknown weight format 'int4'"),
    ({"points": [{"kernel": "rmsnorm", "dims": {"dim": 64}, "rows": 1, "dtype": "bfloat16",
                  "weights": "fp8-e4m3"}]}, "rmsnorm has no weights"),
    ({"points": [{"kernel": "gemm", "dims": {}, "rows": 1, "dtype": "bfloat16"}]},
     "unknown kernel 'gemm'"),
    ({"points": [{"dims": FFN, "rows": 1, "dtype": "bfloat16"}]}, "entry 1: no kernel name"),
    ({"kernels": []}, "expected a fusetune table (gpus: ...) or a list of points"),
])
def test_a_bad_file_names_the_entry_and_the_value(tmp_path: Path, doc: dict[str, Any],
                                                  expected: str) -> None:
    path = tmp_path / "points.yaml"
    path.write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "all", "--gpu", "h100", "--dry-run",
                                      "--points", str(path)])
    assert r.exit_code == 1, r.output
    assert expected in " ".join(r.output.split()), r.output


def test_no_points_of_the_kernel_and_an_unreadable_file(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "qkv", "--gpu", "h100", "--dry-run",
                                      "--points", str(table(tmp_path))])
    assert r.exit_code == 1 and "no qkv points for h100-sxm in it" in r.output, r.output
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "all", "--gpu", "h100", "--dry-run",
                                      "--points", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 1 and "cannot read it" in r.output, r.output


@pytest.mark.parametrize(("args", "expected"), [
    (["--model", "llama-3-8b"], "leave out --model"),
    (["--dims", "dim=64,hidden=96", "--dtype", "float32"], "leave out --dims, --dtype"),
    (["--rows", "1,4"], "leave out --rows"),
    (["--weights", "fp8-e4m3"], "leave out --weights"),
])
def test_points_refuses_the_options_that_name_points(tmp_path: Path, args: list[str],
                                                     expected: str) -> None:
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "all", "--gpu", "h100", "--dry-run",
                                      "--points", str(table(tmp_path)), *args])
    assert r.exit_code == 2 and "--points names the points itself" in r.output, r.output
    assert expected in r.output


def test_an_exported_table_searched_again_from_its_points(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    # On the interpreter: a points list searched into a database, exported; the export's own
    # points searched again resume the stored studies (no config run twice).
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    points = tmp_path / "points.yaml"
    points.write_text(yaml.safe_dump({"points": [
        {"kernel": "rmsnorm", "dims": {"dim": 64}, "rows": 4, "dtype": "float32"},
        {"kernel": "ffn", "dims": {"dim": 32, "hidden": 48}, "batch": 2, "seq": 3,
         "dtype": "float32"}]}))
    db = f"sqlite:///{tmp_path}/ft.db"
    search = ["search", "--kernel", "all", "--backend", "interpreter", "--trials", "2", "--db",
              db]
    r = CliRunner().invoke(cli.main, [*search, "--points", str(points)])
    assert r.exit_code == 0, r.output
    won = {(p.kernel, p.batch, p.seq) for p, _ in Store(db).winners()}
    assert won == {("rmsnorm", 4, 1), ("ffn", 2, 3)}
    store = Store(db)

    def n_results() -> int:
        return sum(len(store.results(p.id)) for p in store.points())

    stored = n_results()
    assert stored >= 2
    exported = tmp_path / "tables.yaml"
    r = CliRunner().invoke(cli.main, ["export", str(exported), "--db", db])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli.main, [*search, "--points", str(exported)])
    assert r.exit_code == 0, r.output
    assert "2 points of 2 kernels and dims for interpreter" in " ".join(r.output.split())
    assert n_results() == stored


def test_stale_takes_the_entries_tuned_on_other_code(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    # After an edit to a kernel, only the entries the lookup no longer serves are searched
    # again: those whose source is neither the kernel's nor that of what their config runs.
    from fusetune.kernels import get_spec

    spec = get_spec("ffn")
    own = spec.config_source_hash(CONFIG)
    unfused = {**CONFIG, "UNFUSED": 1}
    path = tmp_path / "tables.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {
        "h100-sxm": {"ffn": [entry(FFN, 1, 1, source=own),               # served
                             entry(FFN, 4, 1, source=spec.source_hash),  # served
                             entry(FFN, 16, 1),                           # no source: served
                             entry(FFN, 64, 1, source="0123456789ab"),    # another version
                             {**entry(FFN, 256, 1, source=own), "config": unfused}]}}}))
    r, seen = planned(monkeypatch, "--kernel", "all", "--gpu", "h100", "--points", str(path),
                      "--stale")
    assert r.exit_code == 0, r.output
    assert "2 stale points" in " ".join(r.output.split())
    assert [[p.batch for p in group] for group in seen] == [[64, 256]]
    fresh = tmp_path / "fresh.yaml"
    fresh.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {
        "h100-sxm": {"ffn": [entry(FFN, 1, 1, source=own)]}}}))
    r, seen = planned(monkeypatch, "--kernel", "all", "--gpu", "h100", "--points", str(fresh),
                      "--stale")
    assert r.exit_code == 0 and seen == [], r.output
    assert "nothing to search" in " ".join(r.output.split())
    r, _ = planned(monkeypatch, "--kernel", "ffn", "--gpu", "h100", "--stale")
    assert r.exit_code == 2 and "--stale picks among the entries of --points" in r.output
    listed = tmp_path / "list.yaml"
    listed.write_text(yaml.safe_dump({"points": [{"kernel": "ffn", "dims": FFN, "rows": 1,
                                                  "dtype": "bfloat16"}]}))
    r, _ = planned(monkeypatch, "--kernel", "all", "--gpu", "h100", "--points", str(listed),
                   "--stale")
    assert r.exit_code == 1 and "a list of points does not" in r.output
