"""Search spaces as data: parsing the YAML, enumerating configs, pruning what cannot fit."""

from __future__ import annotations

import ast
import itertools
import json
import operator
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from fusetune.gpus import GpuSpec
from fusetune.spec import Config, KernelSpec, Point, check_fits


class SpaceError(ValueError):
    """A search-space file that is malformed."""


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "pow2" (sampled as a log2 integer), "values" (categorical) or "range" (integers)
    values: tuple[int, ...]

    @property
    def optuna_name(self) -> str:
        return f"log2_{self.name}" if self.kind == "pow2" else self.name


# A constraint: an expression over a config's keys and the point's dims (as text, see
# `Constraint`), or a function of (config, dims) that returns whether the config may run.
ConstraintFn = Callable[[Mapping[str, int], Mapping[str, int]], bool]


@dataclass(frozen=True)
class Constraint:
    """A condition every config of a space must meet at a point, or it is recorded infeasible
    with the condition as its reason: `text` is an expression over the config's keys and the
    point's dims (integers, + - * // % **, comparisons, and/or/not, min/max/abs), or `fn` a
    function of (config, dims)."""

    text: str
    fn: ConstraintFn | None = None
    tree: ast.Expression | None = None

    def holds(self, config: Mapping[str, int], dims: Mapping[str, int]) -> bool:
        if self.fn is not None:
            return bool(self.fn(config, dims))
        assert self.tree is not None
        return bool(_evaluate(self.tree.body, {**dims, **config}, self.text))


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.Eq: operator.eq, ast.NotEq: operator.ne}
_FUNCTIONS: dict[str, Callable[..., int]] = {"min": min, "max": max, "abs": abs}


def _evaluate(node: ast.AST, names: Mapping[str, int], text: str) -> Any:
    """The value of a constraint's node: the few node kinds _parse_constraint lets through."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise SpaceError(f"constraint {text!r}: {node.id!r} is neither a config key nor a "
                             f"dim; valid: {', '.join(sorted(names))}")
        return names[node.id]
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_evaluate(node.left, names, text),
                                      _evaluate(node.right, names, text))
    if isinstance(node, ast.UnaryOp):
        v = _evaluate(node.operand, names, text)
        return not v if isinstance(node.op, ast.Not) else -v
    if isinstance(node, ast.BoolOp):
        values = (_evaluate(v, names, text) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, names, text)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _evaluate(right_node, names, text)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    return _FUNCTIONS[node.func.id](*(_evaluate(a, names, text) for a in node.args))


def _parse_constraint(text: Any, where: str) -> Constraint:
    """A constraint as a space states it: a function, or an expression checked here (only
    integers, names, arithmetic, comparisons, and/or/not, min/max/abs: nothing else runs)."""
    if callable(text):
        return Constraint(getattr(text, "__name__", repr(text)), fn=text)
    if not isinstance(text, str):
        raise SpaceError(f"{where}: a constraint is an expression (text) or a function of "
                         f"(config, dims), got {text!r}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise SpaceError(f"{where}: constraint {text!r} is not an expression: {e.msg}") from None
    allowed = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.BinOp, ast.UnaryOp,
               ast.BoolOp, ast.Compare, ast.Call, ast.And, ast.Or, ast.Not, ast.USub,
               *_BINARY, *_COMPARE)
    for node in ast.walk(tree):
        bad = not isinstance(node, allowed)
        if isinstance(node, ast.Constant) and (isinstance(node.value, bool)
                                               or not isinstance(node.value, int)):
            bad = True
        if isinstance(node, ast.Call) and (not isinstance(node.func, ast.Name)
                                           or node.func.id not in _FUNCTIONS or node.keywords):
            bad = True
        if bad:
            raise SpaceError(
                f"{where}: constraint {text!r}: {type(node).__name__} is not allowed; a "
                "constraint uses integers, config keys and dims, + - * // % **, comparisons, "
                "and/or/not and min/max/abs")
    return Constraint(text, tree=tree)


@dataclass(frozen=True)
class SearchSpace:
    """A kernel's configs: the product of `params` (each a list of values), or, where `choices`
    is given (a list of configs, as `@triton.autotune` takes), those configs, sampled as one
    categorical parameter `config` (their index). Either way `constraints` hold for every
    config a search runs (those that fail them are recorded infeasible, with the reason)."""

    kernel: str
    params: tuple[Param, ...]
    source: str
    constraints: tuple[Constraint, ...] = ()
    choices: tuple[Config, ...] | None = None

    @property
    def size(self) -> int:
        if self.choices is not None:
            return len(self.choices)
        n = 1
        for p in self.params:
            n *= len(p.values)
        return n

    def configs(self) -> Iterator[Config]:
        if self.choices is not None:
            yield from (dict(c) for c in self.choices)
            return
        names = [p.name for p in self.params]
        for combo in itertools.product(*(p.values for p in self.params)):
            yield dict(zip(names, combo, strict=True))

    def violated(self, config: Mapping[str, int], dims: Mapping[str, int]) -> str | None:
        """The reason a config may not run at a point of `dims` ("constraint: ..."), or None."""
        for c in self.constraints:
            if not c.holds(config, dims):
                return f"constraint: {c.text}"
        return None

    def suggest(self, trial: Any) -> Config:
        """Draws one config from an Optuna trial (powers of two as log2 integers)."""
        if self.choices is not None:
            return dict(self.choices[trial.suggest_categorical(
                CHOICE_PARAM, list(range(len(self.choices))))])
        config: Config = {}
        for p in self.params:
            if p.kind == "pow2":
                lo, hi = p.values[0].bit_length() - 1, p.values[-1].bit_length() - 1
                config[p.name] = 1 << trial.suggest_int(p.optuna_name, lo, hi)
            elif p.kind == "range":
                config[p.name] = trial.suggest_int(p.optuna_name, p.values[0], p.values[-1],
                                                   step=_step(p))
            else:
                config[p.name] = trial.suggest_categorical(p.optuna_name, list(p.values))
        return config

    def to_params(self, config: Mapping[str, int]) -> dict[str, int] | None:
        """The Optuna parameters of `config`, or None if `config` lies outside this space."""
        if self.choices is not None:
            found = [i for i, c in enumerate(self.choices) if c == dict(config)]
            return {CHOICE_PARAM: found[0]} if found else None
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

        if self.choices is not None:  # a list's nearest: fewest keys that differ
            return dict(min(self.choices, key=lambda c: sum(
                c[k] != config.get(k) for k in c)))
        return {p.name: min(p.values, key=lambda c, p=p: (distance(p, c, config[p.name]), c))
                for p in self.params}

    def from_params(self, params: Mapping[str, int]) -> Config:
        """The config of Optuna parameters made by `suggest` or `to_params`."""
        if self.choices is not None:
            return dict(self.choices[params[CHOICE_PARAM]])
        return {p.name: (1 << params[p.optuna_name]) if p.kind == "pow2" else params[p.optuna_name]
                for p in self.params}


CHOICE_PARAM = "config"  # the Optuna parameter of a list space: the config's index


def _step(p: Param) -> int:
    return p.values[1] - p.values[0] if len(p.values) > 1 else 1


def config_key(config: Mapping[str, int]) -> str:
    """A stable text key of a config (sorted JSON)."""
    return json.dumps(dict(sorted(config.items())), separators=(",", ":"))


def _parse_param(name: str, body: Any, where: str, flag: bool = False,
                 zero: bool = False) -> Param:
    if not isinstance(body, Mapping) or len(body) != 1:
        raise SpaceError(f"{where}: parameter {name!r} must be {{pow2: [lo, hi]}}, "
                         f"{{values: [...]}} or {{range: [lo, hi, step]}}, got {body!r}")
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
        # A flag of the kernel (KernelSpec.flags) takes 0 and 1, a `same_as` key 0 too (the
        # value of the key it names), any other key positive values.
        ok = isinstance(arg, list) and arg and all(
            isinstance(v, int) and not isinstance(v, bool)
            and (v in (0, 1) if flag else v >= 0 if zero else v > 0) for v in arg)
        if not ok:
            what = ("0 and/or 1" if flag else "0 or positive integers" if zero
                    else "positive integers")
            raise SpaceError(f"{where}: {name}: values needs a non-empty list of {what}, got "
                             f"{arg!r}")
        return Param(name, "values", tuple(sorted(set(arg))))
    if kind == "range":
        ok = (isinstance(arg, list) and len(arg) in (2, 3)
              and all(isinstance(v, int) and not isinstance(v, bool) for v in arg)
              and (len(arg) == 2 or arg[2] > 0) and arg[0] <= arg[1]
              and (arg[0] >= 0 if flag or zero else arg[0] > 0))
        if not ok:
            low = "0 <= lo" if flag or zero else "0 < lo"
            raise SpaceError(f"{where}: {name}: range needs [lo, hi] or [lo, hi, step], "
                             f"integers with {low} <= hi and step > 0, got {arg!r}")
        step = arg[2] if len(arg) == 3 else 1
        return Param(name, "range", tuple(range(arg[0], arg[1] + 1, step)))
    raise SpaceError(f"{where}: {name}: unknown kind {kind!r}; valid: pow2, values, range")


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
    return parse_space_data(data, spec, source)


def parse_space_data(data: Mapping[str, Any], spec: KernelSpec, source: str) -> SearchSpace:
    """A search space for `spec` from data (a YAML file's document, or the mapping a kernel
    declares): `params` (name -> {pow2: [lo, hi]} | {values: [...]} | {range: [lo, hi,
    step]}) and optional `constraints` (expressions or functions, see `Constraint`), or
    `configs` (a list of configs; `@triton.autotune`'s list) with optional constraints. A
    `kernel` key, where present, must name `spec`'s kernel."""
    if not isinstance(data, Mapping):
        raise SpaceError(f"{source}: a space is a mapping of params (or configs) and "
                         f"constraints, got {type(data).__name__}")
    unknown = [str(k) for k in data if k not in ("kernel", "params", "configs", "constraints")]
    if unknown:
        raise SpaceError(f"{source}: unknown key {', '.join(unknown)}; valid: kernel, params, "
                         "configs, constraints")
    if "kernel" in data and data["kernel"] != spec.name:
        raise SpaceError(f"{source}: kernel is {data['kernel']!r}, expected {spec.name!r}")
    raw_constraints = data.get("constraints") or []
    if isinstance(raw_constraints, str) or callable(raw_constraints) or not isinstance(
            raw_constraints, (list, tuple)):
        raise SpaceError(f"{source}: constraints must be a list, got {raw_constraints!r}")
    constraints = tuple(_parse_constraint(c, source) for c in raw_constraints)
    if ("params" in data) == ("configs" in data):
        raise SpaceError(f"{source}: give either params (a product of values) or configs (a "
                         "list of configs)")
    if "configs" in data:
        return _list_space(data["configs"], spec, source, constraints)
    params_raw = data["params"]
    if not isinstance(params_raw, Mapping):
        raise SpaceError(f"{source}: 'params' must be a mapping of parameter -> range")
    names = list(params_raw)
    # A flag or a same_as key may be left out (spaces written before it existed): it keeps its
    # default value.
    omitted = spec.omitted_values
    left_out = [k for k in spec.config_keys if k not in names]
    if any(n not in spec.config_keys for n in names) or any(k not in omitted
                                                            for k in left_out):
        optional = (f" ({', '.join(omitted)} may be left out: they keep their defaults)"
                    if omitted else "")
        raise SpaceError(f"{source}: params are {', '.join(map(str, names))}; a {spec.name} "
                         f"space has exactly {', '.join(spec.config_keys)}{optional}")
    params_raw = {**{k: {"values": [omitted[k]]} for k in left_out}, **params_raw}
    params = tuple(_parse_param(n, params_raw[n], source, n in spec.flags, n in spec.same_as)
                   for n in spec.config_keys)
    for p in params:
        if p.name in spec.pow2_keys and any(v & (v - 1) for v in p.values):
            raise SpaceError(f"{source}: {p.name} must hold powers of two, got {p.values}")
    return SearchSpace(spec.name, params, source, constraints)


def _list_space(raw: Any, spec: KernelSpec, source: str,
                constraints: tuple[Constraint, ...]) -> SearchSpace:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise SpaceError(f"{source}: configs must be a non-empty list of configs")
    choices: list[Config] = []
    for i, c in enumerate(raw):
        try:
            config = spec.validate_config(c, where=f"{source}: configs[{i}]")
        except ValueError as e:
            raise SpaceError(str(e)) from None
        if config not in choices:  # a config listed twice is one config
            choices.append(config)
    return SearchSpace(spec.name, (), source, constraints, tuple(choices))


def load_space(spec: KernelSpec, path: str | Path | None = None) -> SearchSpace:
    """The kernel's shipped search space (or the one it declares: KernelSpec.space), or the
    user's file at `path`."""
    if path is None and spec.space is not None:
        return parse_space_data(spec.space, spec, f"{spec.search_ref} (its declared space)")
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
        why = space.violated(c, point.dim) or check_fits(spec.resources(c, point), gpu)
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
        if self.space.choices is not None:
            return dict(rng.choice(self.space.choices))
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
            self._pruned[key] = (self.space.violated(config, self.point.dim)
                                 or check_fits(self.spec.resources(config, self.point),
                                               self.gpu))
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
