"""Kernels of one's own (fusetune.autotune): a kernel of a package outside fusetune
(tests/ext_kernels, registered by its own entry point) searched, exported and launched in fresh
processes; tuning at run time persisted once and reused; entries of an edited source not
served; every failing config recorded with its reason; the decorator's checks."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
import yaml

import fusetune
from fusetune import registry, runtime
from fusetune.autotuned import NotTunedError, signature
from fusetune.kernels import REGISTRY, get_spec
from fusetune.tuner.space import SpaceError, parse_space_data

EXT = Path(__file__).parent / "ext_kernels"
ROOT = Path(__file__).parent.parent


@pytest.fixture
def ext(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The package outside fusetune, importable (and its entry point visible) in this test."""
    monkeypatch.syspath_prepend(str(EXT))
    return importlib.import_module("fusetune_ext_demo")


def _env(tmp: Path, ext: Path = EXT, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ext), str(ROOT)]),
               FUSETUNE_CACHE=str(tmp / "cache" / "tuned.yaml"), **extra)
    env.pop("FUSETUNE_TABLES", None)
    return env


def _fusetune(tmp: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "fusetune.cli", *args], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


# A process that launches a kernel of the ext package on N=100 and prints, as JSON, the config
# it used, the configs it timed at run time (the kernel's count and triton.testing.do_bench's
# calls), and its warnings.
LAUNCH = textwrap.dedent("""
    import json, sys, warnings
    import torch, triton.testing
    calls = []
    real = triton.testing.do_bench
    triton.testing.do_bench = lambda *a, **k: calls.append(1) or real(*a, **k)
    import fusetune_ext_demo as ext
    kernel = getattr(ext, sys.argv[1])
    x, y = torch.randn(100, dtype=torch.float16), torch.randn(100, dtype=torch.float16)
    out = torch.empty_like(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel[lambda m: ((100 + m["BLOCK"] - 1) // m["BLOCK"],)](x, y, out, 100, 0.5)
    err = float((out.float() - (0.5 * x.float() + y.float())).abs().max())
    config = kernel.config_for({"x_ptr": x, "y_ptr": y, "out_ptr": out, "N": 100})
    print(json.dumps({"config": config, "tuned_now": kernel.tuned_now, "do_bench": len(calls),
                      "err": err, "warnings": [str(w.message) for w in caught]}))
""")


def _launch(tmp: Path, kernel: str, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", LAUNCH, kernel], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_outside_kernel_searched_exported_and_served_with_no_tuning(ext: Any,
                                                                   tmp_path: Path) -> None:
    env = _env(tmp_path)
    db = f"sqlite:///{tmp_path}/ft.db"
    # Found by its entry point's name, as a package registers it.
    _fusetune(tmp_path, "search", "--kernel", "ext_axpy", "--backend", "interpreter",
              "--dims", "N=100", "--db", db, env=env)
    _fusetune(tmp_path, "export", str(tmp_path / "t.yaml"), "--db", db, env=env)
    doc = yaml.safe_load((tmp_path / "t.yaml").read_text())
    assert doc["provenance"]["external_kernels"] == ["ext_axpy"]
    (entry,) = doc["gpus"]["interpreter"]["ext_axpy"]
    assert entry["dims"] == {"N": 100} and entry["dtype"] == "float16"
    assert entry["source"] == ext.axpy_kernel.spec.source_hash
    assert entry["triton"] == triton.__version__
    ran = _launch(tmp_path, "axpy_kernel",
                  {**env, "FUSETUNE_TABLES": str(tmp_path / "t.yaml")})
    assert ran["config"] == entry["config"]
    assert ran["tuned_now"] == 0 and ran["do_bench"] == 0
    assert ran["warnings"] == [] and ran["err"] < 1e-2


def test_tune_now_tunes_once_and_persists(ext: Any, tmp_path: Path) -> None:
    env = _env(tmp_path)
    first = _launch(tmp_path, "axpy_tune_kernel", env)
    assert first["tuned_now"] == 3 and first["err"] < 1e-2  # the three configs of its list
    cache = yaml.safe_load((tmp_path / "cache" / "tuned.yaml").read_text())
    (entry,) = cache["gpus"]["interpreter"]["ext_axpy_tune"]
    assert entry["config"] == first["config"] and entry["source"]
    again = _launch(tmp_path, "axpy_tune_kernel", env)
    assert again["tuned_now"] == 0 and again["do_bench"] == 0 and again["warnings"] == []
    assert again["config"] == first["config"]
    # FUSETUNE_NO_TUNE: no tuning anywhere; the default config, with a warning that says so.
    off = _launch(tmp_path, "axpy_tune_kernel",
                  {**env, "FUSETUNE_CACHE": str(tmp_path / "other.yaml"),
                   "FUSETUNE_NO_TUNE": "1"})
    assert off["tuned_now"] == 0 and off["config"] == {"BLOCK": 32, "num_warps": 1, "num_stages": 3}
    assert any("FUSETUNE_NO_TUNE" in w for w in off["warnings"])


def test_edited_source_is_not_served(ext: Any, tmp_path: Path) -> None:
    ext = tmp_path / "ext"
    shutil.copytree(EXT, ext)
    env = _env(tmp_path, ext)
    db = f"sqlite:///{tmp_path}/ft.db"
    _fusetune(tmp_path, "search", "--kernel", "fusetune_ext_demo:axpy_kernel", "--backend",
              "interpreter", "--dims", "N=100", "--db", db, env=env)
    _fusetune(tmp_path, "export", str(tmp_path / "t.yaml"), "--db", db, env=env)
    env["FUSETUNE_TABLES"] = str(tmp_path / "t.yaml")
    served = _launch(tmp_path, "axpy_kernel", env)
    assert served["warnings"] == []
    module = ext / "fusetune_ext_demo" / "__init__.py"
    # (in the @triton.jit helper the kernel calls: its source is the kernel's too)
    module.write_text(module.read_text().replace(
        "    mask = offs < N\n", "    mask = offs < N  # edited\n", 1))
    edited = _launch(tmp_path, "axpy_kernel", env)
    assert any("another version of its source" in w and "ext_axpy" in w
               for w in edited["warnings"]), edited["warnings"]
    assert any("no tuned config" in w for w in edited["warnings"])


def test_failing_configs_recorded_with_reasons_and_never_served(tmp_path: Path) -> None:
    from fusetune.db.store import Store

    env = _env(tmp_path)
    db = f"sqlite:///{tmp_path}/ft.db"
    _fusetune(tmp_path, "search", "--kernel", "fusetune_ext_demo:faulty_kernel", "--backend",
              "interpreter", "--dims", "N=100", "--db", db, env=env)
    store = Store(db, create=False)
    (point,) = store.points()
    results = {r.config["BLOCK"]: r for r in store.results(point.id).values()}
    assert results[16].status == "ok"
    assert results[32].status == "wrong_result" and "relative error" in results[32].reason
    assert results[64].status == "compile_error" and "BLOCK 64 is refused" in results[64].reason
    assert results[128].status == "infeasible" and "shared-memory" in results[128].reason
    _fusetune(tmp_path, "export", str(tmp_path / "t.yaml"), "--db", db, env=env)
    doc = yaml.safe_load((tmp_path / "t.yaml").read_text())
    assert [e["config"]["BLOCK"] for e in doc["gpus"]["interpreter"]["ext_faulty"]] == [16]


def test_adding_configs_times_only_the_new_ones(tmp_path: Path) -> None:
    from fusetune.db.store import Store

    ext = tmp_path / "ext"
    shutil.copytree(EXT, ext)
    env = _env(tmp_path, ext)
    db = f"sqlite:///{tmp_path}/ft.db"
    search = ("search", "--kernel", "fusetune_ext_demo:faulty_kernel", "--backend",
              "interpreter", "--dims", "N=100", "--db", db)
    _fusetune(tmp_path, *search, env=env)
    store = Store(db, create=False)
    (point,) = store.points()
    before = {k: (r.status, r.time_us) for k, r in store.results(point.id).items()}
    store.engine.dispose()
    module = ext / "fusetune_ext_demo" / "__init__.py"
    text = module.read_text()
    old = '{"BLOCK": 128, "num_warps": 1}],'
    assert old in text
    new = '{"BLOCK": 128, "num_warps": 1}, {"BLOCK": 8, "num_warps": 1}],'
    module.write_text(text.replace(old, new))
    _fusetune(tmp_path, *search, env=env)
    store = Store(db, create=False)
    (same,) = store.points()  # the decorator's list is no part of the kernel's source hash
    after = {k: (r.status, r.time_us) for k, r in store.results(same.id).items()}
    assert same.id == point.id and len(after) == len(before) + 1
    assert {k: after[k] for k in before} == before  # stored results kept, not timed again


# ---- in this process ----------------------------------------------------------------------


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_tables: None) -> Path:
    path = tmp_path / "tuned.yaml"
    monkeypatch.setenv("FUSETUNE_CACHE", str(path))
    runtime.reset()
    return path


def _args(n: int = 100) -> dict:
    x, y = torch.randn(n, dtype=torch.float16), torch.randn(n, dtype=torch.float16)
    return {"x_ptr": x, "y_ptr": y, "out_ptr": torch.empty_like(x), "N": n, "alpha": 0.5}


def test_builtin_names_match_the_registry() -> None:
    assert sorted(registry.BUILTIN) == sorted(REGISTRY)
    with pytest.raises(ValueError, match="taken by fusetune"):
        fusetune.autotune(configs=[{"B": 1}], key=["N"], name="rmsnorm")(_tiny_jit())


def _tiny_jit():
    @triton.jit
    def tiny(x_ptr, N, B: tl.constexpr):
        offs = tl.arange(0, B)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) + 1, mask=offs < N)

    return tiny


def test_get_spec_finds_entry_points_and_module_refs(ext: Any) -> None:
    assert get_spec("ext_axpy") is ext.axpy_kernel.spec
    assert get_spec("fusetune_ext_demo:axpy_tune_kernel") is ext.axpy_tune_kernel.spec
    assert get_spec("ext_axpy_tune") is ext.axpy_tune_kernel.spec  # declared in this process
    with pytest.raises(ValueError, match="registered by installed packages: ext_axpy"):
        get_spec("nope")
    with pytest.raises(ValueError, match="cannot import"):
        get_spec("no_such_module:kernel")
    with pytest.raises(ValueError, match="not a kernel"):
        get_spec("fusetune_ext_demo:make_inputs")


def test_on_miss_error_names_the_search_command(own_cache: Path) -> None:
    kernel = fusetune.autotune(configs=[{"B": 16}], key=["N"], on_miss="error",
                               name="ext_error_miss")(_tiny_jit())
    x = torch.zeros(16)
    with pytest.raises(NotTunedError, match=r"fusetune search --kernel .*:tiny .*--dims N=16"):
        kernel[(1,)](x, 16)


def test_default_miss_warns_once_and_runs_the_first_config(own_cache: Path) -> None:
    kernel = fusetune.autotune(configs=[{"B": 16, "num_warps": 1}, {"B": 32, "num_warps": 2}],
                               key=["N"], name="ext_default_miss")(_tiny_jit())
    x = torch.zeros(16)
    with pytest.warns(fusetune.FusetuneWarning, match="no tuned config for ext_default_miss"):
        kernel[(1,)](x, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel[(1,)](x, 16)
    assert torch.equal(x, torch.full((16,), 2.0))
    assert kernel.config_for({"x_ptr": x, "N": 16}) == {"B": 16, "num_warps": 1}


def test_tune_now_in_process_checks_and_keeps_the_caller_arguments(ext: Any,
                                                                  own_cache: Path) -> None:
    args = _args()
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    n = ext.axpy_tune_kernel.tuned_now
    config = ext.axpy_tune_kernel.config_for(
        args, grid=lambda m: (triton.cdiv(100, m["BLOCK"]),))
    assert ext.axpy_tune_kernel.tuned_now == n + 3
    for k in ("x_ptr", "y_ptr"):
        assert torch.equal(args[k], before[k])
    doc = yaml.safe_load(own_cache.read_text())
    assert doc["gpus"]["interpreter"]["ext_axpy_tune"][0]["config"] == config
    assert doc["provenance"]["external_kernels"] == ["ext_axpy_tune"]


def test_other_triton_warns_or_refuses(ext: Any, own_cache: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    table = {"schema_version": 1, "provenance": {"external_kernels": ["ext_axpy"]},
             "gpus": {"interpreter": {"ext_axpy": [{
                 "dims": {"N": 100}, "dtype": "float16", "batch": 1, "seq": 1,
                 "config": {"BLOCK": 64, "num_warps": 2}, "triton": "0.0.1",
                 "source": ext.axpy_kernel.spec.source_hash}]}}}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(table))
    fusetune.load_tables(path)  # an external kernel of the table: known by its provenance
    with pytest.warns(fusetune.FusetuneWarning, match=r"Triton 0.0.1.*: served"):
        assert ext.axpy_kernel.config_for(_args()) == {"BLOCK": 64, "num_warps": 2}
    monkeypatch.setenv("FUSETUNE_OTHER_TRITON", "refuse")
    fusetune.load_tables(path)  # (loading tables again: the kernel looks up again)
    with pytest.warns(fusetune.FusetuneWarning) as caught:
        config = ext.axpy_kernel.config_for(_args())
    assert config != {"BLOCK": 64, "num_warps": 2}
    assert any("not served" in str(w.message) for w in caught)


def test_unknown_kernel_in_a_table_is_refused_unless_listed(tmp_path: Path,
                                                            fresh_tables: None) -> None:
    entry = {"dims": {"N": 1}, "dtype": "float16", "batch": 1, "seq": 1, "config": {"B": 1}}
    doc = {"schema_version": 1, "provenance": {}, "gpus": {"h100": {"mykernel": [entry]}}}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(fusetune.TableError, match=r"unknown kernel 'mykernel'.*external_kernels"):
        fusetune.load_tables(path)
    doc["provenance"]["external_kernels"] = ["mykernel"]
    path.write_text(yaml.safe_dump(doc))
    assert len(fusetune.load_tables(path)) == 1


def test_key_and_call_errors() -> None:
    with pytest.raises(ValueError, match="key names M, which are not its arguments"):
        fusetune.autotune(configs=[{"B": 16}], key=["M"], name="ext_bad_key")(_tiny_jit())
    with pytest.raises(TypeError, match="does not take warmup"):
        fusetune.autotune(configs=[{"B": 16}], key=["N"], warmup=5)
    with pytest.raises(ValueError, match="on_miss='later'"):
        fusetune.autotune(configs=[{"B": 16}], key=["N"], on_miss="later")
    with pytest.raises(ValueError, match="make_inputs needs grid"):
        fusetune.autotune(configs=[{"B": 16}], key=["N"], make_inputs=lambda **k: {})
    with pytest.raises(TypeError, match="fusetune stores configs as integers"):
        fusetune.autotune(configs=[{"B": 1.5}], key=["N"])
    kernel = fusetune.autotune(configs=[{"B": 16}], key=["N"], name="ext_keyed")(_tiny_jit())
    with pytest.raises(TypeError, match=r"key argument N=2.0 is a float"):
        kernel[(1,)](torch.zeros(16), 2.0)
    with pytest.raises(ValueError, match="given by the call and by the tuned config"):
        kernel[(1,)](torch.zeros(16), 16, B=16)


def test_signature_keys_other_dtypes() -> None:
    args = {"a": torch.zeros(2, dtype=torch.float16), "b": torch.zeros(2, dtype=torch.int8),
            "c": torch.zeros(2, dtype=torch.float32), "d": torch.zeros(2, dtype=torch.int8)}
    assert signature(args, list(args))[:2] == ("float16", "int8,float32")
    same = {"a": torch.zeros(2), "n": 3, "b": torch.zeros(2)}
    assert signature(same, list(same))[:2] == ("float32", "")


def test_space_constraints_ranges_and_lists(ext: Any) -> None:
    spec = ext.axpy_kernel.spec
    space = parse_space_data({"params": {"BLOCK": {"values": [16]},
                                         "num_warps": {"range": [1, 5, 2]}},
                              "constraints": ["BLOCK * num_warps <= N"]}, spec, "s")
    assert [c["num_warps"] for c in space.configs()] == [1, 3, 5]
    assert space.violated({"BLOCK": 16, "num_warps": 3}, {"N": 32}) == \
        "constraint: BLOCK * num_warps <= N"
    assert space.violated({"BLOCK": 16, "num_warps": 1}, {"N": 32}) is None
    for bad, why in (("__import__('os')", "is not allowed"),
                     ("BLOCK.real > 1", "Attribute is not allowed"),
                     ("BLOCK <", "not an expression")):
        with pytest.raises(SpaceError, match=why):
            parse_space_data({"params": {"BLOCK": {"values": [16]},
                                         "num_warps": {"values": [1]}},
                              "constraints": [bad]}, spec, "s")
    listed = parse_space_data({"configs": [{"BLOCK": 16, "num_warps": 1},
                                           {"BLOCK": 32, "num_warps": 2}]}, spec, "s")
    assert listed.size == 2
    assert listed.from_params(listed.to_params({"BLOCK": 32, "num_warps": 2})) == \
        {"BLOCK": 32, "num_warps": 2}
    assert listed.to_params({"BLOCK": 64, "num_warps": 2}) is None
    with pytest.raises(SpaceError, match=r"either params .* or configs"):
        parse_space_data({"constraints": []}, spec, "s")


def test_prune_configs_by_applies_offline_and_refuses_a_call_it_prunes(
        tmp_path: Path, own_cache: Path) -> None:
    def early(configs: list, named_args: dict) -> list:
        # Blocks wider than the vector are left out, and wide blocks of a strided vector.
        x = named_args["x_ptr"]
        return [c for c in configs if c.kwargs["B"] <= max(16, x.numel())
                and (c.kwargs["B"] <= 16 or x.stride(0) == 1)]

    def make(N: int, dtype: torch.dtype, device: str) -> dict:
        return {"x_ptr": torch.zeros(N, dtype=dtype, device=device), "N": N}

    kernel = fusetune.autotune(configs=[{"B": 16}, {"B": 64}], key=["N"],
                               prune_configs_by={"early_config_prune": early},
                               make_inputs=make, grid=(1,), name="ext_pruned")(_tiny_jit())
    point = fusetune.Point.make("ext_pruned", {"N": 16}, 1, 1, "float32")
    assert kernel.spec.resources({"B": 64}, point).unfit.startswith("prune_configs_by")
    assert not kernel.spec.resources({"B": 16}, point).unfit
    # The pruning reads the tensor's stride, which the key does not hold: a call it prunes
    # the served config for (tuned on a contiguous vector) fails loudly rather than running
    # a config its own rule forbids.
    entry = {"dims": {"N": 64}, "dtype": "float32", "batch": 1, "seq": 1, "config": {"B": 64},
             "source": kernel.spec.source_hash}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1,
                                    "provenance": {"external_kernels": ["ext_pruned"]},
                                    "gpus": {"interpreter": {"ext_pruned": [entry]}}}))
    fusetune.load_tables(path)
    assert kernel.config_for({"x_ptr": torch.zeros(64), "N": 64}) == {"B": 64}
    with pytest.raises(ValueError, match="early_config_prune leaves out"):
        kernel[(1,)](torch.zeros(128)[::2], 64)


def test_example_package_registers_and_computes(monkeypatch: pytest.MonkeyPatch,
                                                own_cache: Path) -> None:
    """examples/tuned_matmul: its entry point names its kernel, which computes a @ b."""
    example = ROOT / "examples" / "tuned_matmul"
    text = (example / "pyproject.toml").read_text()
    assert '[project.entry-points."fusetune.kernels"]' in text
    assert 'tuned_matmul = "tuned_matmul:matmul_kernel"' in text
    monkeypatch.syspath_prepend(str(example))
    module = importlib.import_module("tuned_matmul")
    assert module.matmul_kernel.spec.name == "tuned_matmul"
    assert get_spec("tuned_matmul:matmul_kernel") is module.matmul_kernel.spec
    a, b = torch.randn(20, 40), torch.randn(40, 24)
    with pytest.warns(fusetune.FusetuneWarning, match="no tuned config for tuned_matmul"):
        c = module.matmul(a, b)
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)


def test_coverage_of_a_points_file(ext: Any, tmp_path: Path, fresh_tables: None) -> None:
    from cli_helpers import invoke

    entry = {"dims": {"N": 100}, "dtype": "float16", "batch": 1, "seq": 1,
             "config": {"BLOCK": 64, "num_warps": 2}, "source": ext.axpy_kernel.spec.source_hash}
    table = tmp_path / "t.yaml"
    table.write_text(yaml.safe_dump({"schema_version": 1,
                                     "provenance": {"external_kernels": ["ext_axpy"]},
                                     "gpus": {"interpreter": {"ext_axpy": [entry]}}}))
    points = tmp_path / "p.yaml"
    points.write_text(yaml.safe_dump({"points": [
        {"kernel": "ext_axpy", "dims": {"N": 100}, "rows": 1, "dtype": "float16"},
        {"kernel": "ext_axpy", "dims": {"N": 200}, "rows": 1, "dtype": "float16"}]}))
    r = invoke("coverage", "--points", str(points), "--kernel", "fusetune_ext_demo:axpy_kernel",
               "--gpu", "interpreter", "--tables", str(table))
    assert r.exit_code == 0, r.output
    assert "1 exact; 0 rows; 0 nearby; 1 default" in r.output
    assert "fusetune search --kernel fusetune_ext_demo:axpy_kernel --points" in r.output
    r = invoke("coverage", "--points", str(points), "--model", "llama-3-8b", "--gpu", "h100")
    assert r.exit_code == 2 and "give --model" in r.output


@triton.jit
def _add_into(x_ptr, out_ptr, N, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    tl.atomic_add(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)


@triton.jit
def _increment(x_ptr, N, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) + 1.0, mask=offs < N)


def test_tune_now_honours_reset_to_zero_and_restore_value(own_cache: Path) -> None:
    configs = [{"B": 16, "num_warps": 1}, {"B": 32, "num_warps": 1}]
    adder = fusetune.autotune(configs=configs, key=["N"], reset_to_zero=["out_ptr"],
                              on_miss="tune", name="ext_add_into")(_add_into)
    x, out = torch.randn(40), torch.zeros(40)
    adder[lambda m: (triton.cdiv(40, m["B"]),)](x, out, 40)
    assert adder.tuned_now == 2
    torch.testing.assert_close(out, x)  # one accumulation: the tuning's own were zeroed
    bumper = fusetune.autotune(configs=configs, key=["N"], restore_value=["x_ptr"],
                               on_miss="tune", name="ext_increment")(_increment)
    y = torch.randn(40)
    before = y.clone()
    bumper[lambda m: (triton.cdiv(40, m["B"]),)](y, 40)
    assert bumper.tuned_now == 2
    torch.testing.assert_close(y, before + 1)  # incremented once, by the call itself
