"""The `fusetune` command: plans, errors, and the whole flow search -> show -> export -> lookup.

Searches run in subprocesses on Triton's interpreter (the backend is chosen before the kernels
are imported); the rest runs in-process through click's CliRunner. The flows that store
results run on SQLite and on PostgreSQL (see the `db_url` fixture).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import click
import pytest
import sqlalchemy
import torch
import yaml
from cli_helpers import interp_env, invoke
from rich.console import Console
from sqlalchemy.exc import OperationalError, ProgrammingError

import fusetune
from fusetune import cli
from fusetune.db.store import Store, make_engine

INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(
    not INTERP, reason="the in-process kernel check needs TRITON_INTERPRET=1 (no CUDA)")


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rich tables at a fixed width, whatever the terminal pytest runs in."""
    monkeypatch.setattr(cli, "console", Console(highlight=False, width=200))
    monkeypatch.setattr(cli, "err", Console(stderr=True, highlight=False, width=200))


def search_cmd(db_url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "fusetune.cli", "search", "--kernel", "rmsnorm",
            "--backend", "interpreter", "--db", db_url, *args]


def run_search(db_url: str, cwd: Path, *args: str, timeout: float = 240
               ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(search_cmd(db_url, *args), cwd=cwd, env=interp_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def query(db_url: str, sql: str) -> list[tuple]:
    """Rows of `sql` on the database at `db_url` (SQLite or PostgreSQL), read as a user would."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as con:
            return [tuple(r) for r in con.execute(sqlalchemy.text(sql)).all()]
    finally:
        engine.dispose()


def results_rows(db_url: str) -> list[tuple]:
    return query(db_url, "SELECT r.id, r.point_id, r.config_key, r.status, r.time_us, "
                 "r.created_at, r.trial_number, p.batch, p.seq FROM ft_results r "
                 "JOIN ft_points p ON p.id = r.point_id ORDER BY r.id")


def study_trial_counts(db_url: str) -> dict[str, int]:
    import optuna

    from fusetune.tuner.search import open_storage

    storage = open_storage(db_url)
    names = [n for (n,) in query(db_url, "SELECT study_name FROM ft_points")]
    return {n: len(optuna.load_study(study_name=n, storage=storage).get_trials()) for n in names}


def pruned_total(output: str, gpu: str) -> int:
    m = re.search(rf"(\d+) configs pruned in all under {re.escape(gpu)}'s limits", output)
    assert m, output
    return int(m.group(1))


# ---- planning and errors (no GPU, no kernels run) ------------------------------------------


def test_dry_run_3090() -> None:
    r = invoke("search", "--kernel", "rmsnorm", "--gpu", "3090", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "Plan for rmsnorm on rtx-3090" in r.output
    assert "101376 B shared memory per block" in r.output
    assert "smem>101376B" in r.output
    assert "12 points" in r.output  # the default grid: 3 batches x 2 seqs x 2 dtypes
    assert pruned_total(r.output, "rtx-3090") > 0


def test_dry_run_h100_prunes_fewer_than_3090() -> None:
    r3090 = invoke("search", "--kernel", "rmsnorm", "--gpu", "3090", "--dry-run")
    rh100 = invoke("search", "--kernel", "rmsnorm", "--gpu", "h100", "--dry-run")
    assert r3090.exit_code == 0 and rh100.exit_code == 0, rh100.output
    assert "h100-sxm" in rh100.output and "232448 B shared memory" in rh100.output
    assert "smem>" not in rh100.output
    assert 0 < pruned_total(rh100.output, "h100-sxm") < pruned_total(r3090.output, "rtx-3090")


def test_dry_run_with_explicit_grid() -> None:
    r = invoke("search", "--kernel", "rmsnorm", "--gpu", "3090", "--dry-run", "--dim", "64",
               "--batch", "1", "--seq", "1", "--dtype", "float16", "--trials", "100")
    assert r.exit_code == 0, r.output
    assert "1 points" in r.output and "dim=64" in r.output
    # BLOCK_D, ROWS and num_stages collapse at D=64, rows=1: only the 6 warp counts remain
    assert re.search(r"│ 1\s+│ 1\s+│ float16 │ 1\s+│ 6\s+│ 6\s+│ 0\s+│", r.output), r.output
    assert pruned_total(r.output, "rtx-3090") == 0


@pytest.mark.parametrize("interpret", ["unset", "1"])
def test_gpu_without_dry_run_and_no_gpu(monkeypatch: pytest.MonkeyPatch, interpret: str
                                        ) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    if interpret == "unset":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:  # how CPU-only machines (and this suite) run: the interpreter switched on
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    r = invoke("search", "--kernel", "rmsnorm", "--gpu", "3090")
    assert r.exit_code != 0
    assert "no CUDA GPU is visible" in r.output, r.output
    assert "--dry-run" in r.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["search", "--kernel", "layernorm", "--dry-run"],
         ["unknown kernel 'layernorm'",
          "valid: ffn, linear, lola, moe, qkv, rmsnorm, rmsnorm_bwd, rope, rope_bwd, swiglu, "
          "swiglu_bwd"]),
        (["search", "--kernel", "rmsnorm", "--gpu", "v100", "--dry-run"],
         ["unknown GPU 'v100'", "rtx-3090", "h100-sxm", "h200"]),
        (["search", "--kernel", "rmsnorm", "--dry-run", "--dtype", "float64"],
         ["unknown dtype 'float64'", "float16", "bfloat16", "float32"]),
        (["search", "--kernel", "rmsnorm", "--dry-run", "--model", "gpt-5"],
         ["unknown model 'gpt-5'", "llama-2-7b"]),
        (["search", "--kernel", "rmsnorm", "--dry-run", "--backend", "rocm"],
         ["'rocm' is not one of", "auto", "cuda", "interpreter"]),
        (["export", "out.yaml", "--gpu", "v100", "--db", "sqlite://"],
         ["unknown GPU 'v100'", "h100-sxm"]),
        (["show", "--gpu", "v100", "--db", "sqlite://"], ["unknown GPU 'v100'", "h100-sxm"]),
        (["show", "--kernel", "rmsnrom", "--db", "sqlite://"],
         ["unknown kernel 'rmsnrom'", "valid: ffn, linear, lola, moe, qkv, rmsnorm, rmsnorm_bwd, "
          "rope, rope_bwd, swiglu, swiglu_bwd"]),
        (["export", "out.yaml", "--kernel", "rmsnrom", "--db", "sqlite://"],
         ["unknown kernel 'rmsnrom'", "valid: ffn, linear, lola, moe, qkv, rmsnorm, rmsnorm_bwd, "
          "rope, rope_bwd, swiglu, swiglu_bwd"]),
        (["search", "--kernel", "rmsnorm", "--gpu", "l40", "--dry-run"],
         ["unknown GPU 'l40'", "l40s (nvidia-l40s)", "rtx-5090 (5090", "b200"]),
    ],
    ids=["kernel", "gpu", "dtype", "model", "backend", "export-gpu", "show-gpu", "show-kernel",
         "export-kernel", "gpu-lookalike"],
)
def test_unknown_choices_named(args: list[str], expected: list[str]) -> None:
    r = invoke(*args)
    assert r.exit_code != 0
    # a clean message, not a traceback
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    for text in expected:
        assert text in r.output, r.output


@pytest.mark.parametrize("batch", ["1,x", "0", "1,-4", ","])
def test_bad_batch(batch: str) -> None:
    r = invoke("search", "--kernel", "rmsnorm", "--dry-run", "--batch", batch)
    assert r.exit_code == 2
    assert "Invalid value for '--batch'" in r.output
    assert "integers" in r.output


@pytest.mark.parametrize(("option", "value"), [
    ("--batch", "1,,2"), ("--batch", "1,2,"), ("--seq", ",1"), ("--seq", "1, ,2"),
    ("--dtype", "float16,,bfloat16"), ("--dtype", "float16,")])
def test_empty_list_items_refused(option: str, value: str) -> None:
    # An empty item is a slip (a value left out), not a separator to skip.
    r = invoke("search", "--kernel", "rmsnorm", "--dry-run", option, value)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}'" in r.output and repr(value) in r.output, r.output
    assert "empty item" in r.output, r.output


@pytest.mark.parametrize(("kernel", "dims", "bad"), [
    ("rmsnorm", "dim=0", "dim=0 must be a positive integer (a size; of rmsnorm's dims only "
                         "residual take 0)"),
    ("rmsnorm", "dim=-64", "dim=-64 must be a positive integer"),
    ("ffn", "dim=64,hidden=0", "hidden=0 must be a positive integer (a size; of ffn's dims "
                               "only act take 0)"),
    ("moe", "dim=64,experts=0,hidden=48,top_k=2", "experts=0 must be a positive integer (a "
                                                  "size)"),
    ("rope", "heads=4,head_dim=16,interleaved=2",
     "interleaved=2 is none of rope's choices: 0 (half-split pairs (i, i + head_dim/2)), 1 "
     "(interleaved pairs (2i, 2i + 1))"),
    ("linear", "bias=0,dim=64,out=32,residual=-1",
     "residual=-1 is none of linear's choices: 0 (no residual), 1 (a residual added)"),
    ("qkv", "dim=64,head_dim=16,interleaved=0,n_heads=4,n_kv_heads=2,qk_norm=2",
     "qk_norm=2 is none of qkv's choices: 0 (no q/k norms), 1"),
    ("ffn", "dim=64,hidden=96,act=2", "act=2 is none of ffn's choices: 0 (silu), 1 (gelu_tanh)"),
    ("qkv", "dim=64,head_dim=15,interleaved=0,n_heads=4,n_kv_heads=2",
     "head_dim=15 must be even"),
    ("rope", "heads=4,head_dim=7,interleaved=1", "head_dim=7 must be even"),
    ("moe", "dim=64,experts=4,hidden=48,top_k=5", "top_k=5 must be at most experts=4"),
])
def test_dims_each_kernel_refuses(kernel: str, dims: str, bad: str) -> None:
    # Sizes are at least 1, switches and choices take one of their values, and what a kernel
    # needs of its dims together holds: the kernel's own word, before any work.
    for command in ("search", "evaluate-search"):
        r = invoke(command, "--kernel", kernel, "--dims", dims, "--dry-run"
                   if command == "search" else "--no-grid", "--gpu", "h100")
        assert r.exit_code == 1, r.output
        (error,) = [line for line in r.output.splitlines() if line.startswith("Error:")]
        assert error.startswith(f"Error: --dims: {bad}"), error
        assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)


def test_switch_dims_take_zero() -> None:
    # The switches (a layout, an epilogue term, an optional dim at its default) and ffn's
    # activation take 0; the plan takes them as given.
    for kernel, dims in (("rope", "heads=4,head_dim=16,interleaved=0"),
                         ("linear", "bias=0,dim=64,out=32,residual=0"),
                         ("qkv", "dim=64,head_dim=16,interleaved=0,n_heads=4,n_kv_heads=2,"
                                 "qk_norm=0"),
                         ("ffn", "dim=64,hidden=96,act=0")):
        r = invoke("search", "--kernel", kernel, "--dims", dims, "--gpu", "h100", "--dry-run",
                   "--batch", "1", "--seq", "1", "--dtype", "float16")
        assert r.exit_code == 0, r.output
        assert f"Plan for {kernel} on h100-sxm" in r.output


def test_every_models_dims_are_what_their_kernels_accept() -> None:
    # What --dims refuses no model gives a kernel: each preset's dims of each kernel it
    # launches pass that kernel's own check, and the dims a model sets to 0 are its choices.
    from fusetune.kernels import get_spec
    from fusetune.models import PRESETS, launched_dims

    seen = set()
    for model in PRESETS.values():
        for training in (False, True)[:1 if model.experts else 2]:  # MoE: no training path
            for kernel, uses in launched_dims(model, training).items():
                spec = get_spec(kernel)
                for _, dims in uses:
                    assert spec.dims_problem(dims) is None, (model.name, kernel, dims)
                    seen |= {name for name, value in dims.items() if value == 0}
    assert seen <= {"bias", "interleaved", "residual", "qk_norm", "act"}, seen
    assert {"bias", "interleaved", "residual"} <= seen


def test_weights_help_names_every_kernel_that_takes_weight_formats() -> None:
    from fusetune.kernels import REGISTRY

    takes = sorted(name for name, spec in REGISTRY.items() if spec.weight_formats)
    assert takes == ["ffn", "linear", "lola", "moe", "qkv"]
    for command in (cli.search, cli.evaluate_search):
        (option,) = [p for p in command.params if p.name == "weights"]
        named = re.match(r"Weight format \(([^)]*)\)", option.help or "")
        assert named is not None, option.help
        assert sorted(named.group(1).split(", ")) == takes, option.help


def test_evaluate_search_takes_one_kernel() -> None:
    # `search` tunes a model's kernels with --kernel all / training; evaluate-search measures
    # one kernel's points, and its help offers no more.
    def kernel_help(command: click.Command) -> str:
        (option,) = [p for p in command.params if p.name == "kernel"]
        return option.help or ""

    assert "`all`" in kernel_help(cli.search) and "`training`" in kernel_help(cli.search)
    help_text = kernel_help(cli.evaluate_search)
    assert "`all`" not in help_text and "`training`" not in help_text, help_text
    assert "one kernel" in help_text and "fusetune search --kernel all" in help_text
    names = {p.name for p in cli.evaluate_search.params}
    assert not names & {"max_batch", "prefill"}, names  # they apply to --kernel all alone
    assert {"max_batch", "prefill"} <= {p.name for p in cli.search.params}
    for kernel in ("all", "training"):
        r = invoke("evaluate-search", "--kernel", kernel, "--no-grid", "--model", "tiny")
        assert r.exit_code == 2, r.output
        assert f"Invalid value for '--kernel': '{kernel}'" in r.output, r.output
        assert "ffn, linear, lola, moe, qkv, rmsnorm" in r.output, r.output
        assert f"fusetune search --kernel {kernel}" in r.output, r.output


@pytest.mark.parametrize(("gpu", "name", "smem"), [
    ("l40s", "l40s", 101376), ("A10G", "a10g", 101376), ("rtx 6000 ada", "rtx-6000-ada", 101376),
    ("h100-nvl", "h100-nvl", 232448), ("H800", "h800", 232448), ("h20", "h20", 232448),
    ("GH200", "gh200", 232448), ("b200", "b200", 232448), ("5090", "rtx-5090", 101376)])
def test_dry_run_on_the_new_gpus(gpu: str, name: str, smem: int) -> None:
    r = invoke("search", "--kernel", "rmsnorm", "--gpu", gpu, "--dry-run", "--dim", "4096",
               "--batch", "1", "--seq", "1", "--dtype", "float16")
    assert r.exit_code == 0, r.output
    assert f"Plan for rmsnorm on {name} " in r.output
    assert f"{smem} B shared memory per block" in r.output


def test_gpus_lists_catalogue() -> None:
    r = invoke("gpus")
    assert r.exit_code == 0, r.output
    for name in ("rtx-3090", "h100-sxm", "h200", "a100-80gb", "l40s", "b200", "rtx-5090"):
        assert re.search(rf"│ {re.escape(name)}\s+│", r.output), name
    if not torch.cuda.is_available():
        assert "No CUDA GPU is visible here" in r.output


def test_show_and_export_on_empty_db(db_url: str, tmp_path: Path) -> None:
    Store(db_url).engine.dispose()  # a database without results (show does not make one)
    r = invoke("show", "--db", db_url)
    assert r.exit_code == 0 and "holds no points" in r.output
    r = invoke("export", str(tmp_path / "t.yaml"), "--db", db_url)
    assert r.exit_code != 0 and "no winners" in r.output
    assert not (tmp_path / "t.yaml").exists()
    # --storage is the same option (Optuna's word for the database URL)
    r = invoke("show", "--storage", db_url)
    assert r.exit_code == 0 and "holds no points" in r.output
    r = invoke("export", str(tmp_path / "t.yaml"), "--storage", db_url)
    assert r.exit_code != 0 and "no winners" in r.output


def _one_winner(db: str) -> None:
    from fusetune.db.store import PointKey

    store = Store(db)
    cfg = {"BLOCK_D": 64, "ROWS": 1, "num_warps": 4, "num_stages": 1}
    pid = store.point_id(PointKey(gpu="h100-sxm", kernel="rmsnorm", dims={"dim": 64}, batch=1,
                                  seq=1, dtype="float16", weights="", backend="cuda",
                                  kernel_hash="abc", triton_version="3.6.0",
                                  torch_version="2.11.0"))
    store.set_winner(pid, cfg, 2.0, cfg, 2.0, 10, 10, 1)
    store.engine.dispose()


def test_show_and_export_check_the_kernel_name(sqlite_url: str, tmp_path: Path) -> None:
    from fusetune.db.store import PointKey

    _one_winner(sqlite_url)
    store = Store(sqlite_url)  # a kernel this version no longer has, still in the database
    cfg = {"BLOCK": 64, "num_warps": 4}
    pid = store.point_id(PointKey(gpu="h100-sxm", kernel="retired", dims={"dim": 64}, batch=1,
                                  seq=1, dtype="float16", weights="", backend="cuda",
                                  kernel_hash="abc", triton_version="3.6.0",
                                  torch_version="2.11.0"))
    store.set_winner(pid, cfg, 2.0, cfg, 2.0, 10, 10, 1)
    store.engine.dispose()
    out = tmp_path / "t.yaml"
    for command in (["show"], ["export", str(out)]):
        r = invoke(*command, "--db", sqlite_url, "--kernel", "rmsnrom")
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), repr(r.exception)
        assert ("unknown kernel 'rmsnrom'; valid: ffn, linear, lola, moe, qkv, rmsnorm, "
                "rmsnorm_bwd, rope, rope_bwd, swiglu, swiglu_bwd; or package.module:name of a "
                "kernel declared with @fusetune.autotune; or one that sqlite:///") in r.output, \
            r.output
        assert "holds: retired" in r.output and "fusetune search" not in r.output, r.output
        assert not out.exists()
    r = invoke("show", "--db", sqlite_url, "--kernel", "retired")
    assert r.exit_code == 0 and "│ retired" in r.output, r.output
    r = invoke("show", "--db", sqlite_url, "--kernel", "ffn")  # a kernel, without points
    assert r.exit_code == 0 and "holds no points matching the filters" in r.output, r.output
    r = invoke("export", str(out), "--db", sqlite_url, "--kernel", "ffn")
    assert r.exit_code == 1 and "no winners" in r.output and "fusetune search" in r.output
    r = invoke("export", str(out), "--db", sqlite_url, "--kernel", "rmsnorm")
    assert r.exit_code == 0 and "wrote 1 entries for h100-sxm" in r.output, r.output


def test_export_into_a_directory_that_takes_no_file_is_one_line(
        sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A directory that exists and refuses the file is said to be so, not to be missing.
    _one_winner(sqlite_url)
    if sys.platform == "linux" and Path("/proc").is_dir():
        r = invoke("export", "/proc/tables.yaml", "--db", sqlite_url)  # even root writes none
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), repr(r.exception)
        assert r.output.strip().splitlines() == [
            "Error: cannot write /proc/tables.yaml: directory '/proc' cannot be written"], r.output
    real = Path.write_text

    def refuse(error: type[OSError], code: int, why: str) -> None:
        def write_text(self: Path, *args: object, **kwargs: object) -> int:
            if self.parent == tmp_path:
                raise error(code, why, str(self))
            return real(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(Path, "write_text", write_text)

    out = tmp_path / "t.yaml"
    for error, code, why, said in (
            (FileNotFoundError, 2, "No such file or directory", ""),
            (PermissionError, 13, "Permission denied", " (Permission denied)"),
            (OSError, 30, "Read-only file system", " (Read-only file system)")):
        refuse(error, code, why)
        r = invoke("export", str(out), "--db", sqlite_url)
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), repr(r.exception)
        assert r.output.strip().splitlines() == [
            f"Error: cannot write {out}: directory {str(tmp_path)!r} cannot be written{said}"
        ], r.output
        assert "does not exist" not in r.output
    assert not list(tmp_path.glob("t.yaml*"))


def test_export_where_it_cannot_write_is_one_line(sqlite_url: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _one_winner(sqlite_url)
    (tmp_path / "a-file").write_text("")
    for out, why in ((tmp_path / "no-such-dir" / "t.yaml",
                      f"directory {str(tmp_path / 'no-such-dir')!r} does not exist"),
                     (tmp_path / "a-file" / "t.yaml",
                      f"{str(tmp_path / 'a-file')!r} is not a directory")):
        r = invoke("export", str(out), "--db", sqlite_url)
        assert r.exit_code == 1 and r.exception is not None and isinstance(
            r.exception, SystemExit), repr(r.exception)
        assert f"Error: cannot write {out}: " in r.output and why in r.output, r.output
    # a read-only directory (root writes into one anyway: its refusal is made here)
    real = Path.write_text

    def read_only(self: Path, *args: object, **kwargs: object) -> int:
        if self.parent == tmp_path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", read_only)
    out = tmp_path / "t.yaml"
    r = invoke("export", str(out), "--db", sqlite_url)
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), repr(r.exception)
    assert f"Error: cannot write {out}: " in r.output and "Permission denied" in r.output
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("t.yaml")]


@pytest.mark.parametrize("command", [["show"], ["show", "--point", "1"],
                                     ["export", "out.yaml"], ["export", "out.yaml", "--update"]])
def test_show_and_export_refuse_a_database_file_that_does_not_exist(
        command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A mistyped --db names the missing file; nothing is created (search creates a database).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out.yaml").write_text("schema_version: 1\nprovenance: {}\ngpus: {}\n")
    for db, path in ((f"sqlite:///{tmp_path}/tunes.db", f"{tmp_path}/tunes.db"),
                     ("sqlite:///tunes.db", "tunes.db")):
        r = invoke(*command, "--db", db)
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), repr(r.exception)
        assert f"no database at {path}" in r.output, r.output
        assert "fusetune search" in r.output, r.output
        assert not (tmp_path / "tunes.db").exists()


def test_show_and_export_filter_gpus_outside_the_catalogue(sqlite_url: str,
                                                           tmp_path: Path) -> None:
    from fusetune.db.store import PointKey

    store = Store(sqlite_url)
    cfg = {"BLOCK_D": 64, "ROWS": 1, "num_warps": 4, "num_stages": 1}
    for gpu in ("orin", "nvidia-l40s", "h100-sxm"):
        pid = store.point_id(PointKey(gpu=gpu, kernel="rmsnorm", dims={"dim": 64}, batch=1,
                                      seq=1, dtype="float16", weights="", backend="cuda",
                                      kernel_hash="abc", triton_version="3.6.0",
                                      torch_version="2.11.0"))
        store.set_winner(pid, cfg, 2.0, cfg, 2.0, 10, 10, 1)
    r = invoke("show", "--db", sqlite_url, "--gpu", "orin")
    assert r.exit_code == 0 and "gpu orin" in r.output, r.output
    out = tmp_path / "t.yaml"
    r = invoke("export", str(out), "--db", sqlite_url, "--gpu", "NVIDIA L40S")
    assert r.exit_code == 0 and "for nvidia-l40s" in r.output, r.output
    r = invoke("show", "--db", sqlite_url, "--gpu", "rtx9999")
    assert r.exit_code == 1 and "unknown GPU 'rtx9999'" in r.output, r.output


def test_show_and_export_find_points_stored_before_the_gpu_was_catalogued(
        sqlite_url: str, tmp_path: Path) -> None:
    # A search on an L40S stored its points under the device name's slug while the catalogue
    # lacked it; --gpu l40s finds them. A GPU still outside the catalogue keeps its slug.
    from fusetune.db.store import PointKey

    store = Store(sqlite_url)
    cfg = {"BLOCK_D": 64, "ROWS": 1, "num_warps": 4, "num_stages": 1}
    for gpu in ("nvidia-l40s", "nvidia-a40"):
        pid = store.point_id(PointKey(gpu=gpu, kernel="rmsnorm", dims={"dim": 64}, batch=1,
                                      seq=1, dtype="float16", weights="", backend="cuda",
                                      kernel_hash="abc", triton_version="3.6.0",
                                      torch_version="2.11.0"))
        store.set_winner(pid, cfg, 2.0, cfg, 2.0, 10, 10, 1)
    out = tmp_path / "t.yaml"
    for name, stored in (("l40s", "nvidia-l40s"), ("NVIDIA L40S", "nvidia-l40s"),
                         ("NVIDIA A40", "nvidia-a40")):
        r = invoke("export", str(out), "--db", sqlite_url, "--gpu", name)
        assert r.exit_code == 0 and f"wrote 1 entries for {stored} " in r.output, r.output
        r = invoke("show", "--db", sqlite_url, "--gpu", name)
        assert r.exit_code == 0 and f"gpu {stored}" in r.output, r.output
    assert {k[0] for k in fusetune.tables.read_tables(out).groups} == {"nvidia-a40"}
    r = invoke("export", str(out), "--db", sqlite_url, "--gpu", "l40s")
    assert {k[0] for k in fusetune.tables.read_tables(out).groups} == {"l40s"}  # as it loads


def test_export_update(db_url: str, tmp_path: Path) -> None:
    from fusetune.db.store import PointKey

    table = tmp_path / "t.yaml"
    r = invoke("export", str(table), "--update", "--db", db_url)
    assert r.exit_code != 0 and "does not exist" in r.output  # nothing to update yet
    store = Store(db_url)
    cfg = {"BLOCK_D": 64, "ROWS": 1, "num_warps": 4, "num_stages": 1}
    for batch in (1, 8):
        pid = store.point_id(PointKey(gpu="h100-sxm", kernel="rmsnorm", dims={"dim": 64},
                                      batch=batch, seq=1, dtype="float16", weights="",
                                      backend="cuda", kernel_hash="abc", triton_version="3.6.0",
                                      torch_version="2.11.0"))
        store.set_winner(pid, cfg, 2.0, cfg, 2.0, 10, 10, 1)
    table.write_text("schema_version: 1\nprovenance: {}\ngpus: {h100-sxm: {rmsnorm: [\n"
                     "  {dims: {dim: 64}, dtype: float16, batch: 1, seq: 1, config: {BLOCK_D: 128,"
                     " ROWS: 2, num_warps: 8, num_stages: 1}},\n"
                     "  {dims: {dim: 64}, dtype: bfloat16, batch: 1, seq: 1, config: {BLOCK_D: 128,"
                     " ROWS: 2, num_warps: 8, num_stages: 1}}]}}\n")
    r = invoke("export", str(table), "--update", "--db", db_url)
    assert r.exit_code == 0, r.output
    assert "1 entries replaced, 1 added, 1 kept (3 in all)" in r.output
    back = fusetune.tables.read_tables(table)
    assert back.groups[("h100-sxm", "rmsnorm", (("dim", 64),), "float16", "", "")] == [
        (1, cfg), (8, cfg)]
    assert len(back.groups[("h100-sxm", "rmsnorm", (("dim", 64),), "bfloat16", "", "")]) == 1
    table.write_text("gpus: []\n")
    r = invoke("export", str(table), "--update", "--db", db_url)
    assert r.exit_code != 0 and "missing top-level field" in r.output
    assert table.read_text() == "gpus: []\n"  # left as it was


# ---- the whole flow on the interpreter -----------------------------------------------------


@pytest.mark.slow
def test_search_show_export_lookup(db_url: str, tmp_path: Path, fresh_tables: None) -> None:
    run_search(db_url, tmp_path, "--dim", "64", "--batch", "1,3", "--seq", "1,2",
               "--dtype", "float16", "--trials", "4")
    points = {(1, 1), (3, 1), (1, 2), (3, 2)}

    rows = results_rows(db_url)
    for b, s in points:
        mine = [r for r in rows if (r[7], r[8]) == (b, s)]
        assert len(mine) >= 4, (b, s, mine)
        assert all(r[3] == "ok" for r in mine)

    shown = invoke("show", "--db", db_url)
    assert shown.exit_code == 0, shown.output
    listed = set(re.findall(r'│ rmsnorm │ \{"dim":64\}\s*│ (\d+)\s*│ (\d+)\s*│ float16',
                            shown.output))
    assert {(int(b), int(s)) for b, s in listed} == points, shown.output
    # The GPU, backend and Triton version that every point shares are named once, in the title.
    assert "(gpu interpreter, backend interpreter, triton " in shown.output, shown.output
    assert "│ interpreter │" not in shown.output, shown.output

    out = tmp_path / "tables.yaml"
    exported = invoke("export", str(out), "--db", db_url)
    assert exported.exit_code == 0, exported.output
    assert "wrote 4 entries for interpreter" in exported.output
    # Each entry's medians are the re-timing's that picked its winner; a spread, where one is
    # written, brackets its median.
    (entries,) = yaml.safe_load(out.read_text())["gpus"]["interpreter"].values()
    assert len(entries) == 4
    retimed = {(p.batch, p.seq): (w.time_us, w.default_us)
               for p, w in Store(db_url).winners(gpu="interpreter")}
    for e in entries:
        w_us, d_us = retimed[(e["batch"], e["seq"])]
        assert (e["time_us"], e["default_us"]) == (round(w_us, 3), round(d_us, 3)), e
        assert e.get("p20_us", e["time_us"]) <= e["time_us"] <= e.get("p80_us", e["time_us"])
        assert (e.get("default_p20_us", e["default_us"]) <= e["default_us"]
                <= e.get("default_p80_us", e["default_us"])), e

    fusetune.load_tables(out)
    winners = {(p.batch, p.seq): w.config for p, w in Store(db_url).winners(gpu="interpreter")}
    assert set(winners) == points
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)
        for (b, s), config in winners.items():
            got = fusetune.lookup("rmsnorm", {"dim": 64}, "float16", rows=b * s,
                                  gpu="interpreter")
            assert got == config
        assert fusetune.lookup("rmsnorm", {"dim": 64}, "float16", rows=3,
                               gpu="interpreter") == winners[(3, 1)]

    if not INTERP:
        return
    from fusetune.kernels import rmsnorm as mod

    launched: list[dict[str, int]] = []
    real = mod._launch_2d
    x = torch.randn(3, 64).half()
    w = (1 + 0.1 * torch.randn(64)).half()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)
        mod._launch_2d = lambda *a: (launched.append(dict(a[4])), real(*a))  # type: ignore
        try:
            y = fusetune.rmsnorm(x, w, eps=1e-6)
        finally:
            mod._launch_2d = real
    assert launched == [winners[(3, 1)]]
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    assert y.dtype == torch.float16
    assert float((y.float() - ref).norm() / ref.norm()) <= 2e-3


@pytest.mark.slow
def test_resume_keeps_results_and_adds_trials(db_url: str, tmp_path: Path) -> None:
    grid = ("--dim", "64", "--batch", "1,3", "--seq", "1", "--dtype", "float16")
    run_search(db_url, tmp_path, *grid, "--trials", "3")
    first = results_rows(db_url)
    per_point = {}
    for r in first:
        per_point.setdefault((r[7], r[8]), []).append(r)
    assert set(per_point) == {(1, 1), (3, 1)}
    assert all(len(v) == 3 for v in per_point.values()), first

    run_search(db_url, tmp_path, *grid, "--trials", "6")
    second = results_rows(db_url)
    assert second[: len(first)] == first  # same ids, configs, statuses, times, created_at
    assert set(second[len(first):]).isdisjoint(first)
    keys = [(r[1], r[2]) for r in second]
    assert len(keys) == len(set(keys)), "a config was stored twice for one point"
    counts = {}
    for r in second:
        counts[(r[7], r[8])] = counts.get((r[7], r[8]), 0) + 1
    assert counts[(1, 1)] >= 6 and counts[(3, 1)] >= 6, counts

    trials_before = study_trial_counts(db_url)
    winners_before = query(db_url, "SELECT * FROM ft_winners ORDER BY point_id")
    run_search(db_url, tmp_path, *grid, "--trials", "6")
    assert results_rows(db_url) == second  # nothing new stored, nothing changed
    assert study_trial_counts(db_url) == trials_before  # and nothing run again
    # nor re-timed: the winners stand as picked (time, default's time, updated_at)
    assert query(db_url, "SELECT * FROM ft_winners ORDER BY point_id") == winners_before


def _start_and_kill(cmd: list[str], db_url: str, log_path: Path, min_results: int) -> None:
    """Starts the search and kill -9s it once it has `min_results` results and a claimed
    trial RUNNING."""
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=log_path.parent, env=interp_env(), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        n = 0
        poll = ("SELECT (SELECT COUNT(*) FROM ft_results), (SELECT COUNT(*) FROM trials t "
                "JOIN ft_running r ON r.trial_number = t.number WHERE t.state = 'RUNNING')")
        engine = make_engine(db_url)
        try:
            while time.monotonic() < deadline:
                assert proc.poll() is None, "the search ended before it could be killed"
                try:
                    with engine.connect() as con:
                        n, running = con.execute(sqlalchemy.text(poll)).one()
                except (OperationalError, ProgrammingError):  # tables not created yet
                    n = running = 0
                if n >= min_results and running:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.05)
        finally:
            engine.dispose()
        assert n >= min_results, f"no {min_results} results within 120 s"
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.slow
def test_kill_9_then_resume(db_url: str, tmp_path: Path) -> None:
    import optuna
    from optuna.trial import TrialState

    from fusetune.tuner.search import open_storage

    cmd = search_cmd(db_url, "--dim", "256", "--batch", "16", "--seq", "16", "--dtype",
                     "float16", "--trials", "12")
    storage = None
    # Kill in the middle of a trial, not between two: a RUNNING trial that is claimed is
    # being evaluated (a repeat of a stored config is RUNNING only for an instant). The trial
    # may still end between the look and the kill on a loaded machine: then the killed search
    # is started again (it resumes) and killed again, a few times at most.
    for attempt in range(5):
        _start_and_kill(cmd, db_url, tmp_path / f"run{attempt}.log", min_results=3 + attempt)
        before = results_rows(db_url)
        assert len(before) >= 3
        ((study_name,),) = query(db_url, "SELECT study_name FROM ft_points")
        storage = storage or open_storage(db_url)
        study = optuna.load_study(study_name=study_name, storage=storage)
        was_running = [t.number for t in study.get_trials(states=(TrialState.RUNNING,))]
        if was_running:
            break
    assert was_running, "the killed search never left a trial RUNNING (killed between trials)"

    rerun = subprocess.run(cmd, cwd=tmp_path, env=interp_env(), capture_output=True, text=True,
                           timeout=400, check=False)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]

    after = results_rows(db_url)
    assert after[: len(before)] == before
    keys = [(r[1], r[2]) for r in after]
    assert len(keys) == len(set(keys))
    ok_or_not = {r[3] for r in after}
    assert ok_or_not <= {"ok", "infeasible"}, ok_or_not
    assert sum(1 for r in after if r[3] == "ok") >= 10

    study = optuna.load_study(study_name=study_name, storage=storage)
    trials = study.get_trials()
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    by_number = {t.number: t for t in trials}
    for number in was_running:
        t = by_number[number]
        assert t.state == TrialState.FAIL
        assert t.user_attrs.get("reason"), t.user_attrs
        assert t.user_attrs.get("status") == "interrupted"
    assert len(Store(db_url).winners()) == 1


# ---- the runtime never loads the tuner's dependencies --------------------------------------


def test_runtime_import_does_not_load_optuna_or_sqlalchemy(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import fusetune\n"
        "assert 'triton' not in sys.modules, 'import fusetune loaded triton'\n"
        "fusetune.rmsnorm; fusetune.lookup; fusetune.load_tables\n"
        "import torch, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "cfg = fusetune.lookup('rmsnorm', {'dim': 64}, 'float16', rows=2)\n"
        "assert cfg['BLOCK_D'] == 64, cfg\n"
        "if not torch.cuda.is_available():\n"
        "    y = fusetune.rmsnorm(torch.randn(2, 64), torch.ones(64), eps=1e-6)\n"
        "    assert y.shape == (2, 64)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('optuna', 'sqlalchemy'))\n"
        "assert 'optuna' not in sys.modules and 'sqlalchemy' not in sys.modules, bad\n"
        "print('clean')\n"
    )
    env = interp_env() if not torch.cuda.is_available() else dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "clean"


@pytest.mark.slow
@pytest.mark.parametrize(("kernel", "dims"), [
    # The RoPE layout is a dim of the point (interleaved=0), tuned and looked up apart from
    # the interleaved one.
    ("rope", {"heads": 3, "head_dim": 16, "interleaved": 0}),
    ("ffn", {"dim": 64, "hidden": 48}),
    ("lola", {"dim": 64, "out": 40}),
    ("qkv", {"dim": 32, "head_dim": 8, "interleaved": 1, "n_heads": 4, "n_kv_heads": 2}),
    ("rmsnorm_bwd", {"dim": 96}),
])
def test_kernel_search_export_lookup(kernel: str, dims: dict[str, int], sqlite_url: str,
                                     tmp_path: Path, fresh_tables: None) -> None:
    db_url = sqlite_url  # about the kernels: the storage backends are tested elsewhere
    dims_arg = ",".join(f"{k}={v}" for k, v in dims.items())
    proc = subprocess.run(
        [sys.executable, "-m", "fusetune.cli", "search", "--kernel", kernel, "--backend",
         "interpreter", "--db", db_url, "--dims", dims_arg, "--batch", "2", "--seq", "3",
         "--dtype", "float16", "--trials", "4"],
        cwd=tmp_path, env=interp_env(), capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "tables.yaml"
    exported = invoke("export", str(out), "--db", db_url, "--kernel", kernel)
    assert exported.exit_code == 0, exported.output
    fusetune.load_tables(out)
    ((p, w),) = Store(db_url).winners(kernel=kernel)
    assert (p.batch, p.seq) == (2, 3)
    assert sum(1 for r in Store(db_url).results(p.id).values() if r.status == "ok") >= 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)
        assert fusetune.lookup(kernel, dims, "float16", rows=6, gpu="interpreter") == w.config
    # Dims far from the tuned ones (flags such as interleaved kept): nothing near enough to
    # lend its config, the default heuristic with a warning.
    other = {k: v * 64 if v > 1 else v for k, v in dims.items()}
    with pytest.warns(fusetune.FusetuneWarning, match="no tuned config"):
        fusetune.lookup(kernel, other, "float16", rows=6, gpu="interpreter")


@pytest.mark.parametrize("kernel", ["rmsnorm", "rmsnorm_bwd", "rope", "rope_bwd", "swiglu",
                                    "swiglu_bwd", "qkv", "ffn", "lola"])
def test_every_kernel_plans_with_defaults(kernel: str) -> None:
    # The default grid (llama-2-7b dims) for the named GPU, and the interpreter's small grid
    # (the "tiny" preset) that a machine without a GPU falls back to.
    started = time.perf_counter()
    planned = invoke("search", "--kernel", kernel, "--gpu", "h100", "--dry-run")
    assert planned.exit_code == 0, planned.output
    assert "configs pruned in all under h100-sxm's limits" in planned.output
    # Spaces of millions are sampled, not priced config by config (that took minutes).
    assert time.perf_counter() - started < 30
    from fusetune.kernels import get_spec
    from fusetune.models import preset

    dims = get_spec(kernel).dims_from_model(preset("tiny"))
    assert dims and all(v >= 0 for v in dims.values())


def test_show_point_lists_top_configs_and_failure_reasons(db_url: str) -> None:
    from fusetune.db.store import PointKey

    store = Store(db_url)
    pid = store.point_id(PointKey("h100-sxm", "rmsnorm", {"dim": 64}, 1, 1, "float16", "",
                                  "cuda", "k", "3.6.0", "2.11"))
    base = {"ROWS": 1, "num_warps": 4, "num_stages": 1}
    for i, us in enumerate((9.0, 7.0, 8.0)):
        store.record(pid, f"ok{i}", {"BLOCK_D": 64 << i, **base}, "ok", time_us=us,
                     p20_us=us - 0.5, p80_us=us + 0.5, rel_err=1e-4, compile_s=0.3)
    store.record(pid, "f1", {"BLOCK_D": 16, **base}, "oor", "out of resource: shared memory, "
                 "Required: 300000, Hardware limit: 232448")
    store.record(pid, "f2", {"BLOCK_D": 32, **base}, "oor", "out of resource: shared memory, "
                 "Required: 400000, Hardware limit: 232448")
    store.record(pid, "f3", {"BLOCK_D": 8, **base}, "wrong_result", "y: relative error 2e-01")
    out = invoke("show", "--db", db_url, "--point", str(pid), "--top", "2")
    assert out.exit_code == 0, out.output
    assert "oor:2" in out.output and "ok:3" in out.output
    rows = re.findall(r"BLOCK_D=(\d+) ROWS=1 num_warps=4 num_stages=1 │ [\d.]+\s*│ ([\d.]+)",
                      out.output)
    assert rows == [("128", "7.00"), ("256", "8.00")]  # the two fastest, fastest first
    grouped = r"oor\s*│ out of resource: shared memory, Required: N, Hardware limit: N\s*│ 2"
    assert re.search(grouped, out.output), out.output
    assert "wrong_result" in out.output
    missing = invoke("show", "--db", db_url, "--point", "99")
    assert missing.exit_code != 0 and f"points: {pid}" in missing.output


@pytest.mark.parametrize("command", [["show"], ["export", "out.yaml"]])
def test_unreachable_database_is_one_line_without_the_password(command: list[str],
                                                               tmp_path: Path) -> None:
    url = "postgresql://tuner:s3cret-pw@127.0.0.1:1/fusetune"  # port 1: nothing listens
    if command[0] == "export":
        command = ["export", str(tmp_path / "out.yaml")]
    res = invoke(*command, "--db", url)
    assert res.exit_code != 0
    assert "cannot open database" in res.output or "psycopg" in res.output, res.output
    assert "s3cret-pw" not in res.output
    assert "Traceback" not in res.output


def test_config_text_leaves_out_flags_at_their_default() -> None:
    # THREAD_SUM=0 and UNROLL_K=0 mean what leaving them out means (KernelSpec.flags): left out;
    # TMA=1 is not; a kernel without flags, or one this version does not know, shows all.
    config = {"BLOCK_M": 1, "BLOCK_N": 2, "THREAD_SUM": 0, "UNROLL_K": 0, "TMA": 1, "num_warps": 8}
    assert cli._config_str(config, "ffn") == "BLOCK_M=1 BLOCK_N=2 TMA=1 num_warps=8"
    assert cli._config_str(config) == ("BLOCK_M=1 BLOCK_N=2 THREAD_SUM=0 UNROLL_K=0 TMA=1 "
                                       "num_warps=8")
    assert cli._config_str(config, "retired_kernel") == cli._config_str(config)
    rms = {"BLOCK_D": 4096, "ROWS": 1, "num_warps": 8, "num_stages": 1}
    assert cli._config_str(rms, "rmsnorm") == "BLOCK_D=4096 ROWS=1 num_warps=8 num_stages=1"
    assert cli._config_str(None, "ffn") == "-"


def test_python_m_fusetune_is_the_command(tmp_path: Path) -> None:
    # Where the console script is not installed (the package on PYTHONPATH only), `python -m
    # fusetune` runs the same command; imported again (as the search's spawned processes import
    # the main module), it runs nothing.
    proc = subprocess.run([sys.executable, "-m", "fusetune", "gpus"], env=interp_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "h100-sxm" in proc.stdout, proc.stdout
    proc = subprocess.run([sys.executable, "-c", "import runpy; runpy.run_module("
                           "'fusetune.__main__', run_name='__mp_main__')"], env=interp_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert (proc.returncode, proc.stdout) == (0, ""), proc.stderr
