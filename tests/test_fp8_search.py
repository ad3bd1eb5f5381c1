"""Searching FP8 points: `fusetune search --weights`, the stored points, the exported table's
`weights`, and the runtime lookup that FP8 weights take (on the interpreter: see
cli_helpers.run_interpreted)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import yaml
from cli_helpers import Ran, run_interpreted
from click.testing import CliRunner

import fusetune
from fusetune import cli
from fusetune.db.store import Store


def search(db_url: str, cwd: Path, *args: str) -> Ran:
    return run_interpreted(cwd, "search", "--backend", "interpreter", "--db", db_url, *args)


@pytest.mark.slow
def test_fp8_search_export_lookup(sqlite_url: str, tmp_path: Path, fresh_tables: None) -> None:
    dims = {"dim": 64, "hidden": 48}
    proc = search(sqlite_url, tmp_path, "--kernel", "ffn", "--weights", "fp8-e4m3", "--dims",
                  "dim=64,hidden=48", "--batch", "2", "--seq", "3", "--dtype", "float16",
                  "--trials", "6")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "w=fp8-e4m3" in proc.stdout  # the point's label
    store = Store(sqlite_url)
    ((point,),) = [[p for p in store.points() if p.kernel == "ffn"]]
    assert point.weights == "fp8-e4m3"
    ok = [r for r in store.results(point.id).values() if r.status == "ok"]
    assert len(ok) >= 6
    # `fusetune show` names the weight format, in the list and for the point.
    shown = CliRunner().invoke(cli.main, ["show", "--db", sqlite_url])
    assert shown.exit_code == 0 and "fp8-e4m3" in shown.output, shown.output
    shown = CliRunner().invoke(cli.main, ["show", "--db", sqlite_url, "--point", str(point.id)])
    assert shown.exit_code == 0 and "weights fp8-e4m3" in shown.output, shown.output
    out = tmp_path / "tables.yaml"
    exported = CliRunner().invoke(cli.main, ["export", str(out), "--db", sqlite_url])
    assert exported.exit_code == 0, exported.output
    (entry,) = yaml.safe_load(out.read_text())["gpus"]["interpreter"]["ffn"]
    assert entry["weights"] == "fp8-e4m3" and "activations" not in entry
    assert "ACT_FP8" not in entry["config"]  # the mode is the point's, never a tunable
    fusetune.load_tables(out)
    ((_, winner),) = store.winners(kernel="ffn")
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)
        assert fusetune.lookup("ffn", dims, "float16", rows=6, weights="fp8-e4m3",
                               gpu="interpreter") == winner.config
        if not torch.cuda.is_available():  # the kernel itself looks it up for FP8 weights
            x = torch.randn(2, 3, 64, dtype=torch.float16)
            w1, s1 = fusetune.quantize_fp8(torch.randn(48, 64) / 8)
            w3, s3 = fusetune.quantize_fp8(torch.randn(48, 64) / 8)
            fusetune.ffn(x, torch.ones(64, dtype=torch.float16), w1, w3, eps=1e-6, w1_scale=s1,
                         w3_scale=s3)
    # 16-bit weights are another point: not tuned here.
    with pytest.warns(fusetune.FusetuneWarning, match="no tuned config"):
        fusetune.lookup("ffn", dims, "float16", rows=6, gpu="interpreter")


@pytest.mark.parametrize(("args", "expected"), [
    (["--kernel", "rope", "--weights", "fp8-e4m3"], "rope has no weights"),
    (["--kernel", "ffn", "--weights", "fp16", "--dtype", "float16,bfloat16"],
     "weights fp16 with bfloat16 activations"),
    (["--kernel", "qkv", "--weights", "int8"],
     "unknown weight format 'int8'; valid: fp8-e4m3, fp8-e5m2, fp16, bf16"),
])
def test_weights_option_errors_name_the_choices(args: list[str], expected: str) -> None:
    r = CliRunner().invoke(cli.main, ["search", *args, "--gpu", "h100", "--dry-run"])
    assert r.exit_code != 0 and expected in r.output, r.output


def test_dry_run_prunes_fp8_activations_without_fp8_tensor_cores() -> None:
    plan = {}
    for gpu in ("3090", "h100"):
        r = CliRunner().invoke(cli.main, [
            "search", "--kernel", "lola", "--gpu", gpu, "--weights", "fp8-e5m2",
            "--activations", "fp8", "--dry-run", "--batch", "4096", "--seq", "1",
            "--dtype", "float16"])
        assert r.exit_code == 0, r.output
        plan[gpu] = r.output
    assert "fp8-tensor-cores" in plan["3090"] and "fp8-tensor-cores" not in plan["h100"]
    assert "fp8 activations" in plan["h100"]  # the mode is in the plan's points
    # Weight-only FP8 (the default) runs everywhere: nothing is pruned for it.
    r = CliRunner().invoke(cli.main, [
        "search", "--kernel", "lola", "--gpu", "3090", "--weights", "fp8-e5m2", "--dry-run",
        "--batch", "4096", "--seq", "1", "--dtype", "float16"])
    assert r.exit_code == 0 and "fp8-tensor-cores" not in r.output, r.output
    # FP8 activations only beside FP8 weights.
    r = CliRunner().invoke(cli.main, [
        "search", "--kernel", "lola", "--gpu", "h100", "--activations", "fp8", "--dry-run"])
    assert r.exit_code != 0 and "activations 'fp8' need FP8 weights" in r.output, r.output


@pytest.mark.slow
def test_fp8_activations_search_stores_and_exports_their_own_key(
        sqlite_url: str, tmp_path: Path, fresh_tables: None) -> None:
    # Asked for, FP8 activations are a point of their own: stored, exported and looked up
    # under their mode; a weight-only lookup never returns one of their configs.
    dims = {"dim": 64, "hidden": 48}
    proc = search(sqlite_url, tmp_path, "--kernel", "ffn", "--weights", "fp8-e4m3",
                  "--activations", "fp8", "--dims", "dim=64,hidden=48", "--batch", "2",
                  "--seq", "3", "--dtype", "float16", "--trials", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    store = Store(sqlite_url)
    ((point,),) = [[p for p in store.points() if p.kernel == "ffn"]]
    assert (point.weight_format, point.activations) == ("fp8-e4m3", "fp8")
    assert "/a=fp8" in point.study_name
    out = tmp_path / "tables.yaml"
    exported = CliRunner().invoke(cli.main, ["export", str(out), "--db", sqlite_url])
    assert exported.exit_code == 0, exported.output
    (entry,) = yaml.safe_load(out.read_text())["gpus"]["interpreter"]["ffn"]
    assert (entry["weights"], entry["activations"]) == ("fp8-e4m3", "fp8")
    assert entry["config"]["PASSES"] == 2  # the norm is its own pass with FP8 activations
    fusetune.load_tables(out)
    ((_, winner),) = store.winners(kernel="ffn")
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)
        assert fusetune.lookup("ffn", dims, "float16", rows=6, weights="fp8-e4m3",
                               activations="fp8", gpu="interpreter") == winner.config
    with pytest.warns(fusetune.FusetuneWarning, match="no tuned config.*weights fp8-e4m3; "):
        fusetune.lookup("ffn", dims, "float16", rows=6, weights="fp8-e4m3", gpu="interpreter")
