"""Winners in the database -> the YAML lookup-table format read by `fusetune.tables`."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from fusetune import __version__
from fusetune.db.store import Store
from fusetune.tables import SCHEMA_VERSION, parse_tables


def build_tables(store: Store, gpu: str | None = None, kernel: str | None = None
                 ) -> dict[str, Any]:
    """The table document for the winners in `store` (newest winner per point)."""
    gpus: dict[str, dict[str, list[dict[str, Any]]]] = {}
    seen: set[tuple[Any, ...]] = set()
    versions: set[tuple[str, str]] = set()
    for p, w in store.winners(gpu=gpu, kernel=kernel):  # newest first
        ident = (p.gpu, p.kernel, p.dims, p.batch, p.seq, p.dtype, p.weights)
        if ident in seen:
            continue
        seen.add(ident)
        versions.add((p.triton_version, p.torch_version))
        entry: dict[str, Any] = {"dims": json.loads(p.dims), "dtype": p.dtype}
        if p.weights:
            entry["weights"] = p.weights
        entry.update(batch=p.batch, seq=p.seq, config=dict(w.config),
                     time_us=round(w.time_us, 3),
                     default_us=None if w.default_us is None else round(w.default_us, 3),
                     triton=p.triton_version, torch=p.torch_version, backend=p.backend)
        gpus.setdefault(p.gpu, {}).setdefault(p.kernel, []).append(entry)
    for kernels in gpus.values():
        for entries in kernels.values():
            entries.sort(key=lambda e: (json.dumps(e["dims"], sort_keys=True), e["dtype"],
                                        e.get("weights", ""), e["batch"] * e["seq"], e["batch"]))
    return {
        "schema_version": SCHEMA_VERSION,
        "provenance": {
            "generator": f"fusetune {__version__}",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": [{"triton": t, "torch": v} for t, v in sorted(versions)],
        },
        "gpus": {g: dict(sorted(k.items())) for g, k in sorted(gpus.items())},
    }


def write_tables(doc: dict[str, Any], path: str | Path) -> int:
    """Writes `doc` atomically after checking it parses back; returns the number of entries."""
    text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100)
    n = len(parse_tables(text, str(path)))  # never write a file the runtime would reject
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(p)
    return n
