"""benchmarks/bench_tables.py on Triton's interpreter: which entries it takes, its verdicts and
exit status, and the same results from several timing processes (timings meaningless)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import fusetune
from benchmarks import bench_tables
from fusetune import gpus, runtime
from fusetune.kernels import REGISTRY, get_spec
from fusetune.spec import Point

RMSNORM = {"BLOCK_D": 64, "ROWS": 2, "num_warps": 4, "num_stages": 1}
LINEAR = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 1, "PASSES": 2, "SPLIT_K": 1,
          "num_warps": 4, "num_stages": 3}
LINEAR_DIMS = {"bias": 0, "dim": 64, "out": 32, "residual": 1}


def write_table(path: Path, marginal: bool = False) -> Path:
    extra: dict[str, Any] = {"marginal": True} if marginal else {}
    path.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {
        "interpreter": {
            "rmsnorm": [{"dims": {"dim": 64}, "dtype": "float32", "batch": 4, "seq": 1,
                         "config": RMSNORM, **extra}],
            "linear": [{"dims": LINEAR_DIMS, "dtype": "float32", "batch": 1, "seq": 1,
                        "config": LINEAR},
                       {"dims": LINEAR_DIMS, "dtype": "float32", "batch": 8, "seq": 1,
                        "config": LINEAR, "weights": "fp8-e4m3"}]}}}))
    return path


@pytest.fixture
def interp(monkeypatch: pytest.MonkeyPatch, fresh_tables: None) -> None:
    """The interpreter, and no shipped entries (they are for GPUs, none for it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(runtime, "_shipped", runtime.Tables())


def todo(table: Path, **narrow: Any) -> list[bench_tables.Entry]:
    fusetune.load_tables(table)
    gpu = gpus.resolve("interpreter")
    out = bench_tables.entries(gpu.name, list(REGISTRY), narrow.get("model"),
                               narrow.get("weights"), narrow.get("rows"))
    for e in out:
        spec, p = get_spec(e.kernel), e.point()
        e.default = dict(spec.canonical(spec.default_config(p, gpu), p))
    return out


def test_entries_are_the_lookups_narrowed(interp: None, tmp_path: Path) -> None:
    table = write_table(tmp_path / "t.yaml")
    assert sorted((e.kernel, e.rows, e.weights) for e in todo(table)) == [
        ("linear", 1, ""), ("linear", 8, "fp8-e4m3"), ("rmsnorm", 4, "")]
    assert [(e.kernel, e.rows) for e in todo(table, rows={8})] == [("linear", 8)]
    assert [(e.kernel, e.rows) for e in todo(table, weights="")] == [("rmsnorm", 4),
                                                                      ("linear", 1)]


def test_verdicts_and_exit_status() -> None:
    def entry(entry_us: float, default_us: float, marginal: bool = False
              ) -> bench_tables.Entry:
        e = bench_tables.Entry("rmsnorm", (("dim", 64),), "float32", 4, "", "", {}, marginal,
                               measured=True)
        e.times = {"entry": [(entry_us - 1, entry_us, entry_us + 1)] * 3,
                   "default": [(default_us - 1, default_us, default_us + 1)] * 3}
        return e

    # Beyond the larger p20-p80 spread (2 µs) either way, else even; unmeasured, failed.
    assert bench_tables.verdict(entry(10, 13)) == "faster"
    assert bench_tables.verdict(entry(13, 10)) == "slower"
    assert bench_tables.verdict(entry(11, 10)) == "even"
    failed = entry(10, 10)
    failed.failed = {"entry": "wrong_result: dx"}
    assert bench_tables.verdict(failed) == "failed"
    assert bench_tables.verdict(bench_tables.Entry("rmsnorm", (), "float32", 4, "", "", {},
                                                   False)) == "not measured"
    gpu = gpus.resolve("interpreter")
    # A slower entry the lookup serves fails the run; a slower marginal one (never run) not.
    assert bench_tables.report([entry(10, 13), entry(13, 10)], gpu, ["cpu"], None, None) == 1
    assert bench_tables.report([entry(10, 13), entry(13, 10, marginal=True)], gpu, ["cpu"],
                               None, None) == 0
    assert bench_tables.report([failed], gpu, ["cpu"], None, None) == 1


def test_a_marginal_entry_whose_winner_ran_faster_is_pointed_out(
        capsys: pytest.CaptureFixture[str]) -> None:
    # The search judged the winner a tie with the default (marginal: the default runs); a run
    # that times it faster beyond the spread says so, and that a new search would serve it.
    e = bench_tables.Entry("rmsnorm", (("dim", 64),), "float32", 4, "", "", {}, True,
                           measured=True)
    e.times = {"entry": [(9.0, 10.0, 11.0)] * 3, "default": [(12.0, 13.0, 14.0)] * 3}
    tie = bench_tables.Entry("rmsnorm", (("dim", 128),), "float32", 4, "", "", {}, True,
                             measured=True)
    tie.times = {"entry": [(9.0, 10.0, 11.0)] * 3, "default": [(9.5, 10.5, 11.5)] * 3}
    gpu = gpus.resolve("interpreter")
    assert bench_tables.report([e, tie], gpu, ["cpu"], None, None) == 0
    out = capsys.readouterr().out
    assert "faster (marginal: the lookup runs the default; search it again)" in out
    assert "1 marginal entries' winners ran faster than the default here" in out
    bench_tables.report([tie], gpu, ["cpu"], None, None)
    assert "marginal entries' winners ran faster" not in capsys.readouterr().out


def test_search_again_writes_the_entries_a_new_search_could_serve_faster(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fusetune.tuner.point_file import load_points

    def entry(dims: dict[str, int], entry_us: float, default_us: float, marginal: bool = False,
              kernel: str = "linear", **times: list[tuple[float, float, float]]
              ) -> bench_tables.Entry:
        e = bench_tables.Entry(kernel, tuple(sorted(dims.items())), "float32", 4, "", "", {},
                               marginal, measured=True)
        e.times = {"entry": [(entry_us - 0.2, entry_us, entry_us + 0.2)] * 3,
                   "default": [(default_us - 0.2, default_us, default_us + 0.2)] * 3, **times}
        return e

    dims = [{**LINEAR_DIMS, "out": n} for n in (32, 48, 64, 80, 96)]
    served = entry(dims[0], 10.0, 13.0)  # the fastest thing timed: nothing to gain
    tie = entry(dims[1], 10.0, 13.0, marginal=True)  # the default runs, the winner is faster
    beaten = entry(dims[2], 10.0, 13.0, unfused=[(9.5, 9.6, 9.7)] * 3)  # unfused 4% faster
    failed = entry(dims[3], 10.0, 13.0)
    failed.failed = {"entry": "wrong_result: relative error 3e-01\n> 1e-02"}
    compiled = entry(dims[4], 10.0, 13.0)
    compiled.compile_us = [8.0]  # torch.compile is faster, but no config a search times is
    unmeasured = bench_tables.Entry("rmsnorm", (("dim", 64),), "float32", 4, "", "", {}, False)
    todo = [served, tie, beaten, failed, compiled, unmeasured]
    assert [bench_tables.search_again(e) is not None for e in todo] == [
        False, True, True, True, False, False]
    path = tmp_path / "again.yaml"
    gpu = gpus.resolve("interpreter")
    bench_tables.report(todo, gpu, ["cpu"], None, None, str(path))
    assert "3 entries a new search could serve faster" in capsys.readouterr().out
    text = path.read_text()
    assert "# served 1.042× the fastest config timed" in text
    assert "# failed: wrong_result: relative error 3e-01 > 1e-02" in text
    # what fusetune search --points reads: the three points, as the entries' keys
    groups = load_points(path, "interpreter")
    assert {spec.name for spec, _ in groups} == {"linear"}
    points = [p for _, ps in groups for p in ps]
    assert sorted(dict(p.dims)["out"] for p in points) == [48, 64, 80]
    assert {(p.batch, p.seq, p.dtype, p.weights) for p in points} == {(4, 1, "float32", "")}
    # none to search again: an empty list, which a search refuses with a message
    bench_tables.write_points(str(path), [served])
    assert yaml.safe_load(path.read_text()) == {"points": []}


def test_the_run_on_the_interpreter(interp: None, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    table = write_table(tmp_path / "t.yaml", marginal=True)
    out_json = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["bench_tables", "--device", "cpu", "--tables", str(table),
                                      "--rounds", "1", "--json", str(out_json)])
    status = bench_tables.main()
    assert status in (0, 1)  # the interpreter's timings decide faster or slower
    printed = capsys.readouterr().out
    assert "| all | | 3 |" in printed
    results = json.loads(out_json.read_text())
    assert sorted(r["kernel"] for r in results) == ["linear", "linear", "rmsnorm"]
    assert all(r["verdict"] in ("faster", "even", "slower") for r in results)
    assert [r["marginal"] for r in results if r["kernel"] == "rmsnorm"] == [True]
    assert all(len(r["times"]["entry"]) == len(r["times"]["default"]) == 1 for r in results)


def test_several_timing_processes_measure_every_entry(interp: None, tmp_path: Path) -> None:
    # The entries dealt out over two processes ("cpu" devices here) come back measured, each
    # entry in its own place.
    entries = todo(write_table(tmp_path / "t.yaml"))
    assert bench_tables.measure_devices(entries, "interpreter", ["cpu", "cpu"], 1, 100)
    assert all(e.measured and not e.failed and len(e.times["entry"]) == 1 for e in entries)


def test_bad_arguments(interp: None, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    table = str(write_table(tmp_path / "t.yaml"))
    for args, expected in ((["--kernel", "gemm"], "unknown kernel 'gemm'"),
                           (["--devices", "0"], "--devices selects CUDA devices"),
                           (["--rows", "3"], "no table entries for interpreter")):
        monkeypatch.setattr(sys, "argv", ["bench_tables", "--device", "cpu", "--tables", table,
                                          *args])
        assert bench_tables.main() == 2
        assert expected in capsys.readouterr().err


def test_a_timing_process_that_dies_fails_its_entry_and_the_rest_go_on(interp: None,
                                                                        tmp_path: Path) -> None:
    # An entry whose inputs cannot be made (a negative width) ends its timing process with an
    # exception: that entry is failed as crashed, a new process measures the ones after it.
    entries = todo(write_table(tmp_path / "t.yaml"))
    broken = bench_tables.Entry("rmsnorm", (("dim", -5),), "float32", 4, "", "", RMSNORM,
                                False, default=RMSNORM)
    entries.insert(1, broken)
    assert bench_tables.measure_devices(entries, "interpreter", ["cpu"], 1, 100)
    assert bench_tables.verdict(broken) == "failed"
    assert broken.failed["entry"].startswith("crashed: the timing process on cpu died")
    others = [e for e in entries if e is not broken]
    assert all(e.measured and not e.failed and len(e.times["entry"]) == 1 for e in others)


def test_a_compile_process_without_room_for_the_inputs_leaves_them_to_the_timing_process(
        interp: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # beside the other compile processes a point's inputs may not fit the device: its configs
    # come back as not compiled (the timing process compiles and checks them), no crash
    from fusetune.tuner import compile_ahead

    def no_room(*_: Any) -> Any:
        raise RuntimeError("CUDA out of memory. Tried to allocate 896.00 MiB")

    point = Point.make("rmsnorm", {"dim": 64}, 1, 4, "float32")
    assert bench_tables._compile("rmsnorm", point, [RMSNORM], "cpu") == []
    monkeypatch.setattr(compile_ahead, "warmup_compiler", no_room)
    errors = bench_tables._compile("rmsnorm", point, [RMSNORM], "cpu")
    assert errors == ["inputs: RuntimeError: CUDA out of memory. Tried to allocate 896.00 MiB"]


def test_sigterm_reports_what_was_measured(tmp_path: Path) -> None:
    # `timeout`'s default signal, sent to the process and then its group (the timing process
    # too), once the first entry is measured: the run reports it and counts the rest as not
    # measured, as after Ctrl-C, instead of dying with nothing written.
    import os
    import signal
    import subprocess
    import time

    from cli_helpers import interp_env

    rows = [1, 2, 3, 4, 5, 6, 7, 8]
    table = tmp_path / "t.yaml"
    table.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {
        "interpreter": {"linear": [{"dims": LINEAR_DIMS, "dtype": "float32", "batch": r,
                                    "seq": 1, "config": LINEAR} for r in rows]}}}))
    out_json = tmp_path / "out.json"
    log = tmp_path / "log"
    root = Path(bench_tables.__file__).resolve().parent.parent
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_tables", "--device", "cpu", "--tables",
             str(table), "--rounds", "20", "--json", str(out_json)],
            cwd=root, env=interp_env(), stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "[cpu 1/8]" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "no entry measured within 120 s"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 130, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    verdicts = [r["verdict"] for r in json.loads(out_json.read_text())]
    assert len(verdicts) == len(rows)
    assert verdicts.count("not measured") < len(rows)  # the first, at least, measured
    assert "not measured" in verdicts, verdicts  # stopped before the end
    assert "entries not measured" in log.read_text()


EAGER_POINTS = [  # every option of each kernel's point the model code computes
    ("ffn", {"dim": 64, "hidden": 96}, ""), ("ffn", {"dim": 64, "hidden": 96, "act": 1}, ""),
    ("ffn", {"dim": 64, "hidden": 96}, "fp8-e4m3"),
    ("qkv", {"dim": 64, "head_dim": 16, "interleaved": 0, "n_heads": 4, "n_kv_heads": 2}, ""),
    ("qkv", {"dim": 64, "head_dim": 16, "interleaved": 1, "n_heads": 4, "n_kv_heads": 2}, ""),
    ("qkv", {"dim": 64, "head_dim": 16, "interleaved": 0, "n_heads": 4, "n_kv_heads": 2,
             "qk_norm": 1}, "fp8-e4m3"),
    ("linear", {"bias": 1, "dim": 64, "out": 32, "residual": 1}, ""),
    ("linear", {"bias": 0, "dim": 64, "out": 32, "residual": 0}, "fp8-e4m3"),
    ("lola", {"dim": 64, "out": 32}, ""),
    ("rmsnorm", {"dim": 64}, ""), ("rmsnorm", {"dim": 64, "residual": 1}, ""),
    ("rope", {"head_dim": 16, "heads": 2, "interleaved": 0}, ""),
    ("rope", {"head_dim": 16, "heads": 2, "interleaved": 1}, ""),
    ("swiglu", {"hidden": 48}, ""),
]


@pytest.mark.parametrize(("kernel", "dims", "weights"), EAGER_POINTS)
def test_compile_column_computes_what_the_kernel_does(kernel: str, dims: dict[str, int],
                                                      weights: str) -> None:
    # The torch.compile column times the model's own code: with a point's residual, GeGLU gate
    # or q/k norms left out it would time less work than the kernel does.
    point = Point.make(kernel, dims, 2, 3, "float32", weights)
    spec = get_spec(kernel)
    assert set(dims) <= set(spec.dim_names) | set(spec.optional_dims)
    inputs = spec.make_inputs(point, "cpu")
    eager = bench_tables._eager(kernel)
    assert eager is not None
    assert bench_tables.eager_error(kernel, inputs, eager(inputs)) < 1e-5


def test_compile_column_checked_against_the_reference() -> None:
    point = Point.make("rmsnorm", {"dim": 64, "residual": 1}, 2, 3, "float32")
    inputs = get_spec("rmsnorm").make_inputs(point, "cpu")
    wrong = {"y": bench_tables._eager("rmsnorm")({**inputs, "residual": None})["y"]}
    assert bench_tables.eager_error("rmsnorm", inputs, wrong) > 0.1


def test_a_config_under_two_names_is_timed_once(interp: None, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # An entry whose config is the unfused form: the "unfused" column is the entry's own
    # timings (the better of two timings of one config would be no measure of it).
    from fusetune.tuner.bench import Evaluator

    (e,) = [e for e in todo(write_table(tmp_path / "t.yaml"), weights="") if e.kernel == "linear"]
    spec, point = get_spec("linear"), e.point()
    e.config = dict(spec.canonical({**e.default, "UNFUSED": 1}, point))
    timed: list[dict[str, int]] = []
    real = Evaluator.timing

    def counted(self: Evaluator, config: dict[str, int], rep_ms: int = 100) -> Any:
        timed.append(config)
        return real(self, config, rep_ms)

    monkeypatch.setattr(Evaluator, "timing", counted)
    bench_tables._measure_one(e, "interpreter", "cpu", 2, 1)
    assert not e.failed and len(timed) == 4  # two configs, two rounds
    assert e.times["unfused"] is e.times["entry"] and len(e.times["entry"]) == 2
    assert len(e.times["default"]) == 2 and e.times["default"] is not e.times["entry"]
    # the second round starts with the config timed second in the first
    assert timed == [e.config, e.default, e.default, e.config]


def test_resume_measures_only_what_the_earlier_run_did_not(
        interp: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    table = write_table(tmp_path / "t.yaml")
    out = tmp_path / "out.json"
    argv = ["bench_tables", "--device", "cpu", "--tables", str(table), "--rounds", "1",
            "--json", str(out), "--resume", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert bench_tables.main() in (0, 1)  # no file yet: every entry measured
    first = json.loads(out.read_text())
    assert len(first) == 3 and all(r["gpu"] == "interpreter" for r in first)
    # as a run stopped after its first entry leaves it
    first[1]["verdict"], first[2]["verdict"] = "not measured", "not measured"
    out.write_text(json.dumps(first))
    measured: list[str] = []
    real = bench_tables.measure_devices

    def counted(todo: list[bench_tables.Entry], *args: Any) -> bool:
        measured.extend(e.label for e in todo)
        return real(todo, *args)

    monkeypatch.setattr(bench_tables, "measure_devices", counted)
    capsys.readouterr()
    assert bench_tables.main() in (0, 1)
    labels = [e.label for e in todo(table)]
    assert measured == labels[1:]  # the first entry kept, not measured again
    assert "| all | | 3 |" in capsys.readouterr().out
    again = json.loads(out.read_text())
    assert again[0]["times"] == first[0]["times"]
    assert all(r["verdict"] != "not measured" for r in again)


def test_resume_refuses_another_gpus_run(interp: None, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    table = write_table(tmp_path / "t.yaml")
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"gpu": "h100-sxm", "verdict": "faster"}]))
    monkeypatch.setattr(sys, "argv", ["bench_tables", "--device", "cpu", "--tables", str(table),
                                      "--resume", str(other)])
    assert bench_tables.main() == 2
    assert "measured on h100-sxm, not interpreter" in capsys.readouterr().err
    other.write_text(json.dumps([{"gpu": "interpreter", "kernel": "rmsnorm"}]))
    assert bench_tables.main() == 2
    assert "entry 0 is not a bench_tables entry (no dims, dtype," in capsys.readouterr().err


def test_torch_compile_takes_its_turn_in_the_rounds(interp: None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # The compile column is timed in the rounds beside the configs, its place rotating too.
    import triton.testing

    from fusetune.tuner.bench import Evaluator

    (e,) = [e for e in todo(write_table(tmp_path / "t.yaml"), weights="") if e.kernel == "linear"]
    order: list[str] = []
    real = Evaluator.timing

    def timing(self: Evaluator, config: dict[str, int], rep_ms: int = 100) -> Any:
        order.append("unfused" if config.get("UNFUSED") else
                     "default" if config == e.default else "entry")
        return real(self, config, rep_ms)

    def do_bench(fn: Any, **kw: Any) -> float:
        order.append("compile")
        fn()
        return 0.01

    monkeypatch.setattr(Evaluator, "timing", timing)
    monkeypatch.setattr(bench_tables, "_compile_column",
                        lambda kernel, device: bench_tables._eager(kernel))
    monkeypatch.setattr(bench_tables, "_compiled_afresh", lambda eager: eager)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    bench_tables._measure_one(e, "interpreter", "cpu", 3, 1)
    assert not e.failed and e.compile_us == [10.0] * 3
    # linear has its unfused form too: entry, default, unfused and the compiled code rotate
    assert order[:4] == ["entry", "default", "unfused", "compile"]
    assert order[4:8] == order[1:4] + order[:1] and order[8:] == order[2:4] + order[:2]
