"""Which code a table entry was tuned on: the source hash of what its config runs. A fused
config of the matmul kernels never runs their unfused form (KernelSpec.algorithm_sources), so
an edit to that form alone leaves fused entries served; unfused entries carry the whole
source's hash. Entries with the whole source's hash (older tables) serve while it holds."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

import fusetune
from fusetune import runtime
from fusetune.db.store import PointKey, Store
from fusetune.export import build_tables
from fusetune.kernels import REGISTRY, get_spec
from fusetune.kernels import linear as linear_module
from fusetune.kernels import moe as moe_module
from fusetune.tuner.space import config_key

LINEAR = get_spec("linear")
DIMS = {"bias": 0, "dim": 640, "out": 1728, "residual": 0}  # near no shipped entry
FUSED = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 2,
         "SPLIT_K": 1, "num_warps": 8, "num_stages": 3}
UNFUSED = {**FUSED, "UNFUSED": 1}


def edited_unfused_form() -> Any:
    """linear's spec as it would be after an edit to its unfused form alone (another function
    in the place of its _unfused_2d)."""
    def _unfused_2d(*args: Any) -> None:  # an edited unfused launcher
        raise NotImplementedError

    swap = {id(linear_module._unfused_2d): _unfused_2d}
    return dataclasses.replace(
        LINEAR, source_objects=tuple(swap.get(id(o), o) for o in LINEAR.source_objects),
        algorithm_sources=tuple(swap.get(id(o), o) for o in LINEAR.algorithm_sources))


def test_an_edit_to_the_unfused_form_keeps_the_fused_configs_hash() -> None:
    edited = edited_unfused_form()
    assert edited.source_hash != LINEAR.source_hash  # the kernel's whole source changed
    assert edited.config_source_hash(FUSED) == LINEAR.config_source_hash(FUSED)
    assert edited.config_source_hash(UNFUSED) != LINEAR.config_source_hash(UNFUSED)
    assert LINEAR.config_source_hash(UNFUSED) == LINEAR.source_hash
    assert LINEAR.config_source_hash(FUSED) != LINEAR.source_hash
    # a kernel of one algorithm: one hash for every config
    rmsnorm = get_spec("rmsnorm")
    assert rmsnorm.config_source_hash({"BLOCK_D": 64}) == rmsnorm.source_hash


def edited_spec(spec: Any, old: Any) -> Any:
    """`spec` as it would be after an edit to `old` alone (another function in its place)."""
    def edited(*args: Any) -> None:
        raise NotImplementedError

    def swap(objects: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(edited if o is old else o for o in objects)

    return dataclasses.replace(
        spec, source_objects=swap(spec.source_objects),
        algorithm_sources=swap(spec.algorithm_sources),
        structure_sources=tuple((runs, swap(s)) for runs, s in spec.structure_sources))


def test_an_edit_to_one_structure_keeps_the_others_hash() -> None:
    # moe's per-pair GEMV launches and its grouped tiles are structures of its own code: an
    # edit to one leaves the entries of the other (and of the unfused form) served
    moe = get_spec("moe")
    base = {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "UNFUSED": 0}
    per_pair = moe.validate_config({**base, "BLOCK_M": 1})
    grouped = moe.validate_config({**base, "BLOCK_M": 16})
    unfused = moe.validate_config({**base, "BLOCK_M": 16, "UNFUSED": 1})
    hashes = {moe.config_source_hash(c) for c in (per_pair, grouped, unfused)}
    assert len(hashes) == 3 and moe.source_hash not in hashes
    # an entry is served on its own structure's hash (or the whole source's), not another's
    assert moe.runs_source(moe.config_source_hash(per_pair), per_pair)
    assert moe.runs_source(moe.source_hash, per_pair)
    assert not moe.runs_source(moe.config_source_hash(grouped), per_pair)
    assert not moe.runs_source(moe.config_source_hash(per_pair), unfused)
    edits = {"per-pair": moe_module._launch_per_pair, "grouped": moe_module.group_pairs,
             "unfused": moe_module._launch_unfused, "shared": moe_module._launch_2d}
    changed = {"per-pair": {0}, "grouped": {1}, "unfused": {2}, "shared": {0, 1, 2}}
    for name, old in edits.items():
        edited = edited_spec(moe, old)
        got = {i for i, c in enumerate((per_pair, grouped, unfused))
               if edited.config_source_hash(c) != moe.config_source_hash(c)}
        assert got == changed[name], name


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_algorithm_sources_are_sources_of_an_algorithm(name: str) -> None:
    spec = get_spec(name)
    ids = {id(o) for o in spec.source_objects}
    assert all(id(o) in ids for o in spec.algorithm_sources)
    assert not spec.algorithm_sources or spec.algorithm_keys
    assert all(id(o) in ids for _, sources in spec.structure_sources for o in sources)


def lookup_with(tmp_path: Path, config: dict[str, int], source: str) -> dict[str, int]:
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {"h100": {
        "linear": [{"dims": DIMS, "dtype": "bfloat16", "batch": 1, "seq": 256,
                    "config": config, "source": source}]}}}))
    fusetune.load_tables(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fusetune.lookup("linear", DIMS, "bfloat16", rows=256, gpu="h100")
    return {k: got[k] for k in config}


def test_the_lookup_serves_an_entry_of_the_code_its_config_runs(
        tmp_path: Path, fresh_tables: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_shipped", runtime.Tables())
    own, whole = LINEAR.config_source_hash(FUSED), LINEAR.source_hash
    assert lookup_with(tmp_path, FUSED, own) == FUSED
    assert lookup_with(tmp_path, FUSED, whole) == FUSED  # an older table's hash
    assert lookup_with(tmp_path, UNFUSED, whole) == UNFUSED
    # the fused code's hash does not vouch for a config that runs the unfused form, and no
    # other version's hash is served: the default runs
    assert lookup_with(tmp_path, UNFUSED, own) != UNFUSED
    assert lookup_with(tmp_path, FUSED, "0123456789ab") != FUSED
    # after an edit to the unfused form alone the fused entry is still served
    monkeypatch.setitem(REGISTRY, "linear", edited_unfused_form())
    assert lookup_with(tmp_path, FUSED, own) == FUSED
    assert lookup_with(tmp_path, UNFUSED, whole) != UNFUSED


def test_export_records_the_hash_of_what_the_winner_runs(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path}/ft.db")

    def winner(rows: int, config: dict[str, int], kernel_hash: str) -> None:
        pid = store.point_id(PointKey("h100-sxm", "linear", DIMS, 1, rows, "bfloat16", "",
                                      "cuda", kernel_hash, "3.6.0", "2.11"))
        c = LINEAR.validate_config(config)
        store.record(pid, config_key(c), c, "ok", time_us=10.0, p20_us=9.5, p80_us=10.5)
        store.set_winner(pid, c, 10.0, c, 10.0, 1, 1, 1)

    winner(16, FUSED, LINEAR.source_hash)
    winner(64, UNFUSED, LINEAR.source_hash)
    winner(256, FUSED, "0123456789ab")  # tuned on another version: its own hash stays
    entries = build_tables(store)["gpus"]["h100-sxm"]["linear"]
    sources = {e["seq"]: e["source"] for e in entries}
    assert sources == {16: LINEAR.config_source_hash(FUSED), 64: LINEAR.source_hash,
                       256: "0123456789ab"}, json.dumps(entries)[:500]
