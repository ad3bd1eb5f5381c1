"""Search spaces as data: parsing the YAML, enumerating configs, pruning what cannot fit."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from fusetune.gpus import GpuSpec
from fusetune.kernels._spec import Config, KernelSpec, Point, check_fits


class SpaceError(ValueError):
    """A search-space file that is malformed."""


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "pow2" (sampled as a log2 integer) or "values" (categorical)
    values: tuple[int, ...]

    @property
    def optuna_name(self) -> str:
        return f"log2_{self.name}" if self.kind == "pow2" else self.name


@dataclass(frozen=True)
class SearchSpace:
    kernel: str
    params: tuple[Param, ...]
    source: str

    @property
    def size(self) -> int:
        n = 1
        for p in self.params:
            n *= len(p.values)
        return n

    def configs(self) -> Iterator[Config]:
        names = [p.name for p in self.params]
        for combo in itertools.product(*(p.values for p in self.params)):
            yield dict(zip(names, combo, strict=True))

    def suggest(self, trial: Any) -> Config:
        """Draws one config from an Optuna trial (powers of two as log2 integers)."""
        config: Config = {}
        for p in self.params:
            if p.kind == "pow2":
                lo, hi = p.values[0].bit_length() - 1, p.values[-1].bit_length() - 1
                config[p.name] = 1 << trial.suggest_int(p.optuna_name, lo, hi)
            else:
                config[p.name] = trial.suggest_categorical(p.optuna_name, list(p.values))
        return config

    def to_params(self, config: Mapping[str, int]) -> dict[str, int] | None:
        """The Optuna parameters of `config`, or None if `config` lies outside this space."""
        params: dict[str, int] = {}
        for p in self.params:
            v = config[p.name]
            if v not in p.values:
                return None
            params[p.optuna_name] = v.bit_length() - 1 if p.kind == "pow2" else v
        return params

    def nearest(self, config: Mapping[str, int]) -> Config:
        """The config of this space nearest to `config`, parameter by parameter (powers of two
        in log2; ties to the smaller value): where a start config outside the space leads."""
        def distance(p: Param, a: int, b: int) -> int:
            if p.kind == "pow2":
                return abs(max(a, 1).bit_length() - max(b, 1).bit_length())
            return abs(a - b)

        return {p.name: min(p.values, key=lambda c, p=p: (distance(p, c, config[p.name]), c))
                for p in self.params}

    def from_params(self, params: Mapping[str, int]) -> Config:
        """The config of Optuna parameters made by `suggest` or `to_params`."""
        return {p.name: (1 << params[p.optuna_name]) if p.kind == "pow2" else params[p.optuna_name]
                for p in self.params}


def config_key(config: Mapping[str, int]) -> str:
    """A stable text key of a config (sorted JSON)."""
    return json.dumps(dict(sorted(config.items())), separators=(",", ":"))


def _parse_param(name: str, body: Any, where: str, flag: bool = False) -> Param:
    if not isinstance(body, Mapping) or len(body) != 1:
        raise SpaceError(f"{where}: parameter {name!r} must be {{pow2: [lo, hi]}} or "
                         f"{{values: [...]}}, got {body!r}")
    ((kind, arg),) = body.items()
    if kind == "pow2":
        ok = isinstance(arg, list) and len(arg) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0
            for v in arg) and arg[0] <= arg[1]
        if not ok:
            raise SpaceError(f"{where}: {name}: pow2 needs [lo, hi], powers of two with lo <= hi,"
                             f" got {arg!r}")
        lo, hi = arg[0].bit_length() - 1, arg[1].bit_length() - 1
        return Param(name, "pow2", tuple(1 << e for e in range(lo, hi + 1)))
    if kind == "values":
        # A flag of the kernel (KernelSpec.flags) takes 0 and 1, any other key positive values.
        ok = isinstance(arg, list) and arg and all(
            isinstance(v, int) and not isinstance(v, bool) and (v in (0, 1) if flag else v > 0)
            for v in arg)
        if not ok:
            what = "0 and/or 1" if flag else "positive integers"
            raise SpaceError(f"{where}: {name}: values needs a non-empty list of {what}, got "
                             f"{arg!r}")
        return Param(name, "values", tuple(sorted(set(arg))))
    raise SpaceError(f"{where}: {name}: unknown kind {kind!r}; valid: pow2, values")


def parse_space(text: str, spec: KernelSpec, source: str) -> SearchSpace:
    """Parses and validates a search space for `spec` (the YAML text of `source`)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpaceError(f"{source}: not valid YAML: {e}") from e
    if not isinstance(data, Mapping) or "params" not in data:
        raise SpaceError(f"{source}: expected a mapping with 'kernel' and 'params'")
    if data.get("kernel") != spec.name:
        raise SpaceError(f"{source}: kernel is {data.get('kernel')!r}, expected {spec.name!r}")
    params_raw = data["params"]
    if not isinstance(params_raw, Mapping):
        raise SpaceError(f"{source}: 'params' must be a mapping of parameter -> range")
    names = list(params_raw)
    # A flag may be left out (spaces written before it existed): it keeps its default value.
    left_out = [k for k in spec.config_keys if k not in names]
    if any(n not in spec.config_keys for n in names) or any(k not in spec.flags
                                                            for k in left_out):
        optional = (f" (the flags {', '.join(spec.flags)} may be left out: they keep their "
                    "defaults)" if spec.flags else "")
        raise SpaceError(f"{source}: params are {', '.join(map(str, names))}; a {spec.name} "
                         f"space has exactly {', '.join(spec.config_keys)}{optional}")
    params_raw = {**{k: {"values": [spec.flags[k]]} for k in left_out}, **params_raw}
    params = tuple(_parse_param(n, params_raw[n], source, n in spec.flags)
                   for n in spec.config_keys)
    for p in params:
        if p.name in spec.pow2_keys and any(v & (v - 1) for v in p.values):
            raise SpaceError(f"{source}: {p.name} must hold powers of two, got {p.values}")
    return SearchSpace(spec.name, params, source)


def load_space(spec: KernelSpec, path: str | Path | None = None) -> SearchSpace:
    """The kernel's shipped search space, or the user's file at `path`."""
    if path is None:
        res = resources.files("fusetune.search_spaces").joinpath(f"{spec.name}.yaml")
        return parse_space(res.read_text(), spec, f"search_spaces/{spec.name}.yaml")
    p = Path(path)
    if not p.is_file():
        raise SpaceError(f"search space file {str(p)!r} does not exist")
    return parse_space(p.read_text(), spec, str(p))


ENUMERATE_LIMIT = 50_000  # raw configs a search plan enumerates; larger spaces are sampled
PLAN_SAMPLE = 1000  # raw configs a sampled plan draws up front (more when trials ask for it)


@dataclass
class Plan:
    """Every config of one point's space: distinct feasible configs and what was pruned, why.

    Enumerating prices each raw config of the space (its canonical form and predicted
    resources); the exhaustive grid needs that, a search of a space of millions does not:
    `search_plan` gives it a `SampledPlan` with the same methods.
    """

    point: Point
    raw_size: int
    feasible: list[Config]
    infeasible: dict[str, str] = field(default_factory=dict)  # config_key -> reason
    pruned_reasons: Counter[str] = field(default_factory=Counter)
    # config_key -> the first config of the space that collapses onto it: how a sampler reaches
    # a canonical config that lies outside the space itself.
    representative: dict[str, Config] = field(default_factory=dict)
    _feasible_keys: set[str] | None = field(default=None, repr=False)

    @property
    def distinct(self) -> int:
        return len(self.feasible) + len(self.infeasible)

    def pruned(self, key: str) -> str | None:
        """Why the config of `key` is pruned, or None."""
        return self.infeasible.get(key)

    def raw_of(self, key: str) -> Config | None:
        """A config of the space that collapses onto the config of `key` (None: none does)."""
        return self.representative.get(key)

    def is_feasible(self, key: str) -> bool:
        """Whether the config of `key` is one of the space's configs that the GPU can hold."""
        if self._feasible_keys is None:
            self._feasible_keys = {config_key(c) for c in self.feasible}
        return key in self._feasible_keys

    def target(self, trials: int) -> int:
        """Distinct feasible configs a search with `trials` evaluates: the space's if fewer."""
        return min(trials, len(self.feasible))

    def untried(self, rng: random.Random, skip: Callable[[str], bool]) -> Config | None:
        """A feasible config chosen at random among those whose key `skip` does not refuse."""
        todo = [c for c in self.feasible if not skip(config_key(c))]
        return rng.choice(todo) if todo else None


def _limit_label(reason: str, gpu: GpuSpec) -> str:
    kind = reason.split(":", 1)[0]
    return {
        "threads": f"threads>{gpu.max_threads_per_block}",
        "shared-memory": f"smem>{gpu.smem_per_block}B",
        "registers": f"regs>{gpu.regs_per_thread}/thread",
    }.get(kind, kind)


def make_plan(space: SearchSpace, spec: KernelSpec, point: Point, gpu: GpuSpec) -> Plan:
    """Enumerates the space for `point`, collapses equivalent configs, prunes by `gpu`'s limits."""
    plan = Plan(point, space.size, [])
    seen: set[tuple[tuple[str, int], ...]] = set()  # cheaper to build than a config_key
    for raw in space.configs():
        c = spec.canonical(raw, point)
        items = tuple(sorted(c.items()))
        if items in seen:
            continue
        seen.add(items)
        key = config_key(c)
        plan.representative[key] = raw
        why = check_fits(spec.resources(c, point), gpu)
        if why is None:
            plan.feasible.append(c)
        else:
            plan.infeasible[key] = why
            plan.pruned_reasons[_limit_label(why, gpu)] += 1
    return plan


class SampledPlan:
    """The plan of a point whose space is too large to enumerate (`Plan`'s methods): configs are
    priced when the search meets them, and a random sample of the space, drawn up front,
    estimates what the GPU's limits prune and shows that the space holds enough distinct
    feasible configs for the trials asked (else the space is enumerated after all)."""

    def __init__(self, space: SearchSpace, spec: KernelSpec, point: Point, gpu: GpuSpec,
                 sample: int = PLAN_SAMPLE, seed: int = 0) -> None:
        self.space, self.spec, self.point, self.gpu = space, spec, point, gpu
        self.raw_size = space.size
        self._rng = random.Random(seed)
        self._pruned: dict[str, str | None] = {}  # config_key -> why pruned (None: fits)
        self._raw: dict[str, Config | None] = {}  # config_key -> a raw config reaching it
        self.drawn = 0  # raw configs drawn for the estimate
        self.draw_reasons: Counter[str] = Counter()  # of those, pruned by limit (label)
        self.sampled_feasible: dict[str, Config] = {}  # distinct feasible configs drawn
        self._full: Plan | None = None
        self._draw(sample)

    def _random_raw(self, rng: random.Random) -> Config:
        return {p.name: rng.choice(p.values) for p in self.space.params}

    def _draw(self, n: int) -> None:
        for _ in range(n):
            raw = self._random_raw(self._rng)
            c = self.spec.canonical(raw, self.point)
            key = config_key(c)
            self._raw.setdefault(key, raw)
            why = self.pruned(key)
            self.drawn += 1
            if why is None:
                self.sampled_feasible.setdefault(key, c)
            else:
                self.draw_reasons[_limit_label(why, self.gpu)] += 1

    def pruned(self, key: str) -> str | None:
        if self._full is not None:
            return self._full.pruned(key)
        if key not in self._pruned:
            config = json.loads(key)
            self._pruned[key] = check_fits(self.spec.resources(config, self.point), self.gpu)
        return self._pruned[key]

    def raw_of(self, key: str) -> Config | None:
        if self._full is not None:
            return self._full.raw_of(key)
        if key not in self._raw:
            config = json.loads(key)
            raw: Config | None = None
            try:
                # The config itself when the space holds it, else the space's nearest config
                # where that collapses onto it.
                for guess in (config, self.space.nearest(config)):
                    if (self.space.to_params(guess) is not None
                            and config_key(self.spec.canonical(guess, self.point)) == key):
                        raw = guess
                        break
            except KeyError:  # a config of other keys than the space's
                raw = None
            self._raw[key] = raw
        return self._raw[key]

    def is_feasible(self, key: str) -> bool:
        return self.raw_of(key) is not None and self.pruned(key) is None

    def target(self, trials: int) -> int:
        """`trials`, where the sample shows the space holds that many feasible configs (after
        more draws, a few per config wanted). Else, for a space small enough to enumerate, the
        exact count; for a larger one, the count the draws met: a GPU that prunes all but a
        sliver of millions of configs leaves the search those (and its start configs, the
        default first) rather than minutes of pricing every config."""
        if self._full is None and len(self.sampled_feasible) < trials:
            self._draw(max(0, min(50 * trials, self.raw_size) - self.drawn))
            if len(self.sampled_feasible) < trials:
                if self.raw_size > ENUMERATE_LIMIT:
                    return len(self.sampled_feasible)
                self._full = make_plan(self.space, self.spec, self.point, self.gpu)
        if self._full is not None:
            return self._full.target(trials)
        return trials

    def untried(self, rng: random.Random, skip: Callable[[str], bool]) -> Config | None:
        if self._full is not None:
            return self._full.untried(rng, skip)
        for _ in range(20 * PLAN_SAMPLE):
            c = self.spec.canonical(self._random_raw(rng), self.point)
            key = config_key(c)
            if self.pruned(key) is None and not skip(key):
                return c
        return None


PointPlan = Plan | SampledPlan  # what the search, the sampler and the seeds use


def search_plan(space: SearchSpace, spec: KernelSpec, point: Point, gpu: GpuSpec) -> PointPlan:
    """The plan a search of `point` works from: enumerated for spaces of up to ENUMERATE_LIMIT
    raw configs, sampled for larger ones."""
    if space.size <= ENUMERATE_LIMIT:
        return make_plan(space, spec, point, gpu)
    return SampledPlan(space, spec, point, gpu)
