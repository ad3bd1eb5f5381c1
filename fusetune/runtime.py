"""The runtime lookup: the config a kernel launches with, for its spec, this GPU and shape.

The launchers hand it their KernelSpec and it never imports the kernel registry, so the arrow
goes from the kernels to here and not back; `fusetune.tables` offers the same by kernel name
(for applications, the tuner and export) and hands in the specs of every kernel.

Sources, in order: the tables given to `load_tables` (or named by the environment variable
FUSETUNE_TABLES, a path or several joined by the OS path separator), then the tables shipped
inside the package. The entries of a kernel are checked against its spec when the table loads
if the loader hands in the specs (fusetune.load_tables does), else when that kernel is first
looked up (the shipped tables and FUSETUNE_TABLES, which the first launch reads).

Lookup (`resolve` says which answered): the exact row count ("exact"), else the next tuned
row count above it (within the tuned range) whose config can serve the asked rows ("rows": the
matmul kernels' one-row structure serves one row; their entries serve fewer than
KernelSpec.row_reach times fewer rows), else the config of the nearest entry of other dims
that the point's limits hold ("nearby"), else the kernel's default heuristic with a one-time
warning ("default"). An entry marked marginal (its winner was not 1% faster than the default)
answers with the default heuristic's config: the point is covered ("exact" or
"rows", marginal), the tuner having found nothing better than the default there.

This is the runtime path: it never imports optuna or sqlalchemy.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
import threading
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fusetune.spec import Config, ConfigError, Point, check_fits

if TYPE_CHECKING:
    from fusetune.gpus import GpuSpec
    from fusetune.spec import KernelSpec

SCHEMA_VERSION = 1
ENV_VAR = "FUSETUNE_TABLES"
# PyYAML's safe loader, in C where libyaml is there: the same documents, and the shipped tables
# (hundreds of entries, read at a process's first lookup) load several times faster.
_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
ENTRY_FIELDS = {"dims": True, "dtype": True, "batch": True, "seq": True, "config": True,
                "weights": False, "activations": False, "time_us": False, "default_us": False,
                "p20_us": False, "p80_us": False, "default_p20_us": False,
                "default_p80_us": False, "marginal": False, "triton": False, "torch": False,
                "backend": False, "source": False}
# The provenance field listing the kernels of a table that are not fusetune's own (declared
# with fusetune.autotune or registered by a package): the loader takes entries of those names
# for kernels it will meet, not for typos, and checks them when the kernel is first looked up.
EXTERNAL_FIELD = "external_kernels"
# What the lookup does with an entry tuned with another Triton version (KernelSpec.other_triton
# for every kernel): warn, refuse or ignore.
OTHER_TRITON_ENV = "FUSETUNE_OTHER_TRITON"
OTHER_TRITON_CHOICES = ("warn", "refuse", "ignore")
TUNED_CACHE_ENV = "FUSETUNE_CACHE"


class TableError(ValueError):
    """A lookup table that is malformed; the message names the file and the entry."""


class FusetuneWarning(UserWarning):
    """A kernel ran with the default heuristic because no tuned config covers its shape."""


# (gpu, kernel, dims, dtype, weights, activations) -> [(rows, config)], sorted by rows
GroupKey = tuple[str, str, tuple[tuple[str, int], ...], str, str, str]


@dataclass(frozen=True)
class RawEntry:
    """A table entry as read, before it is checked against its kernel's spec."""

    source: str  # the file (for messages)
    where: str  # its place in the file: gpus.<gpu>.<kernel>[<i>]
    gpu: str  # canonical name
    raw: Any


@dataclass(frozen=True)
class EntryInfo:
    """What an entry says of its measurement: the winner's and the default heuristic's median
    µs as exported, and whether the winner beat the default by more than 1% of its median
    (`marginal`: it did not, and the lookup runs the default instead)."""

    time_us: float | None = None
    default_us: float | None = None
    marginal: bool = False
    source: str | None = None  # the kernel's source hash it was tuned with (None: not known)
    triton: str | None = None  # the Triton version it was tuned with (None: not known)

    @property
    def speedup(self) -> float | None:
        return self.default_us / self.time_us if self.time_us and self.default_us else None


@dataclass
class Tables:
    """Checked entries grouped by (GPU, kernel, dims, dtype, weights, activations), each group
    sorted by rows, with what each entry says of its measurement in `info`; `unchecked` holds,
    by kernel name, the entries not yet checked against the kernel's spec (see `check`)."""

    groups: dict[GroupKey, list[tuple[int, Config]]] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    unchecked: dict[str, list[RawEntry]] = field(default_factory=dict)
    info: dict[tuple[GroupKey, int], EntryInfo] = field(default_factory=dict)

    def merge(self, other: Tables) -> None:
        for k, rows in other.groups.items():
            self.groups.setdefault(k, []).extend(rows)
            self.groups[k].sort(key=lambda r: r[0])
        for kernel, entries in other.unchecked.items():
            self.unchecked.setdefault(kernel, []).extend(entries)
        for k, info in other.info.items():
            self.info.setdefault(k, info)
        self.sources += other.sources

    def check(self, spec: KernelSpec) -> None:
        """Checks the entries of spec's kernel that are not checked yet (TableError names the
        first bad one, and then nothing changes) and adds them to `groups`."""
        entries = self.unchecked.get(spec.name)
        if not entries:
            return
        checked = [_checked(e, spec) for e in entries]
        del self.unchecked[spec.name]
        for key, rows, config, info in checked:
            self.groups.setdefault(key, []).append((rows, config))
            self.info.setdefault((key, rows), info)
        for key in {c[0] for c in checked}:
            self.groups[key].sort(key=lambda r: r[0])

    def __len__(self) -> int:
        return (sum(len(v) for v in self.groups.values())
                + sum(len(v) for v in self.unchecked.values()))


def clear_memos() -> None:
    """Forgets the launchers' remembered calls (fusetune.kernels._call_memo), where fusetune's
    kernels are loaded: the lookup of a kernel of one's own does not load them."""
    module = sys.modules.get("fusetune.kernels._call_memo")
    if module is not None:
        module.clear_all()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _dims_values_problem(spec: KernelSpec, dims: Mapping[str, Any]) -> str | None:
    """What is wrong with the values of `dims` (named as spec's kernel names them) as a
    lookup's or a table entry's: not a non-negative integer (a size may be 0 here), or not a
    value the kernel takes (KernelSpec.choices_problem); None where nothing is."""
    for k, v in dims.items():
        if not _is_int(v) or v < 0:
            return f"dims.{k}={v!r} must be a non-negative integer"
    problem = spec.choices_problem(dims)
    return None if problem is None else f"dims: {problem}"


def _entry(raw: Any, where: str, spec: KernelSpec, gpu: str
           ) -> tuple[GroupKey, int, Config, EntryInfo]:
    if not isinstance(raw, Mapping):
        raise TableError(f"{where}: an entry must be a mapping, got {type(raw).__name__}")
    missing = [k for k, required in ENTRY_FIELDS.items() if required and k not in raw]
    if missing:
        raise TableError(f"{where}: missing field {', '.join(missing)}")
    unknown = [str(k) for k in raw if k not in ENTRY_FIELDS]
    if unknown:
        raise TableError(f"{where}: unknown field {', '.join(unknown)}; valid: "
                         f"{', '.join(ENTRY_FIELDS)}")
    dims = raw["dims"]
    if not isinstance(dims, Mapping) or not spec.dims_named(dims):
        raise TableError(f"{where}: dims must be a mapping of {spec.dims_text}, got {dims!r}")
    problem = _dims_values_problem(spec, dims)
    if problem is not None:
        raise TableError(f"{where}: {problem}")
    if raw["dtype"] not in spec.dtypes:
        raise TableError(f"{where}: dtype {raw['dtype']!r} is not one of "
                         f"{', '.join(spec.dtypes)}")
    for k in ("batch", "seq"):
        if not _is_int(raw[k]) or raw[k] < 1:
            raise TableError(f"{where}: {k}={raw[k]!r} must be a positive integer")
    weights = raw.get("weights", "") or ""
    if not isinstance(weights, str):
        raise TableError(f"{where}: weights={weights!r} must be a string")
    if weights and not spec.accepts_weights(weights):
        valid = (f"one of {', '.join(spec.weight_formats)}, or left out (weights in the "
                 "activations' dtype)" if spec.weight_formats
                 else "the dtypes of the other tensors, comma-separated (torch names)"
                 if spec.signature is not None
                 else f"left out ({spec.name} has no weights)")
        raise TableError(f"{where}: weights {weights!r}: expected {valid}")
    activations = raw.get("activations", "") or ""
    if activations:
        # The activation mode changes the results: an entry of one mode never serves another.
        try:
            activations = spec.point_activations(activations, weights)
        except ValueError as e:
            raise TableError(f"{where}: {e}") from None
    for k in ("time_us", "default_us", "p20_us", "p80_us", "default_p20_us", "default_p80_us"):
        v = raw.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise TableError(f"{where}: {k}={v!r} must be a number")
    marginal = raw.get("marginal", False)
    if not isinstance(marginal, bool):
        raise TableError(f"{where}: marginal={marginal!r} must be true or false")
    versions = {k: raw.get(k) for k in ("source", "triton")}
    for k, v in versions.items():
        if v is not None and not isinstance(v, str):
            raise TableError(f"{where}: {k}={v!r} must be a string")
    try:
        config = spec.validate_config(raw["config"], where=f"{where}: config")
    except ConfigError as e:
        raise TableError(str(e)) from None
    key: GroupKey = (gpu, spec.name, tuple(sorted(spec.short_dims(dims).items())), raw["dtype"],
                     weights, activations)
    info = EntryInfo(raw.get("time_us"), raw.get("default_us"), marginal, versions["source"],
                     versions["triton"])
    return key, raw["batch"] * raw["seq"], config, info


def _checked(entry: RawEntry, spec: KernelSpec
             ) -> tuple[GroupKey, int, Config, EntryInfo]:
    try:
        return _entry(entry.raw, entry.where, spec, entry.gpu)
    except TableError as e:
        raise TableError(f"{entry.source}: {e}") from None


# The name of a GPU outside the catalogue is the slug of its CUDA device name
# (gpus.spec_from_device): that is what a search on it stores, `fusetune export` writes and the
# runtime looks up there. The driver's names begin with the vendor or the product line ("NVIDIA
# A40" -> nvidia-a40, "Tesla T4" -> tesla-t4, "AMD Instinct MI300X" under ROCm), or the slug
# is cuda-<index> for a device without a name. Any other name is taken for a typo ("rtx9999",
# "h100x"), whose entries would match no device, unless the table lists it in its provenance
# (UNCATALOGUED_FIELD), as export does for every GPU outside the catalogue it writes.
UNCATALOGUED_GPU = re.compile(
    r"(nvidia|tesla|quadro|geforce|titan|grid|amd|radeon)(-[a-z0-9]+)+|cuda-\d+")
UNCATALOGUED_FIELD = "uncatalogued_gpus"


def canonical_gpu(name: Any, uncatalogued: Collection[str] = ()) -> str:
    """The name tables key a GPU by: a catalogue GPU's canonical name for any of its names
    ("h100" -> "h100-sxm", "NVIDIA H100 80GB HBM3" -> "h100-sxm"); a GPU outside the catalogue
    by the slug of its device name ("NVIDIA A40" -> "nvidia-a40"), if it begins as a device
    name does (UNCATALOGUED_GPU) or is among `uncatalogued` (names a table lists as GPUs
    outside the catalogue). UnknownGpuError (a ValueError) for any other name, with the
    catalogue's names and aliases."""
    from fusetune import gpus

    text = str(name)
    try:
        return gpus.resolve(text).name
    except gpus.UnknownGpuError as e:
        slug = gpus._slugify(text)  # the one slug rule: the runtime's name for such a device
        if UNCATALOGUED_GPU.fullmatch(slug) or slug in {gpus._slugify(u) for u in uncatalogued}:
            return slug
        raise gpus.UnknownGpuError(
            f"{e}; or a GPU outside the catalogue by its CUDA device name or that name's slug, "
            f"as `fusetune export` writes it (nvidia-a40, tesla-t4; any other name listed in "
            f"provenance.{UNCATALOGUED_FIELD})") from None


def parse_tables(text: str, source: str, specs: Mapping[str, KernelSpec] | None) -> Tables:
    """The table file `text` (`source` names it in errors), its document checked now.

    `specs` (kernel name -> spec): every entry is checked now against its kernel's spec, and a
    kernel outside `specs` is an error. None: each kernel's entries are checked when it is
    first looked up (Tables.check). Either way TableError names the bad entry. The GPU keys
    are checked now, whatever `specs`: a name canonical_gpu refuses is an error, as its
    entries would never be used."""
    try:
        data = yaml.load(text, Loader=_SAFE_LOADER)
    except yaml.YAMLError as e:  # includes tags that try to build Python objects
        raise TableError(f"{source}: rejected, not plain YAML data: {' '.join(str(e).split())}"
                         ) from None
    if not isinstance(data, Mapping):
        raise TableError(f"{source}: expected a mapping with schema_version, provenance, gpus")
    for k in ("schema_version", "provenance", "gpus"):
        if k not in data:
            raise TableError(f"{source}: missing top-level field {k!r}")
    if data["schema_version"] != SCHEMA_VERSION:
        raise TableError(f"{source}: schema_version {data['schema_version']!r} is not supported "
                         f"(this fusetune reads {SCHEMA_VERSION})")
    if not isinstance(data["provenance"], Mapping):
        raise TableError(f"{source}: provenance must be a mapping")
    uncatalogued = data["provenance"].get(UNCATALOGUED_FIELD) or []
    if not isinstance(uncatalogued, list) or not all(isinstance(u, str) for u in uncatalogued):
        raise TableError(f"{source}: provenance.{UNCATALOGUED_FIELD} must be a list of GPU "
                         f"names, got {uncatalogued!r}")
    external = data["provenance"].get(EXTERNAL_FIELD) or []
    if not isinstance(external, list) or not all(isinstance(k, str) for k in external):
        raise TableError(f"{source}: provenance.{EXTERNAL_FIELD} must be a list of kernel "
                         f"names, got {external!r}")
    gpus = data["gpus"]
    if not isinstance(gpus, Mapping):
        raise TableError(f"{source}: gpus must map GPU names to kernels")
    tables = Tables(sources=[source])
    for gpu_key, kernels in gpus.items():
        try:
            gpu = canonical_gpu(gpu_key, uncatalogued)
        except ValueError as e:
            raise TableError(f"{source}: gpus.{gpu_key}: {e}") from None
        if not isinstance(kernels, Mapping):
            raise TableError(f"{source}: gpus.{gpu_key} must map kernel names to entry lists")
        for kernel, entries in kernels.items():
            if specs is not None and kernel not in specs and kernel not in external:
                raise TableError(f"{source}: gpus.{gpu_key}.{kernel}: unknown kernel {kernel!r}; "
                                 f"valid: {', '.join(sorted(specs))}, or a kernel of your own "
                                 f"listed in provenance.{EXTERNAL_FIELD} (as `fusetune "
                                 "export` writes it)")
            if not isinstance(entries, list):
                raise TableError(f"{source}: gpus.{gpu_key}.{kernel} must be a list of entries")
            for i, raw in enumerate(entries):
                entry = RawEntry(source, f"gpus.{gpu_key}.{kernel}[{i}]", str(gpu), raw)
                if specs is None or kernel not in specs:  # checked at its first lookup
                    tables.unchecked.setdefault(str(kernel), []).append(entry)
                    continue
                key, rows, config, info = _checked(entry, specs[kernel])
                tables.groups.setdefault(key, []).append((rows, config))
                tables.info.setdefault((key, rows), info)
    for rows in tables.groups.values():
        rows.sort(key=lambda r: r[0])
    return tables


def read_tables(path: str | Path, specs: Mapping[str, KernelSpec] | None) -> Tables:
    """The table file at `path`, as parse_tables reads it."""
    p = Path(path)
    if not p.is_file():
        raise TableError(f"table file {str(p)!r} does not exist")
    return parse_tables(p.read_text(), str(p), specs)


# ---- runtime state -----------------------------------------------------------------------------

_lock = threading.Lock()
_user: Tables | None = None
_shipped: Tables | None = None
_tuned: Tables | None = None  # the per-user cache of configs tuned at run time (tuned_cache)
# Table files a package ships for its own kernels (fusetune.autotune(tables=...)), read with
# the shipped tables: kernel name -> paths.
_package_tables: dict[str, tuple[str, ...]] = {}
_cache: dict[tuple[Any, ...], Config] = {}
_warned: set[tuple[Any, ...]] = set()
_gpu_names: dict[tuple[str, int], Any] = {}


_generation = 0  # bumped whenever the tables change: the memos of past lookups are stale


def generation() -> int:
    """A number that changes whenever the tables a lookup reads change (loaded, reset, a
    package's added, the per-user cache written): callers that remember lookups (a kernel
    declared with fusetune.autotune) forget them when it moves."""
    return _generation


def _forget_lookups() -> None:
    global _generation
    _cache.clear()
    _generation += 1


def load_tables(*paths: str | Path, specs: Mapping[str, KernelSpec] | None) -> Tables:
    """Uses these table files (read with `specs` as parse_tables does) before the shipped
    tables, replacing earlier ones."""
    global _user
    tables = Tables()
    for p in paths:
        tables.merge(read_tables(p, specs))
    with _lock:
        _user = tables
        _forget_lookups()
        clear_memos()
        _warned.clear()
    return tables


def _shipped_tables() -> Tables:
    global _shipped
    if _shipped is None:
        t = Tables()
        folder = resources.files("fusetune.shipped_tables")
        for f in sorted(folder.iterdir(), key=lambda f: f.name):
            if f.name.endswith(".yaml"):
                t.merge(parse_tables(f.read_text(), f"fusetune/shipped_tables/{f.name}", None))
        for paths in _package_tables.values():
            for p in paths:
                t.merge(read_tables(p, None))
        _shipped = t
    return _shipped


def add_package_tables(kernel: str, paths: tuple[str, ...]) -> None:
    """Reads these table files (a package's own, for its kernel `kernel`) with the shipped
    tables, from the next lookup on (a TableError then, where one is missing or malformed)."""
    global _shipped
    with _lock:
        _package_tables[kernel] = paths
        _shipped = None
        _forget_lookups()


def tuned_cache_path() -> Path:
    """The per-user cache of configs tuned at run time (fusetune.autotune(on_miss="tune"),
    written by fusetune.tuned_cache): $FUSETUNE_CACHE where set (a file), else
    $XDG_CACHE_HOME/fusetune/tuned.yaml (~/.cache/fusetune/tuned.yaml)."""
    if os.environ.get(TUNED_CACHE_ENV):
        return Path(os.environ[TUNED_CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusetune" / "tuned.yaml"


def _tuned_tables() -> Tables:
    """The per-user cache's entries (none where there is no cache yet). A cache the runtime
    cannot read is a TableError naming the file: delete it to start over."""
    global _tuned
    if _tuned is None:
        p = tuned_cache_path()
        _tuned = parse_tables(p.read_text(), str(p), None) if p.is_file() else Tables()
    return _tuned


def forget_tuned() -> None:
    """Reads the per-user cache again at the next lookup (after a process stored in it)."""
    global _tuned
    with _lock:
        _tuned = None
        _forget_lookups()


def _user_tables() -> Tables | None:
    global _user
    if _user is None and os.environ.get(ENV_VAR):
        paths = [p for p in os.environ[ENV_VAR].split(os.pathsep) if p]
        t = Tables()
        for p in paths:
            t.merge(read_tables(p, None))
        _user = t
    return _user


def _tables_in_order() -> Iterator[Tables]:
    """The tables a lookup reads, in the order it reads them: the loaded ones (load_tables,
    FUSETUNE_TABLES), the shipped ones (fusetune's and packages'), then the per-user cache of
    configs tuned at run time. Each is read when the lookup first gets to it: one answered
    by a loaded table reads no shipped file."""
    user = _user_tables()
    if user is not None:
        yield user
    yield _shipped_tables()
    yield _tuned_tables()


def reset() -> None:
    """Forgets loaded tables, cached lookups and warnings (FUSETUNE_TABLES is read again)."""
    global _user, _shipped, _tuned
    with _lock:
        _user, _shipped, _tuned = None, None, None
        _forget_lookups()
        clear_memos()
        _warned.clear()
        _gpu_names.clear()


def gpu_for_device(device: Any = None) -> Any:
    """The catalogue GpuSpec of a torch device (the interpreter's spec for CPU tensors)."""
    from fusetune import gpus

    if device is None:
        import torch

        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if not hasattr(device, "type"):  # "cuda:0", "cpu" or an int
        import torch

        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return gpus.INTERPRETER
    index = device.index
    if index is None:
        import torch

        index = torch.cuda.current_device()
    spec = _gpu_names.get(("cuda", index))
    if spec is None:
        spec = _gpu_names[("cuda", index)] = gpus.current_gpu(index)
    return spec


TunedEntry = tuple[tuple[tuple[str, int], ...], str, int, Config]  # (dims, dtype, rows, config)


def tuned_entries(spec: KernelSpec, gpu: str, weights: str = "",
                  activations: str = "") -> list[TunedEntry]:
    """Every entry the lookup could use for spec's kernel with `weights` and `activations` on
    `gpu` (any dims, dtype and row count): the loaded tables' first, then the shipped ones'. A
    search starts from the nearest of them (fusetune.tuner.seeds)."""
    out: list[TunedEntry] = []
    for tables in _tables_in_order():
        with _lock:
            tables.check(spec)
        for (g, k, dims, dtype, w, a), entries in tables.groups.items():
            if g == gpu and k == spec.name and w == weights and a == activations:
                out += [(dims, dtype, rows, config) for rows, config in entries]
    return out


def _covering(rows: int, entries: list[tuple[int, Config]],
              serves: Callable[[Config], bool], reach: int | None = None
              ) -> tuple[int, Config] | None:
    """The config of the smallest tuned row count >= `rows` among `entries` (sorted by rows)
    whose config `serves` these rows, and, with `reach` (KernelSpec.row_reach), that is fewer
    than reach times `rows`; None outside the tuned range or where none does.

    Upwards, because a config tuned for more rows serves fewer with its tiles partly masked,
    while one tuned for fewer rows reads the weights once per row-block. But not too far up:
    a config tuned for thousands of rows loses to the default heuristic at a few rows (see
    _matmul_spec.MATMUL_ROW_REACH)."""
    if not entries[0][0] <= rows <= entries[-1][0]:
        return None
    return next(((r, config) for r, config in entries
                 if rows <= r and (reach is None or r < reach * rows) and serves(config)),
                None)


def _search_command(spec: KernelSpec, dims: tuple[tuple[str, int], ...], dtype: str,
                    rows: int, weights: str, gpu: GpuSpec, activations: str = "") -> str:
    """The `fusetune search` command that tunes exactly this point on this GPU (the
    interpreter is a backend: the CLI refuses it as a --gpu). The lookup keys on rows, which
    one batch of that many sequences of one token covers."""
    where = (["--backend", "interpreter"] if gpu.name == "interpreter"
             else ["--gpu", gpu.name])
    args = ["fusetune", "search", "--kernel", spec.search_ref, *where,
            "--dims", ",".join(f"{k}={v}" for k, v in dims)]
    if not spec.rows:  # keyed by its arguments: no rows, and its inputs set the other dtypes
        return shlex.join([*args, "--dtype", dtype])
    args += ["--batch", str(max(rows, 1)), "--seq", "1", "--dtype", dtype]
    if weights:
        args += ["--weights", weights]
    if activations:
        args += ["--activations", activations]
    return shlex.join(args)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _caller_stacklevel() -> int:
    """The stacklevel at which a warnings.warn in the function calling this one names the
    application's line: the first frame outside fusetune, torch (whose dispatcher runs between
    fusetune's public functions and their custom ops) and transformers (whose modules call a
    patched model's layers). (Python 3.12's skip_file_prefixes does the same; the package
    supports 3.10.)"""
    skip = [_PACKAGE_DIR]
    # torch's dispatcher, and transformers' modules where fusetune.patch runs a model.
    for name in ("torch", "transformers"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            skip.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
    frame = sys._getframe(1)  # the function that warns: stacklevel 1
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            tuple(skip)):
        frame = frame.f_back
        level += 1
    return level


@dataclass(frozen=True)
class Resolution:
    """Where a point's config comes from: "exact" (a table entry of its rows), "rows" (an entry
    of its dims at another row count that serves these rows), "nearby" (carried over from the
    nearest tuned dims of its GPU, kernel, dtype, weights and activation mode, checked against
    the point's limits) or "default" (the heuristic: nothing tuned answers). `rows` and `dims`
    name the entry used; `speedup` is what it recorded over the default (default µs / tuned µs).
    `marginal`: that entry's winner was not 1% faster than the default, so the
    config is the default heuristic's while the source says the point was tuned ("exact" or
    "rows")."""

    config: Config
    source: str
    rows: int | None = None
    dims: tuple[tuple[str, int], ...] | None = None
    speedup: float | None = None
    marginal: bool = False


# Entries of other dims farther than this (Σ |Δ log2| over the dims and the rows: 16× in one,
# or 4× in two) lend no config: another shape's tiles stop being a guess better than the
# default heuristic's.
NEARBY_DISTANCE = 4.0
# A config lends itself to other dims only where no more than this further share of its tile
# work is masked off there: tiles that divide one width and overhang another (a 2048-wide K
# step over 5120 columns) ran slower than the default heuristic's.
NEARBY_PADDING = 0.05


def _distance(dims: tuple[tuple[str, int], ...], rows: int,
              other: tuple[tuple[str, int], ...], other_rows: int) -> float:
    d = sum(abs(math.log2(1 + a) - math.log2(1 + b))
            for (_, a), (_, b) in zip(dims, other, strict=True))
    return d + abs(math.log2(max(rows, 1)) - math.log2(max(other_rows, 1)))


def _nearby(spec: KernelSpec, group: GroupKey, point: Point, gpu: GpuSpec
            ) -> Resolution | None:
    """The config of the nearest entry of other dims (same GPU, kernel, dtype, weights and
    activation mode) that, made canonical for `point`, its structure serves and `gpu` holds."""
    gpu_name, kernel, dims, dtype, weights, activations = group
    # One row, where it has a structure of its own: a config tuned for more rows (tiles that
    # read the weights once for many rows) runs slower there than the default's one-row
    # structure, which won at every tuned one-row point; and a one-row loop's K steps (BLOCK_K,
    # SPLIT_K, UNROLL_K) are fitted to its own K width, not to another (BENCHMARKS.md, "Shapes
    # no table holds").
    one_row = spec.one_row_structure and point.rows == 1
    same = spec.carry_same + (spec.one_row_same if one_row else ())
    found: list[tuple[float, int, tuple[tuple[str, int], ...], Config, EntryInfo]] = []
    mine = dict(dims)
    for tables in _tables_in_order():
        for key, entries in tables.groups.items():
            if key[:2] != (gpu_name, kernel) or key[3:] != (dtype, weights, activations) \
                    or key[2] == dims or {n for n, _ in key[2]} != mine.keys():
                continue  # (dims of other names: an optional dim off its default on one side)
            if same:
                theirs = dict(key[2])
                if any(theirs[name] != mine[name] for name in same):
                    continue
            for r, config in entries:
                if one_row and r != 1:
                    continue
                info = tables.info.get((key, r), EntryInfo())
                if not _usable(spec, info, config):
                    continue
                d = _distance(dims, point.rows, key[2], r)
                if d <= NEARBY_DISTANCE and not info.marginal:
                    found.append((d, r, key[2], config, info))
    for _, r, other_dims, config, info in sorted(found, key=lambda f: (f[0], -f[1])):
        c = spec.canonical(config, point)
        res = spec.resources(c, point)
        if res.unfit or check_fits(res, gpu) is not None:
            continue
        source = Point.make(kernel, dict(other_dims), 1, r, dtype, weights, activations)
        if spec.structure is not None and spec.structure(c, point) != spec.structure(config,
                                                                                     source):
            continue  # another structure there (a row in two passes, not one): not what won
        if spec.padding is not None and \
                spec.padding(c, point) > spec.padding(config, source) + NEARBY_PADDING:
            continue  # its tiles fit the other dims, not these: more of them masked off
        return Resolution(c, "nearby", r, other_dims, info.speedup)
    return None


def _triton_version() -> str:
    """The installed Triton's version, without importing Triton where it is not loaded yet."""
    module = sys.modules.get("triton")
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return "none"


def other_triton_policy(spec: KernelSpec) -> str:
    """What the lookup does with spec's entries tuned with another Triton version:
    FUSETUNE_OTHER_TRITON where set, else the kernel's own (KernelSpec.other_triton)."""
    policy = os.environ.get(OTHER_TRITON_ENV) or spec.other_triton
    if policy not in OTHER_TRITON_CHOICES:
        raise ValueError(f"{OTHER_TRITON_ENV}={policy!r}: expected one of "
                         f"{', '.join(OTHER_TRITON_CHOICES)}")
    return policy


def _usable(spec: KernelSpec, info: EntryInfo, config: Mapping[str, int]) -> bool:
    """Whether an entry of `config` may be served: one tuned for another version of the
    source its config runs never is (its configs were measured, and checked, on other code):
    the entry's source hash is the kernel's whole source's or, for a config of the kernel's
    own code, that of the sources such a config runs (KernelSpec.config_source_hash). One
    tuned with another Triton version as other_triton_policy says. Each refusal and each
    other version served warns once, naming the kernel and what to run."""
    kernel = spec.name
    if info.source is not None and not spec.runs_source(info.source, config):
        warn_key = ("source", kernel, info.source)
        if warn_key not in _warned:
            _warned.add(warn_key)
            warnings.warn(
                f"fusetune: tables hold entries of {kernel} tuned for another version of its "
                f"source ({info.source}; this one is {spec.config_source_hash(config)}): they "
                "are not served. "
                f"Tune them again, e.g. `fusetune search --kernel {spec.search_ref} --points "
                "TABLE --stale` over the table that held them, and export.",
                FusetuneWarning, stacklevel=_caller_stacklevel())
        return False
    if info.triton is None:
        return True
    installed = _triton_version()
    if info.triton == installed:
        return True
    policy = other_triton_policy(spec)
    if policy == "ignore":
        return True
    warn_key = ("triton", kernel, info.triton)
    if warn_key not in _warned:
        _warned.add(warn_key)
        served = ("served (set FUSETUNE_OTHER_TRITON=refuse to refuse them)" if policy == "warn"
                  else "not served (FUSETUNE_OTHER_TRITON=refuse or the kernel's setting)")
        warnings.warn(
            f"fusetune: entries of {kernel} were tuned with Triton {info.triton}, this is "
            f"Triton {installed}: {served}. Re-tune with `fusetune search --kernel "
            f"{spec.search_ref} --points TABLE` over the table that holds them.",
            FusetuneWarning, stacklevel=_caller_stacklevel())
    return policy == "warn"


def _resolution(spec: KernelSpec, dims: tuple[tuple[str, int], ...], dtype: str, rows: int,
                weights: str, gpu: GpuSpec, activations: str = "", warn: bool = True
                ) -> Resolution:
    kernel = spec.name
    group: GroupKey = (gpu.name, kernel, dims, dtype, weights, activations)
    point = Point(kernel, dims, 1, max(rows, 1), dtype, weights, activations)

    def serves(config: Config) -> bool:
        # A structure tuned at other row counts may not apply at these: the one-row (GEMV)
        # structure of the matmul kernels reads the weights once per row, so it serves one.
        return not spec.resources(config, point).unfit

    default = spec.canonical(spec.default_config(point, gpu), point)
    tuned: list[tuple[int, Config]] = []
    for tables in _tables_in_order():
        tables.check(spec)
        entries = tables.groups.get(group)
        if entries:
            entries = [(r, c) for r, c in entries
                       if _usable(spec, tables.info.get((group, r), EntryInfo()), c)]
        if entries:
            found = _covering(rows, entries, serves, spec.row_reach)
            if found is not None:
                r, config = found
                info = tables.info.get((group, r), EntryInfo())
                # A marginal entry (no better than the default): tuned, and the default runs.
                return Resolution(default if info.marginal else config,
                                  "exact" if r == rows else "rows", r, dims, info.speedup,
                                  info.marginal)
            tuned = tuned or entries
    near = _nearby(spec, group, point, gpu) if spec.rows else None
    if near is not None:
        return near
    if warn and group not in _warned:
        _warned.add(group)
        what = ", ".join(f"{k}={v}" for k, v in dims)
        have = (f"tuned rows {tuned[0][0]}..{tuned[-1][0]}, asked {rows}" if tuned
                else "no tuned entries")
        if tuned and tuned[0][0] <= rows <= tuned[-1][0]:
            have += " (no tuned config there can serve that many rows"
            if spec.row_reach is not None:
                have += f"; an entry tuned for R rows serves more than R/{spec.row_reach}"
            have += ")"
        mode = (f", weights {weights}" if weights else "") + (
            f", {activations} activations" if activations else "")
        command = _search_command(spec, dims, dtype, rows, weights, gpu, activations)
        warnings.warn(
            f"fusetune: no tuned config for {kernel} on {gpu.name} ({what}, {dtype}{mode}; "
            f"{have}): using the default heuristic {default}. Tune it with `{command}` "
            f"and load the exported table with fusetune.load_tables() or {ENV_VAR}.",
            FusetuneWarning, stacklevel=_caller_stacklevel())
    return Resolution(default, "default")


def _resolve(spec: KernelSpec, dims: tuple[tuple[str, int], ...], dtype: str, rows: int,
             weights: str, gpu: GpuSpec, activations: str = "", warn: bool = True) -> Config:
    return _resolution(spec, dims, dtype, rows, weights, gpu, activations, warn).config


def cached_config(spec: KernelSpec, dims: tuple[tuple[str, int], ...], dtype: str, rows: int,
                  weights: str = "", device: Any = None, activations: str = "",
                  warn: bool = True) -> Config:
    """The launchers' fast path: returns the cached (shared, do not modify) config. `warn`:
    warn once where no tuned config covers the point (off for a kernel's inner pass, whose
    caller's own lookup warns)."""
    gpu = gpu_for_device(device)
    key = (spec.name, gpu.name, dims, dtype, rows, weights, activations)
    config = _cache.get(key)
    if config is None:
        with _lock:
            config = _cache[key] = _resolve(spec, dims, dtype, rows, weights, gpu, activations,
                                            warn)
    return config


def _check_dims(spec: KernelSpec, dims: Mapping[str, int]) -> None:
    """ValueError naming the dims that are missing or unknown to spec's kernel, not a
    non-negative integer, or not a value the kernel takes (KernelSpec.choices_problem); the
    launchers pass their tensors' shapes and need no check."""
    names = spec.dim_names
    if not spec.dims_named(dims):
        missing = [k for k in names if k not in dims]
        unknown = [str(k) for k in dims if k not in spec.all_dim_names]
        parts = [f"{what} dim{'s' if len(ks) > 1 else ''} {', '.join(ks)}"
                 for what, ks in (("missing", missing), ("unknown", unknown)) if ks]
        raise ValueError(f"{spec.name}: {', '.join(parts)}; {spec.name}'s dims are "
                         f"{spec.dims_text}")
    problem = _dims_values_problem(spec, dims)
    if problem is not None:
        raise ValueError(f"{spec.name}: {problem}")


def _query(spec: KernelSpec, dims: Mapping[str, int], dtype: str, rows: int, weights: str,
           activations: str) -> tuple[tuple[tuple[str, int], ...], str]:
    """A caller's lookup question checked (ValueError naming the bad value): the dims as the
    tables key them and the activation mode of these weights."""
    if rows < 0:
        raise ValueError(f"rows={rows} must be >= 0")
    if dtype not in spec.dtypes:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(spec.dtypes)}")
    _check_dims(spec, dims)
    return (tuple(sorted(spec.short_dims(dims).items())),
            spec.point_activations(activations, weights))


def resolve(spec: KernelSpec, dims: Mapping[str, int], dtype: str, *, rows: int,
            weights: str = "", activations: str = "", gpu: str | None = None,
            device: Any = None, warn: bool = True) -> Resolution:
    """The config spec's kernel launches with for this GPU and shape, with where it comes from
    (Resolution: exact, rows, nearby or default) and the entry's recorded speedup.

    `gpu` names a catalogue GPU ("h100", "3090", "interpreter"); by default the GPU of
    `device` (or the current CUDA device; the interpreter when there is none).
    """
    dims_t, activations = _query(spec, dims, dtype, rows, weights, activations)
    if gpu is not None:
        from fusetune import gpus

        gpu_spec = gpus.resolve(gpu)
    else:
        gpu_spec = gpu_for_device(device)
    with _lock:
        return _resolution(spec, dims_t, dtype, rows, weights, gpu_spec, activations, warn)


def lookup(spec: KernelSpec, dims: Mapping[str, int], dtype: str, *, rows: int,
           weights: str = "", activations: str = "", gpu: str | None = None,
           device: Any = None) -> Config:
    """The config spec's kernel launches with for this GPU and shape (a copy), with weights
    `weights` and activation mode `activations` (see fusetune.spec.Point).

    `gpu` names a catalogue GPU ("h100", "3090", "interpreter"); by default the GPU of
    `device` (or the current CUDA device; the interpreter when there is none).
    """
    dims_t, activations = _query(spec, dims, dtype, rows, weights, activations)
    if gpu is not None:
        from fusetune import gpus

        gpu_spec = gpus.resolve(gpu)
        key = (spec.name, gpu_spec.name, dims_t, dtype, rows, weights, activations)
        with _lock:
            config = _cache.get(key) or _cache.setdefault(
                key, _resolve(spec, dims_t, dtype, rows, weights, gpu_spec, activations))
        return dict(config)
    return dict(cached_config(spec, dims_t, dtype, rows, weights, device, activations))
