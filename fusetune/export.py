"""Winners in the database -> the YAML lookup-table format read by `fusetune.tables`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from fusetune import __version__
from fusetune.db.store import Store
from fusetune.gpus import UnknownGpuError, resolve
from fusetune.registry import BUILTIN
from fusetune.runtime import EXTERNAL_FIELD, UNCATALOGUED_FIELD
from fusetune.tables import SCHEMA_VERSION, canonical_gpu, parse_tables


def build_tables(store: Store, gpu: str | None = None, kernel: str | None = None
                 ) -> dict[str, Any]:
    """The table document for the winners in `store`: the newest winner per lookup key (GPU,
    kernel, dims, dtype, weights, activation mode, rows = batch × seq), as the lookup reads one
    entry per row count (points of other batch × seq splits of the same rows would leave one
    entry unread). Each entry's timings as `_timings` gives them."""
    gpus: dict[str, dict[str, list[dict[str, Any]]]] = {}
    seen: set[tuple[Any, ...]] = set()
    versions: set[tuple[str, str]] = set()
    for p, w in store.winners(gpu=gpu, kernel=kernel):  # newest first
        # weights holds the activation mode too
        ident = (p.gpu, p.kernel, p.dims, p.batch * p.seq, p.dtype, p.weights)
        if ident in seen:
            continue
        seen.add(ident)
        versions.add((p.triton_version, p.torch_version))
        entry: dict[str, Any] = {"dims": json.loads(p.dims), "dtype": p.dtype}
        if p.weight_format:
            entry["weights"] = p.weight_format
        if p.activations:
            entry["activations"] = p.activations
        entry.update(batch=p.batch, seq=p.seq, config=dict(w.config))
        entry.update(_timings(store, p.id, w, judge=p.backend == "cuda"))
        entry.update(triton=p.triton_version, torch=p.torch_version, backend=p.backend,
                     source=_entry_source(p.kernel, p.kernel_hash, w.config))
        gpus.setdefault(p.gpu, {}).setdefault(p.kernel, []).append(entry)
    return _document(gpus, versions)


# A winner at most this far below the default (a fraction of the default's median) is
# marginal. Not the p20-p80 spread of one timing: that measures the launches' jitter (several
# percent at tens of µs) and one disturbed timing widens it, hiding a real win; medians of one
# config timed apart agree far closer.
MARGINAL = 0.01


def is_marginal(won_us: float, default_us: float) -> bool:
    """Whether a winner timed `won_us` is no win over the default's `default_us`."""
    return default_us - won_us <= MARGINAL * default_us


def _entry_source(kernel: str, kernel_hash: str, config: dict[str, int]) -> str:
    """The source hash an entry records: where the point was tuned on the source this process
    runs, the hash of what its config runs (KernelSpec.config_source_hash: a fused config's
    entry then outlives a change to the unfused form alone); else the point's own (another
    version's, or a kernel this process does not know: the whole source's)."""
    from fusetune.kernels import get_spec

    try:
        spec = get_spec(kernel)
    except (ValueError, ImportError, AttributeError):  # its module not importable here
        return kernel_hash
    return spec.config_source_hash(config) if kernel_hash == spec.source_hash else kernel_hash


def _timings(store: Store, point_id: int, winner: Any, judge: bool) -> dict[str, Any]:
    """An entry's timings, in µs. `time_us` and `default_us`: the medians of the interleaved
    re-timing that picked the winner (the winner row's: like with like); where the row lacks
    one (a default that was not re-timed), the config's stored timing's median. `p20_us`,
    `p80_us` (`default_p20_us`, `default_p80_us`): the 20th and 80th percentiles of the
    config's stored timing (its trial), written where they bracket the median written, so
    that p20_us <= time_us <= p80_us wherever a spread is written. With `judge` (timings of a
    GPU, not the interpreter's wall clock), `marginal` where the winner's median is not
    MARGINAL below the default's, as written (the lookup then runs the default: a win within
    the medians' noise is no reason to leave it). Judged on the re-timing: first timings,
    taken minutes apart, had flagged winners that the re-timing had found faster."""
    from fusetune.tuner.space import config_key

    results = store.results(point_id)
    out: dict[str, Any] = {}
    for name, prefix, config, retimed in (
            ("time_us", "", winner.config, winner.time_us),
            ("default_us", "default_", winner.default_config, winner.default_us)):
        r = results.get(config_key(config))
        stored = r if r is not None and r.status == "ok" and r.time_us is not None else None
        median = retimed if retimed is not None else None if stored is None else stored.time_us
        out[name] = None if median is None else round(median, 3)
        if (median is not None and stored is not None and stored.p20_us is not None
                and stored.p80_us is not None and stored.p20_us <= median <= stored.p80_us):
            out[f"{prefix}p20_us"] = round(stored.p20_us, 3)
            out[f"{prefix}p80_us"] = round(stored.p80_us, 3)
    won, default = out["time_us"], out["default_us"]
    if judge and won is not None and default is not None:
        out["marginal"] = is_marginal(won, default)
    return out


def _entry_order(e: dict[str, Any]) -> tuple[Any, ...]:
    return (json.dumps(e["dims"], sort_keys=True), e["dtype"], e.get("weights", ""),
            e.get("activations", ""), e["batch"] * e["seq"], e["batch"])


def _document(gpus: dict[str, dict[str, list[dict[str, Any]]]],
              versions: set[tuple[str, str]]) -> dict[str, Any]:
    """A table document of these entries (sorted within each kernel) and versions."""
    for kernels in gpus.values():
        for entries in kernels.values():
            entries.sort(key=_entry_order)
    provenance: dict[str, Any] = {
        "generator": f"fusetune {__version__}",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": [{"triton": t, "torch": v} for t, v in sorted(versions)],
    }
    # GPUs outside the catalogue, by the name a search on them stored: listed, so that the
    # loader takes them for GPUs and not for typos whatever their device names look like.
    uncatalogued = sorted(g for g in gpus if not _catalogued(g))
    if uncatalogued:
        provenance[UNCATALOGUED_FIELD] = uncatalogued
    # Kernels not fusetune's own, listed so that the loader knows them for kernels and not
    # typos before their modules declare them.
    external = sorted({k for kernels in gpus.values() for k in kernels} - set(BUILTIN))
    if external:
        provenance[EXTERNAL_FIELD] = external
    return {
        "schema_version": SCHEMA_VERSION,
        "provenance": provenance,
        "gpus": {g: dict(sorted(k.items())) for g, k in sorted(gpus.items())},
    }


def _catalogued(gpu: str) -> bool:
    try:
        resolve(gpu)
    except UnknownGpuError:
        return False
    return True


@dataclass(frozen=True)
class Update:
    """What `update_tables` did: entries of the database that replaced the file's entry (or
    entries) of the same lookup key, those that were new to it, and the file's entries kept as
    they were."""

    replaced: int
    added: int
    kept: int


def update_tables(old_text: str, source: str, new: dict[str, Any]
                  ) -> tuple[dict[str, Any], Update]:
    """The table document `old_text` (validated first; `source` names it in errors) with the
    entries of `new` (a build_tables document) in it: an entry of `new` replaces the file's
    entries of the same lookup key (GPU, kernel, dims, dtype, weight format, activation mode,
    rows = batch × seq: an entry of another split of the same rows would be read in its place),
    the file's other entries stay as they are. GPU names are written canonically ("h100" ->
    "h100-sxm")."""
    parse_tables(old_text, source)  # a file the runtime would reject is not built upon
    old = yaml.safe_load(old_text)
    versions = {(str(v["triton"]), str(v["torch"]))
                for doc in (old, new) for v in doc["provenance"].get("versions") or []
                if isinstance(v, dict) and "triton" in v and "torch" in v}
    gpus: dict[str, dict[str, list[dict[str, Any] | None]]] = {}
    index: dict[tuple[Any, ...], list[int]] = {}  # lookup key -> its entries' places in gpus
    kept = 0
    uncatalogued = old["provenance"].get(UNCATALOGUED_FIELD) or []
    for gpu_key, kernels in old["gpus"].items():
        gpu = canonical_gpu(gpu_key, uncatalogued)
        for kernel, entries in kernels.items():
            for e in entries:
                dst = gpus.setdefault(gpu, {}).setdefault(kernel, [])
                index.setdefault(_identity(gpu, kernel, e), []).append(len(dst))
                dst.append(dict(e))
                kept += 1
    replaced = added = 0
    for gpu, kernels in new["gpus"].items():
        for kernel, entries in kernels.items():
            dst = gpus.setdefault(gpu, {}).setdefault(kernel, [])
            for e in entries:
                ident = _identity(gpu, kernel, e)
                places = index.get(ident)
                if places:
                    dst[places[0]] = dict(e)
                    for i in places[1:]:  # the same rows split otherwise: replaced too
                        dst[i] = None
                    kept -= len(places)
                    index[ident] = places[:1]
                    replaced += 1
                else:
                    index[ident] = [len(dst)]
                    dst.append(dict(e))
                    added += 1
    out = {g: {k: [e for e in es if e is not None] for k, es in ks.items()}
           for g, ks in gpus.items()}
    return _document(out, versions), Update(replaced, added, kept)


def _identity(gpu: str, kernel: str, e: dict[str, Any]) -> tuple[Any, ...]:
    """An entry's lookup key: the lookup reads one entry per row count, whatever its split."""
    return (gpu, kernel, json.dumps(e["dims"], sort_keys=True), e["dtype"],
            e.get("weights") or "", e.get("activations") or "", e["batch"] * e["seq"])


def write_tables(doc: dict[str, Any], path: str | Path) -> int:
    """Writes `doc` atomically after checking it parses back; returns the number of entries.
    OSError where the file cannot be written (a missing or read-only directory)."""
    text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100)
    n = len(parse_tables(text, str(path)))  # never write a file the runtime would reject
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(p)
    except OSError:
        tmp.unlink(missing_ok=True)  # a failed write leaves neither a partial file nor this
        raise
    return n
