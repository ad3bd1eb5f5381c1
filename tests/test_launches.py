"""What a config's compiled kernels use (registers, spills, shared memory): captured from Triton's
launches, carried by the outcome through the worker process, stored, shown.

Without a GPU the kernels Triton would compile are the fakes of fake_jit (MODE 7): real
JITFunction objects whose launches go through JITFunction.run and return a stand-in for the
CompiledKernel. The `gpu` tests check real kernels' figures."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from fake_jit import FAKE_FINISH, FAKE_MAIN, MODE7_STATS, SPEC
from fake_kernels import LOG_ENV, point
from old_schema import create_first_results_table
from rich.console import Console
from sqlalchemy import (
    text,
)
from triton.runtime.jit import JITFunction

from fusetune import cli, gpus
from fusetune.db.store import PointKey, Store, make_engine
from fusetune.tuner.bench import Evaluator
from fusetune.tuner.launches import KernelStats, compile_only, kernel_stats, launched_kernels
from fusetune.tuner.search import open_storage
from fusetune.tuner.space import Param, SearchSpace, config_key
from fusetune.tuner.study import Context, PointTuner, SearchOptions
from fusetune.tuner.worker import Worker

MODE7 = {"MODE": 7, "num_warps": 4}
PLAIN = {"MODE": 1, "num_warps": 4}


def compiled(regs: int | None, spills: int | None, shared: int | None) -> SimpleNamespace:
    return SimpleNamespace(n_regs=regs, n_spills=spills, metadata=SimpleNamespace(shared=shared))


def test_kernel_stats_takes_the_most_registers_and_shared_memory_and_all_spills() -> None:
    main, finish = compiled(96, 0, 49152), compiled(40, 8, 1024)
    # the main kernel launched twice (counted once), a finishing kernel that spills
    assert kernel_stats([main, finish, main]) == KernelStats(96, 8, 49152)
    assert kernel_stats([finish]) == KernelStats(40, 8, 1024)
    assert kernel_stats([]) == KernelStats(None, None, None)
    # loaded lazily: a kernel compiled but never loaded has no register figures yet
    never_loaded = SimpleNamespace(metadata=SimpleNamespace(shared=2048))
    assert kernel_stats([never_loaded]) == KernelStats(None, None, 2048)


def test_launches_are_collected_inside_the_block_only() -> None:
    x = torch.zeros(4)
    original = JITFunction.__dict__["run"]
    with launched_kernels() as found:
        FAKE_MAIN[(1,)](x)
        FAKE_FINISH[(1,)](x)
        assert JITFunction.__dict__["run"] is not original  # observed while in the block
    FAKE_MAIN[(1,)](x)  # after the block: not collected
    assert [k.name for k in found] == ["main", "finish"]
    assert JITFunction.__dict__["run"] is original  # Triton's entry point is as it was


def test_other_threads_launches_are_not_collected() -> None:
    x = torch.zeros(4)
    inside, go, done = threading.Event(), threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        FAKE_FINISH[(1,)](x)  # while the main thread is inside its block
        done.set()
        go.wait()

    t = threading.Thread(target=other)
    t.start()
    with launched_kernels() as found:
        inside.set()
        assert done.wait(10)
        FAKE_MAIN[(1,)](x)
    go.set()
    t.join()
    assert [k.name for k in found] == ["main"]


def test_compile_only_forces_warmup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "log"
    monkeypatch.setenv(LOG_ENV, str(log))
    x = torch.zeros(4)
    with compile_only():
        FAKE_MAIN[(1,)](x)
    FAKE_MAIN[(1,)](x)
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["warmup", "launch"]


def test_the_outcome_carries_the_kernels_figures_in_process_and_through_the_worker() -> None:
    ev = Evaluator(SPEC, point(), "interpreter", "cpu")
    out = ev.evaluate(MODE7)
    assert out.status == "ok", out
    assert (out.n_regs, out.n_spills, out.smem_bytes) == MODE7_STATS
    plain = ev.evaluate(PLAIN)  # launches no Triton kernel: unknown, not zero
    assert (plain.n_regs, plain.n_spills, plain.smem_bytes) == (None, None, None)
    w = Worker("fake_jit:SPEC", "interpreter", "cpu", timeout_s=60)
    try:
        w.set_point(point(), 0)
        out = w.evaluate(MODE7)
    finally:
        w.close()
    assert out.status == "ok", out
    assert (out.n_regs, out.n_spills, out.smem_bytes) == MODE7_STATS


def test_a_search_stores_the_figures_and_show_prints_them(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path}/ft.db"
    space = SearchSpace("fake", (Param("MODE", "values", (1, 7)),
                                 Param("num_warps", "pow2", (4,))), "test")
    w = Worker("fake_jit:SPEC", "interpreter", "cpu", timeout_s=60)
    try:
        ctx = Context(SPEC, space, gpus.INTERPRETER, "interpreter", "cpu", Store(url),
                      open_storage(url), "t", "v", w)
        tuner = PointTuner(ctx, point(), SearchOptions(trials=2, rounds=1))
        tuner.run()
    finally:
        w.close()
    rows = ctx.store.results(tuner.point_id)
    got = {r.config["MODE"]: (r.n_regs, r.n_spills, r.smem_bytes) for r in rows.values()}
    assert got == {7: MODE7_STATS, 1: (None, None, None)}

    monkeypatch.setattr(cli, "console", Console(highlight=False, width=250))
    res = CliRunner().invoke(cli.main, ["show", "--db", url, "--point", str(tuner.point_id)])
    assert res.exit_code == 0, res.output
    header = next(line for line in res.output.splitlines() if "p20 µs" in line)
    assert re.search(r"compile s\s*┃\s*regs\s*┃\s*spills\s*┃\s*smem KB\s*┃\s*trial", header)
    # MODE 7: 96 registers, 8 spills, 49152 B = 48.0 KB; MODE 1: unknown
    assert re.search(r"MODE=7 num_warps=4 │.*│ 96\s*│ 8\s*│ 48\.0\s*│", res.output), res.output
    assert re.search(r"MODE=1 num_warps=4 │.*│ -\s*│ -\s*│ -\s*│", res.output), res.output


def test_results_tables_of_an_earlier_version_get_the_new_columns(db_url: str) -> None:
    # ft_results as it was made before the kernels' figures (and the device) were stored
    create_first_results_table(db_url)

    store = Store(db_url)
    pid = store.point_id(PointKey("h100-sxm", "fake", {"dim": 16}, 1, 1, "float16", "", "cuda",
                                  "k", "3.6.0", "2.11"))
    store.record(pid, config_key(MODE7), MODE7, "ok", time_us=1.0, n_regs=96, n_spills=8,
                 smem_bytes=49152)
    store.record(pid, config_key(PLAIN), PLAIN, "ok", time_us=2.0)
    again = Store(db_url)  # upgrading twice: nothing to add
    got = {r.config["MODE"]: (r.n_regs, r.n_spills, r.smem_bytes)
           for r in again.results(pid).values()}
    assert got == {7: (96, 8, 49152), 1: (None, None, None)}
    engine = make_engine(db_url)
    with engine.connect() as con:  # the columns are integers in the database itself
        assert con.execute(text("SELECT n_regs + n_spills FROM ft_results WHERE n_regs IS NOT "
                                "NULL")).scalar() == 104
    engine.dispose()


# ---- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 4])
def test_real_kernels_report_registers_and_shared_memory(split_k: int) -> None:
    from fusetune.kernels import get_spec
    from fusetune.spec import Point
    from fusetune.tables import gpu_for_device

    spec = get_spec("ffn")
    p = Point.make("ffn", {"dim": 1024, "hidden": 2048}, 1, 16, "float16")
    default = spec.default_config(p, gpu_for_device(torch.device("cuda")))
    config = spec.canonical({**default, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
                             "num_stages": 3, "PASSES": 1, "SPLIT_K": split_k}, p)
    assert config["SPLIT_K"] == split_k  # split-K: a main kernel and a finishing one
    out = Evaluator(spec, p, "cuda", "cuda").check(config)
    assert out.status == "ok", out
    assert out.n_regs is not None and 0 < out.n_regs <= 255, out
    assert out.n_spills is not None and out.n_spills >= 0, out
    assert out.smem_bytes is not None and out.smem_bytes > 0, out  # pipelined dot operands
