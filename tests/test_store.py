"""The SQLite store: points, results, winners; export to the YAML table format and back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from fusetune import export, tables
from fusetune.db.store import PointKey, Store
from fusetune.tuner.space import config_key

pytestmark = pytest.mark.usefixtures("fresh_tables")

CFG_A = {"BLOCK_D": 64, "ROWS": 1, "num_warps": 4, "num_stages": 1}
CFG_B = {"BLOCK_D": 64, "ROWS": 2, "num_warps": 8, "num_stages": 1}
CFG_C = {"BLOCK_D": 128, "ROWS": 4, "num_warps": 2, "num_stages": 2}


def key(gpu: str = "h100-sxm", batch: int = 1, seq: int = 1, dim: int = 64,
        dtype: str = "float16", kernel: str = "rmsnorm", **kw: str) -> PointKey:
    base = dict(gpu=gpu, kernel=kernel, dims={"dim": dim}, batch=batch, seq=seq, dtype=dtype,
                weights="", backend="cuda", kernel_hash="abc123", triton_version="3.9.0",
                torch_version="2.13.0")
    base.update(kw)
    return PointKey(**base)


def test_point_id_is_idempotent(db_url: str) -> None:
    store = Store(db_url)
    a = store.point_id(key())
    assert store.point_id(key()) == a
    assert Store(db_url).point_id(key()) == a  # a second connection finds the same row
    b = store.point_id(key(batch=16))
    c = store.point_id(key(triton_version="3.8.0"))  # another Triton: results must not mix
    assert len({a, b, c}) == 3
    pts = store.points()
    assert [p.id for p in pts] == sorted([a, b, c])
    p = pts[0]
    assert (p.gpu, p.kernel, p.dims, p.batch, p.seq, p.dtype) == (
        "h100-sxm", "rmsnorm", '{"dim":64}', 1, 1, "float16")
    assert p.study_name == key().study_name
    assert "fusetune/h100-sxm/rmsnorm/dim=64/b=1/s=1/float16/cuda/k=abc123" in p.study_name


def test_record_and_results(db_url: str) -> None:
    store = Store(db_url)
    pid = store.point_id(key())
    r1 = store.record(pid, config_key(CFG_A), CFG_A, "ok", time_us=5.0, p20_us=4.5, p80_us=5.5,
                      rel_err=1e-4, compile_s=0.1, trial_number=0)
    store.record(pid, config_key(CFG_B), CFG_B, "wrong_result", "y: relative error 1e-1",
                 rel_err=0.1, trial_number=1)
    store.record(pid, config_key(CFG_C), CFG_C, "infeasible", "shared-memory: too much")
    res = store.results(pid)
    assert set(res) == {config_key(CFG_A), config_key(CFG_B), config_key(CFG_C)}
    a = res[config_key(CFG_A)]
    assert a.id == r1.id
    assert (a.status, a.time_us, a.p20_us, a.p80_us, a.trial_number) == ("ok", 5.0, 4.5, 5.5, 0)
    assert a.config == CFG_A
    assert res[config_key(CFG_B)].reason == "y: relative error 1e-1"
    assert res[config_key(CFG_C)].time_us is None
    assert store.status_counts(pid) == {"ok": 1, "wrong_result": 1, "infeasible": 1}
    other = store.point_id(key(batch=4))
    assert store.results(other) == {}


def test_record_same_config_twice_keeps_first(db_url: str) -> None:
    store = Store(db_url)
    pid = store.point_id(key())
    first = store.record(pid, config_key(CFG_A), CFG_A, "ok", time_us=5.0)
    again = store.record(pid, config_key(CFG_A), CFG_A, "runtime_error", "boom", time_us=1.0)
    assert again.id == first.id
    assert (again.status, again.time_us) == ("ok", 5.0)
    res = store.results(pid)
    assert len(res) == 1
    assert (res[config_key(CFG_A)].status, res[config_key(CFG_A)].time_us) == ("ok", 5.0)
    # the same config at another point is another result
    pid2 = store.point_id(key(batch=2))
    assert store.record(pid2, config_key(CFG_A), CFG_A, "ok", time_us=7.0).id != first.id


def test_set_winner_upserts(db_url: str) -> None:
    store = Store(db_url)
    pid = store.point_id(key())
    store.set_winner(pid, CFG_A, 5.0, CFG_B, 6.0, 1000, 500, 3)
    store.set_winner(pid, CFG_C, 4.0, CFG_B, None, 1000, 500, 7)
    ws = store.winners()
    assert len(ws) == 1
    p, w = ws[0]
    assert p.id == pid
    assert (w.config, w.time_us, w.default_config, w.default_us, w.n_evaluated) == (
        CFG_C, 4.0, CFG_B, None, 7)
    assert (w.bytes, w.flops) == (1000, 500)


def test_winners_filter_by_gpu_and_kernel(db_url: str) -> None:
    store = Store(db_url)
    h1 = store.point_id(key(gpu="h100-sxm", batch=1))
    h2 = store.point_id(key(gpu="h100-sxm", batch=16))
    r1 = store.point_id(key(gpu="rtx-3090", batch=1))
    store.point_id(key(gpu="rtx-3090", batch=64))  # a point without a winner
    o1 = store.point_id(key(gpu="h100-sxm", kernel="layernorm"))
    for pid, c in ((h1, CFG_A), (h2, CFG_B), (r1, CFG_C), (o1, CFG_A)):
        store.set_winner(pid, c, 1.0, CFG_A, 2.0, 10, 10, 1)
    assert {p.id for p, _ in store.winners()} == {h1, h2, r1, o1}
    assert {p.id for p, _ in store.winners(gpu="h100-sxm")} == {h1, h2, o1}
    assert {p.id for p, _ in store.winners(gpu="rtx-3090")} == {r1}
    assert {p.id for p, _ in store.winners(kernel="rmsnorm")} == {h1, h2, r1}
    assert {p.id for p, _ in store.winners(gpu="h100-sxm", kernel="rmsnorm")} == {h1, h2}
    assert store.winners(gpu="h200") == []
    by_point = {p.id: w.config for p, w in store.winners()}
    assert by_point[h2] == CFG_B and by_point[r1] == CFG_C


def _fill(store: Store) -> list[tuple[PointKey, dict[str, int]]]:
    want = [(key(batch=1), CFG_A), (key(batch=4), CFG_B), (key(batch=1, seq=64), CFG_C),
            (key(gpu="rtx-3090", batch=4), CFG_C), (key(gpu="rtx-3090", dtype="bfloat16"), CFG_B)]
    for k, c in want:
        pid = store.point_id(k)
        store.record(pid, config_key(c), c, "ok", time_us=3.0)
        store.set_winner(pid, c, 3.14159, CFG_A, 4.0, 100, 50, 1)
    return want


def test_export_round_trip(db_url: str, tmp_path: Path) -> None:
    store = Store(db_url)
    want = _fill(store)
    document = export.build_tables(store)
    assert document["schema_version"] == tables.SCHEMA_VERSION
    assert list(document["gpus"]) == ["h100-sxm", "rtx-3090"]
    assert document["provenance"]["versions"] == [{"triton": "3.9.0", "torch": "2.13.0"}]
    out = tmp_path / "tables.yaml"
    assert export.write_tables(document, out) == len(want)
    assert not (tmp_path / "tables.yaml.tmp").exists()
    entries = yaml.safe_load(out.read_text())["gpus"]["h100-sxm"]["rmsnorm"]
    assert [e["batch"] * e["seq"] for e in entries] == [1, 4, 64]  # sorted by rows
    assert entries[0]["time_us"] == 3.142 and entries[0]["backend"] == "cuda"
    back = tables.read_tables(out)
    assert len(back) == len(want)
    for k, c in want:
        group = back.groups[(k.gpu, "rmsnorm", (("dim", 64),), k.dtype, "")]
        assert (k.batch * k.seq, c) in group
    # and the runtime reads the file
    tables.load_tables(out)
    import fusetune

    assert fusetune.lookup("rmsnorm", {"dim": 64}, "float16", rows=64, gpu="h100") == CFG_C
    assert fusetune.lookup("rmsnorm", {"dim": 64}, "bfloat16", rows=1, gpu="3090") == CFG_B


def test_export_filters_and_newest_winner(db_url: str, tmp_path: Path) -> None:
    store = Store(db_url)
    _fill(store)
    only = export.build_tables(store, gpu="rtx-3090")
    assert list(only["gpus"]) == ["rtx-3090"]
    assert len(only["gpus"]["rtx-3090"]["rmsnorm"]) == 2
    assert export.build_tables(store, kernel="layernorm")["gpus"] == {}
    # the same point under a newer Triton: only the newest winner is exported
    newer = store.point_id(dataclasses.replace(key(batch=1), triton_version="3.10.0"))
    store.set_winner(newer, CFG_B, 2.0, CFG_A, 4.0, 100, 50, 1)
    document = export.build_tables(store, gpu="h100-sxm")
    entries = document["gpus"]["h100-sxm"]["rmsnorm"]
    assert len(entries) == 3
    first = next(e for e in entries if e["batch"] == 1 and e["seq"] == 1)
    assert (first["config"], first["triton"]) == (CFG_B, "3.10.0")


def test_write_tables_refuses_invalid_document(tmp_path: Path) -> None:
    document = {"schema_version": 1, "provenance": {}, "gpus": {"h100-sxm": {"rmsnorm": [
        {"dims": {"dim": 64}, "dtype": "float16", "batch": 1, "seq": 1,
         "config": {"BLOCK_D": 96, "ROWS": 1, "num_warps": 4, "num_stages": 1}}]}}}
    out = tmp_path / "t.yaml"
    with pytest.raises(tables.TableError, match="BLOCK_D=96 must be a power of two"):
        export.write_tables(document, out)
    assert not out.exists()
