"""The per-user cache of configs tuned at run time (`fusetune.autotune(on_miss="tune")`).

One table file (runtime.tuned_cache_path), in the format `fusetune export` writes, read by the
lookup after the loaded and the shipped tables. Processes that tune at
once each add their entries under a file lock, read-modify-write, written atomically: none is
lost and no reader sees half a file.

This is the runtime path: it never imports optuna or sqlalchemy.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from fusetune.runtime import (
    EXTERNAL_FIELD,
    SCHEMA_VERSION,
    UNCATALOGUED_FIELD,
    TableError,
    parse_tables,
    tuned_cache_path,
)


@contextlib.contextmanager
def _locked(p: Path) -> Iterator[None]:
    p.parent.mkdir(parents=True, exist_ok=True)
    lock = p.with_name(p.name + ".lock")
    with open(lock, "a") as f:
        try:
            import fcntl
        except ImportError:  # no advisory locks here: one writer at a time is assumed
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _identity(e: dict[str, Any]) -> tuple[Any, ...]:
    return (tuple(sorted(e["dims"].items())), e["dtype"], e.get("weights") or "",
            e["batch"] * e["seq"])


def add(gpu: str, kernel: str, entry: dict[str, Any], catalogued: bool) -> Path:
    """Stores `entry` (a table entry of `kernel` on `gpu`), replacing the cache's entry of the
    same key; returns the file. `catalogued`: whether `gpu` is a catalogue name (else it is
    listed as a GPU outside the catalogue, as export does)."""
    p = tuned_cache_path()
    with _locked(p):
        doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "provenance": {}, "gpus": {}}
        if p.is_file():
            text = p.read_text()
            parse_tables(text, str(p), None)  # a file the runtime would reject is not built on
            doc = yaml.safe_load(text)
        entries = doc["gpus"].setdefault(gpu, {}).setdefault(kernel, [])
        entries[:] = [e for e in entries if _identity(e) != _identity(entry)] + [entry]
        prov = doc["provenance"]
        # (the package is loaded: its version without importing it here, which would be a cycle)
        prov["generator"] = f"fusetune {sys.modules['fusetune'].__version__} (tuned at run time)"
        prov["updated"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        prov[EXTERNAL_FIELD] = sorted(set(prov.get(EXTERNAL_FIELD) or []) | {kernel})
        if not catalogued:
            prov[UNCATALOGUED_FIELD] = sorted(set(prov.get(UNCATALOGUED_FIELD) or []) | {gpu})
        text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100)
        try:
            parse_tables(text, str(p), None)
        except TableError as e:  # an entry the lookup would refuse is a bug, not a user error
            raise AssertionError(f"a run-time tuned entry does not parse back: {e}") from None
        tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text)
            tmp.replace(p)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
    return p
