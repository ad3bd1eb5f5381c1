"""The store on SQLite and PostgreSQL: points, results, winners, claims, concurrent writers;
export to the YAML table format and back."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from old_schema import create_old_table
from sqlalchemy import Column, DateTime, Integer, String
from sqlalchemy import UniqueConstraint as Unique

from fusetune import export, tables
from fusetune.db.models import RunningRow, utcnow
from fusetune.db.store import PointKey, Store, StoreError, make_engine, normalize_url
from fusetune.kernels import get_spec
from fusetune.tuner import liveness
from fusetune.tuner.search import open_storage
from fusetune.tuner.space import config_key

pytestmark = pytest.mark.usefixtures("fresh_tables")

CFG_A = {"BLOCK_D": 64, "ROWS": 1, "num_warps": 4, "num_stages": 1}
CFG_B = {"BLOCK_D": 64, "ROWS": 2, "num_warps": 8, "num_stages": 1}
CFG_C = {"BLOCK_D": 128, "ROWS": 4, "num_warps": 2, "num_stages": 2}


# The kernel's own source hash: exported entries name it, and the lookup serves only those of
# the source it runs.
RMSNORM_HASH = get_spec("rmsnorm").source_hash


def key(gpu: str = "h100-sxm", batch: int = 1, seq: int = 1, dim: int = 64,
        dtype: str = "float16", kernel: str = "rmsnorm", **kw: str) -> PointKey:
    base = dict(gpu=gpu, kernel=kernel, dims={"dim": dim}, batch=batch, seq=seq, dtype=dtype,
                weights="", backend="cuda", kernel_hash=RMSNORM_HASH, triton_version="3.9.0",
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
    assert (f"fusetune/h100-sxm/rmsnorm/dim=64/b=1/s=1/float16/cuda/k={RMSNORM_HASH}"
            in p.study_name)


def test_points_of_one_kernel_and_of_one_shape(db_url: str) -> None:
    store = Store(db_url)
    old = store.point_id(key(kernel_hash="old000"))
    new = store.point_id(key())
    other = store.point_id(key(batch=16))
    cpu = store.point_id(key(backend="interpreter"))
    ffn = store.point_id(key(kernel="ffn"))
    store.record(old, "a", CFG_A, "ok", time_us=1.0)
    assert [p.id for p in store.points("rmsnorm")] == [old, new, other, cpu]
    assert [p.id for p in store.points("ffn")] == [ffn]
    # every version of that shape, the most results first, then the newest
    found = store.points_of_shape("h100-sxm", "rmsnorm", {"dim": 64}, 1, 1, "float16", "")
    assert [(p.id, n) for p, n in found] == [(old, 1), (cpu, 0), (new, 0)]
    found = store.points_of_shape("h100-sxm", "rmsnorm", {"dim": 64}, 1, 1, "float16", "",
                                  backend="cuda")
    assert [p.id for p, _ in found] == [old, new]
    assert store.points_of_shape("h100-sxm", "rmsnorm", {"dim": 64}, 1, 1, "bfloat16", "") == []


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


def test_reason_with_a_nul_byte_is_stored(db_url: str) -> None:
    # what a dying process prints may hold NUL, which PostgreSQL's text refuses
    store = Store(db_url)
    pid = store.point_id(key())
    store.record(pid, config_key(CFG_A), CFG_A, "crashed", "worker died:\x00 SIGSEGV")
    assert Store(db_url).results(pid)[config_key(CFG_A)].reason == "worker died: SIGSEGV"


def test_set_winner_replaces_the_winner_it_was_compared_with(db_url: str) -> None:
    store = Store(db_url)
    pid = store.point_id(key())
    assert store.winner(pid) is None
    first = store.set_winner(pid, CFG_A, 5.0, CFG_B, 6.0, 1000, 500, 3)
    assert (first.config, first.time_us) == (CFG_A, 5.0)
    # Another search that did not see `first` (it read no winner): `first` stays, for both.
    assert store.set_winner(pid, CFG_B, 1.0, CFG_B, 1.0, 1000, 500, 5).config == CFG_A
    second = store.set_winner(pid, CFG_C, 4.0, CFG_B, None, 1000, 500, 7, replaces=first)
    assert (second.config, second.time_us, second.id) == (CFG_C, 4.0, first.id)
    # `first` is not the stored winner any more: replacing it changes nothing
    kept = store.set_winner(pid, CFG_A, 0.5, CFG_B, 6.0, 1000, 500, 9, replaces=first)
    assert (kept.config, kept.time_us, kept.updated_at) == (CFG_C, 4.0, second.updated_at)
    ws = store.winners()
    assert len(ws) == 1
    p, w = ws[0]
    assert p.id == pid
    assert (w.config, w.time_us, w.default_config, w.default_us, w.n_evaluated) == (
        CFG_C, 4.0, CFG_B, None, 7)
    assert (w.bytes, w.flops) == (1000, 500)


def test_a_point_with_its_winner_is_in_the_sqlite_file_itself(tmp_path: Path) -> None:
    # SQLite's write-ahead log holds what was written until it is copied into the file: a
    # search killed later, its database file copied elsewhere without the -wal beside it,
    # must not lose the points it finished.
    path = tmp_path / "ft.db"
    store = Store(f"sqlite:///{path}")
    pid = store.point_id(key())
    store.record(pid, config_key(CFG_A), CFG_A, "ok", time_us=5.0)
    store.set_winner(pid, CFG_A, 5.0, CFG_B, 6.0, 1000, 500, 1)
    assert (tmp_path / "ft.db-wal").exists()  # the search still runs: its log is open
    copy = tmp_path / "copy.db"
    shutil.copyfile(path, copy)
    copied = Store(f"sqlite:///{copy}", create=False)
    try:
        assert [(w.config, w.time_us) for _, w in copied.winners()] == [(CFG_A, 5.0)]
        assert len(copied.results(pid)) == 1
    finally:
        copied.engine.dispose()
        store.engine.dispose()


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
        group = back.groups[(k.gpu, "rmsnorm", (("dim", 64),), k.dtype, "", "")]
        assert (k.batch * k.seq, c) in group
    # and the runtime reads the file
    tables.load_tables(out)
    import fusetune

    assert fusetune.lookup("rmsnorm", {"dim": 64}, "float16", rows=64, gpu="h100") == CFG_C
    assert fusetune.lookup("rmsnorm", {"dim": 64}, "bfloat16", rows=1, gpu="3090") == CFG_B


def test_export_of_gpus_outside_the_catalogue_loads_back(db_url: str, tmp_path: Path) -> None:
    # Points measured on devices outside the catalogue are stored under their device names'
    # slugs; the exported table lists those GPUs, so that it loads back (and updates) whatever
    # the names look like.
    store = Store(db_url)
    for gpu, c in (("orin", CFG_A), ("nvidia-a40", CFG_B), ("h100-sxm", CFG_C)):
        store.set_winner(store.point_id(key(gpu=gpu)), c, 3.0, CFG_A, 4.0, 100, 50, 1)
    document = export.build_tables(store)
    assert document["provenance"]["uncatalogued_gpus"] == ["nvidia-a40", "orin"]
    out = tmp_path / "tables.yaml"
    assert export.write_tables(document, out) == 3
    assert {k[0] for k in tables.load_tables(out).groups} == {"orin", "nvidia-a40", "h100-sxm"}
    updated, done = export.update_tables(out.read_text(), str(out),
                                         export.build_tables(store, gpu="h100-sxm"))
    assert (done.replaced, done.kept) == (1, 2)
    assert updated["provenance"]["uncatalogued_gpus"] == ["nvidia-a40", "orin"]
    assert export.write_tables(updated, out) == 3


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


def test_update_replaces_same_points_and_keeps_the_rest(db_url: str, tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    # The file: two h100 points (one the database will retune, written under an alias) and a
    # kernel the database has nothing for.
    old.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {"versions": [
        {"triton": "3.6.0", "torch": "2.11.0"}]}, "gpus": {"h100": {"rmsnorm": [
            {"dims": {"dim": 64}, "dtype": "float16", "batch": 1, "seq": 1, "config": CFG_C},
            {"dims": {"dim": 64}, "dtype": "float16", "batch": 1, "seq": 4096,
             "config": CFG_C}],
            "rope": [{"dims": {"head_dim": 64, "heads": 2, "interleaved": 1},
                      "dtype": "float16", "batch": 1, "seq": 1,
                      "config": {"BLOCK_T": 1, "BLOCK_H": 2, "num_warps": 1}}]}}}))
    store = Store(db_url)
    _fill(store)  # h100: batch 1 (CFG_A), 4, seq 64; rtx-3090: two points
    doc, done = export.update_tables(old.read_text(), str(old), export.build_tables(store))
    assert (done.replaced, done.added, done.kept) == (1, 4, 2)
    assert export.write_tables(doc, old) == 7
    back = yaml.safe_load(old.read_text())
    assert list(back["gpus"]) == ["h100-sxm", "rtx-3090"]  # the alias written canonically
    rms = back["gpus"]["h100-sxm"]["rmsnorm"]
    assert [(e["batch"], e["seq"]) for e in rms] == [(1, 1), (4, 1), (1, 64), (1, 4096)]
    assert rms[0]["config"] == CFG_A and rms[0]["time_us"] == 3.142  # the database's winner
    assert rms[-1]["config"] == CFG_C  # kept as it was
    assert len(back["gpus"]["h100-sxm"]["rope"]) == 1
    assert back["provenance"]["versions"] == [{"triton": "3.6.0", "torch": "2.11.0"},
                                              {"triton": "3.9.0", "torch": "2.13.0"}]
    tables.load_tables(old)
    import fusetune

    assert fusetune.lookup("rmsnorm", {"dim": 64}, "float16", rows=1, gpu="h100") == CFG_A


def test_export_and_update_keep_one_entry_per_row_count(db_url: str, tmp_path: Path) -> None:
    # The lookup reads one entry per row count (rows = batch x seq): of two splits of the same
    # rows the export writes the newest winner only, and an update replaces the file's entries
    # of those rows whatever their split; a left-over one would be read in the new one's place.
    store = Store(db_url)
    store.set_winner(store.point_id(key(batch=1, seq=4096)), CFG_A, 3.0, CFG_A, 4.0, 100, 50, 1)
    store.set_winner(store.point_id(key(batch=4096, seq=1)), CFG_B, 3.0, CFG_A, 4.0, 100, 50, 1)
    store.set_winner(store.point_id(key(batch=4, seq=1)), CFG_B, 3.0, CFG_A, 4.0, 100, 50, 1)
    doc = export.build_tables(store)
    entries = doc["gpus"]["h100-sxm"]["rmsnorm"]
    assert [(e["batch"], e["seq"], e["config"]) for e in entries] == [(4, 1, CFG_B),
                                                                      (4096, 1, CFG_B)]
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {"h100": {
        "rmsnorm": [{"dims": {"dim": 64}, "dtype": "float16", "batch": b, "seq": s,
                     "config": CFG_C} for b, s in ((1, 4096), (8, 512), (1, 4), (2, 1))]}}}))
    updated, done = export.update_tables(old.read_text(), str(old), doc)
    assert (done.replaced, done.added, done.kept) == (2, 0, 1)
    assert export.write_tables(updated, old) == 3
    back = yaml.safe_load(old.read_text())["gpus"]["h100-sxm"]["rmsnorm"]
    assert [(e["batch"], e["seq"], e["config"]) for e in back] == [
        (2, 1, CFG_C), (4, 1, CFG_B), (4096, 1, CFG_B)]
    tables.load_tables(old)
    import fusetune

    for rows in (4, 4096):
        assert fusetune.lookup("rmsnorm", {"dim": 64}, "float16", rows=rows, gpu="h100") == CFG_B


def test_update_refuses_an_invalid_file(db_url: str, tmp_path: Path) -> None:
    store = Store(db_url)
    _fill(store)
    bad = "schema_version: 1\nprovenance: {}\ngpus: {h100: {rmsnorm: [{dims: {dim: 64}}]}}\n"
    with pytest.raises(tables.TableError, match=r"bad\.yaml: .*missing field dtype"):
        export.update_tables(bad, "bad.yaml", export.build_tables(store))


# ---- URLs ------------------------------------------------------------------------------------


def test_postgres_urls_use_psycopg() -> None:
    assert normalize_url("postgresql://u:pw@db.lan:5433/tune") == (
        "postgresql+psycopg://u:pw@db.lan:5433/tune")
    assert normalize_url("postgres://u@db.lan/tune") == "postgresql+psycopg://u@db.lan/tune"
    # an explicit driver, and other databases, are left as given
    assert normalize_url("postgresql+psycopg2://u@h/d") == "postgresql+psycopg2://u@h/d"
    assert normalize_url("sqlite:///x/ft.db") == "sqlite:///x/ft.db"
    assert make_engine("postgresql://u@h/d").dialect.driver == "psycopg"


def test_bad_urls_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StoreError, match=r"'ft\.db' is not a database URL"):
        Store("ft.db")
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if the driver were not installed
    with pytest.raises(StoreError, match=r"postgresql\+psycopg://u:\*\*\*@h/d: PostgreSQL "
                       r"needs the psycopg driver; install it with pip install "
                       r"'fusetune\[postgres\]'"):
        Store("postgresql://u:secret@h/d")


# ---- several writers at once -----------------------------------------------------------------


def _all_at_once(n: int, work: Callable[[int], Any]) -> list[Any]:
    """Runs work(0..n-1) in n threads released together; returns results, raises the first
    error."""
    barrier = threading.Barrier(n)
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            out[i] = work(i)
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out


def test_first_use_of_a_database_by_many_at_once(db_url: str) -> None:
    # Every search creates the tables (its own and Optuna's) if they are missing: eight at
    # once on an empty database must all get through.
    def first_use(_i: int) -> int:
        store = Store(db_url)
        open_storage(db_url)
        return store.point_id(key())

    ids = _all_at_once(8, first_use)
    assert len(set(ids)) == 1 and ids[0] is not None


def test_concurrent_writers_of_one_row(db_url: str) -> None:
    stores = [Store(db_url) for _ in range(8)]
    # the same new point: one row, every writer gets its id
    pids = _all_at_once(8, lambda i: stores[i].point_id(key(batch=7)))
    assert len(set(pids)) == 1
    pid = pids[0]
    # the same config: the first stored result is kept and returned to all
    rows = _all_at_once(8, lambda i: stores[i].record(pid, config_key(CFG_A), CFG_A, "ok",
                                                      time_us=float(i + 1)))
    assert len({r.id for r in rows}) == 1
    assert len({r.time_us for r in rows}) == 1
    assert len(stores[0].results(pid)) == 1
    # the winner of a new point: one row, holding one of the writers' values, which every
    # writer gets back
    got = _all_at_once(8, lambda i: stores[i].set_winner(pid, CFG_B, float(i + 1), CFG_A, 9.0,
                                                         10, 10, i))
    ((p, w),) = stores[0].winners()
    assert p.id == pid and w.config == CFG_B and w.n_evaluated == w.time_us - 1
    assert {(g.time_us, g.n_evaluated) for g in got} == {(w.time_us, w.n_evaluated)}
    # eight that all read that winner and replace it at once: one of them gets through, and
    # every writer gets that one back
    got = _all_at_once(8, lambda i: stores[i].set_winner(pid, CFG_C, float(i + 20), CFG_A, 9.0,
                                                         10, 10, i + 19, replaces=w))
    ((p, w2),) = stores[0].winners()
    assert w2.config == CFG_C and w2.n_evaluated == w2.time_us - 1
    assert {(g.time_us, g.n_evaluated) for g in got} == {(w2.time_us, w2.n_evaluated)}


def test_a_config_is_claimed_once(db_url: str) -> None:
    store, other = Store(db_url), Store(db_url)
    pid = store.point_id(key())
    k = config_key(CFG_A)
    first = store.claim_running(pid, 0, "host-a", 111, k)
    assert first is not None
    assert other.claim_running(pid, 1, "host-b", 222, k) is None  # same config, other trial
    assert other.claim_running(pid, 0, "host-b", 222, config_key(CFG_B)) is None  # same trial
    holder = other.claim_of(pid, 1, k)
    assert holder is not None and (holder.id, holder.host, holder.pid) == (first, "host-a", 111)
    assert other.claim_of(pid, 5, config_key(CFG_C)) is None
    second = other.claim_running(pid, 1, "host-b", 222, config_key(CFG_B))
    assert second is not None
    assert {r.config_key for r in store.running(pid).values()} == {k, config_key(CFG_B)}
    store.release(first)
    assert other.claim_running(pid, 2, "host-b", 222, k) is not None  # free again


def test_a_claim_gone_elsewhere_is_released_and_beaten_quietly(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another process may remove a claim (failing it as stale) while its owner is inside a
    # heartbeat or its release: both are then no-ops, without SQLAlchemy's row-count warning.
    store, other = Store(db_url), Store(db_url)
    pid = store.point_id(key())
    real_session = store.session
    claim: int | None = None

    def session_with_race() -> Any:
        # The claim disappears after a read of its row, or just before a statement.
        s = real_session()
        real_get, real_execute = s.get, s.execute
        reading = []  # non-empty while get reads (it runs execute itself)

        def get(*args: Any, **kwargs: Any) -> Any:
            reading.append(True)
            row = real_get(*args, **kwargs)
            reading.clear()
            other.release(claim)
            return row

        def execute(*args: Any, **kwargs: Any) -> Any:
            if not reading:
                other.release(claim)
            return real_execute(*args, **kwargs)

        s.get, s.execute = get, execute
        return s

    for trial, act in enumerate((store.beat, store.release)):
        claim = store.claim_running(pid, trial, "host-a", 111, config_key(CFG_A))
        assert claim is not None
        monkeypatch.setattr(store, "session", session_with_race)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            act(claim)
        monkeypatch.undo()
        assert store.running(pid) == {}


def test_heartbeat_respects_a_live_claim_and_takes_over_a_dead_one(db_url: str) -> None:
    store = Store(db_url)
    pid = store.point_id(key())
    k = config_key(CFG_A)
    live = store.claim_running(pid, 0, "other-host", 4242, k)
    with (pytest.raises(liveness.ClaimedElsewhere, match="pid 4242 on other-host") as info,
          liveness.Heartbeat(store, pid, 1, config_key=k)):
        pytest.fail("entered a claim that another live search holds")
    assert info.value.claim.id == live
    # the same claim, its heartbeat now older than the grace period: its process is gone
    with store.session() as s:
        row = s.get(RunningRow, live)
        assert row is not None
        row.heartbeat_at = utcnow() - timedelta(seconds=liveness.GRACE_S + 5)
        s.commit()
    with liveness.Heartbeat(store, pid, 1, config_key=k):
        (mine,) = store.running(pid).values()
        assert (mine.trial_number, mine.host, mine.pid) == (1, liveness.HOST, os.getpid())
    assert store.running(pid) == {}


def test_tables_of_an_earlier_version_are_upgraded(db_url: str) -> None:
    # ft_running as it was made before it had a config column
    create_old_table(db_url, "ft_running", Column("trial_number", Integer),
                     Column("host", String(255)), Column("pid", Integer),
                     Column("heartbeat_at", DateTime(timezone=True)),
                     Unique("point_id", "trial_number", name="uq_ft_running"))

    store = Store(db_url)
    pid = store.point_id(key())
    assert store.claim_running(pid, 0, "h", 1, config_key(CFG_A)) is not None
    assert store.claim_running(pid, 1, "h", 1, config_key(CFG_A)) is None  # the unique index
    assert Store(db_url).running(pid)[0].config_key == config_key(CFG_A)  # upgrading twice: ok


def test_an_existing_database_is_required_where_asked(tmp_path: Path) -> None:
    # show and export read a database (create=False): a path that names no file is an error
    # naming it, not a new empty database; a search creates it.
    url = f"sqlite:///{tmp_path}/tunes.db"
    with pytest.raises(StoreError, match=f"no database at {tmp_path}/tunes.db: the file does "
                                         "not exist"):
        Store(url, create=False)
    assert not (tmp_path / "tunes.db").exists()
    Store(url).engine.dispose()
    assert Store(url, create=False).points() == []
    assert Store("sqlite://", create=False).points() == []  # in memory: nothing to find
