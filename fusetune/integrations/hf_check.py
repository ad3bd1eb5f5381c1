"""The patched model checks itself: `self_check` runs before `fusetune.patch` returns.

What a patched forward must agree with moves between transformers releases (5.24 renamed the
KV cache's keyword, and a forward that read the old name stopped updating the cache, with no
error): so the patch compares itself with the model's own forwards on the installed release.

For one decoder layer of each kind (layer class, MLP class, attention type, sliding window: a
mixture-of-experts model's dense layers are a kind of their own) it takes the call that the
model's own base forward makes (captured with a forward pre-hook, so the mask, the position
embeddings and the cache come as this release builds them) for two prompts of a few tokens, the
second left-padded, then for one cached decode step, and runs the layer through its own
forwards and through the patched ones, each with its own copy of the cache (a sparse layer's
router and experts included). Then the final norm. The error is measured against what the
layer changes (its output minus its input), since the residual stream would otherwise hide a
wrong attention or MLP; a difference above TOLERANCE for the dtype (or a non-finite value where
the model's own is finite) raises SelfCheckError naming the layer, the step and the
transformers version.

A sparse layer's patched run takes its router's output from the model's own run (`_Routing`):
where a token's k-th and (k+1)-th expert scores are within 16-bit rounding of each other, two
correct forwards may route it differently, and one token sent to another expert changes the
output by far more than any rounding tolerance. What follows the router (the norm before it,
how its output is read, the experts, Qwen2-MoE's gated shared expert beside them) is then
checked on the same routing.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

PROMPT_TOKENS = 5
# relative to the layer's change; the fused ops round once where torch rounds after each op,
# so 16-bit dtypes differ by a few units of their precision, and a wrong cache, mask or
# position by a large fraction of the change
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


class SelfCheckError(RuntimeError):
    """The patched forwards disagree with the model's own on the installed transformers."""


class _Captured(Exception):
    pass


def self_check(base: nn.Module, patched: list[Any], family: str, cache_name: str) -> None:
    """Compares the patched forwards (`patched`: the bound methods set on the modules) with the
    modules' own forwards; raises SelfCheckError on a mismatch. Changes nothing: the modules'
    training flags are restored and every cache used is the check's own."""
    import transformers

    modules = {id(fwd.__self__): fwd.__self__ for fwd in patched}
    training = {m: m.training for m in base.modules()}
    where = f"transformers {transformers.__version__}, {family}"
    try:
        base.eval()  # dropout off in both paths; restored below
        with torch.no_grad():
            for i in layer_kinds(base):
                _check_layer(base, i, modules, cache_name, where)
    finally:
        for m, flag in training.items():
            m.training = flag


def layer_kinds(base: nn.Module) -> list[int]:
    """The index of the first decoder layer of each kind: its class, its MLP's class (Qwen3-MoE:
    sparse or dense), the attention type the config names for it (`layer_types`), and the
    attention module's sliding window."""
    types = getattr(base.config, "layer_types", None) or []
    first: dict[tuple[Any, ...], int] = {}
    for i, layer in enumerate(base.layers):
        kind = (type(layer), type(getattr(layer, "mlp", None)),
                types[i] if i < len(types) else None,
                getattr(layer.self_attn, "sliding_window", None))
        first.setdefault(kind, i)
    return sorted(first.values())


def _check_layer(base: nn.Module, index: int, modules: dict[int, nn.Module], cache_name: str,
                 where: str) -> None:
    layer = base.layers[index]
    own = [m for m in (layer, layer.self_attn) if id(m) in modules]
    config = base.config
    device = base.get_input_embeddings().weight.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, PROMPT_TOKENS), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second prompt left-padded, as generate() batches them

    args, kwargs = _capture(base, layer, input_ids=ids, attention_mask=mask, use_cache=True)
    cache = _find_cache(kwargs, cache_name, where)
    mine = copy.deepcopy(cache)
    name = f"layer {index} ({type(layer).__name__})"
    routing = _Routing(layer)
    with _own_forwards(own), routing.recording():
        want = _hidden(layer(*args, **_with_cache(kwargs, cache_name, cache)))
    what = f"{name}, {PROMPT_TOKENS} prompt tokens"
    with routing.replaying():
        got = _patched(what, where, lambda: layer(*args, **_with_cache(kwargs, cache_name, mine)))
    _compare(what, got, want, args, kwargs, where)

    norm = base.norm
    if id(norm) in modules:
        with _own_forwards([norm]):
            norm_want = norm(want)
        got = _patched("the final norm", where, lambda: norm(want))
        _compare("the final norm", got, norm_want, (), {}, where, relative_to_input=False)

    step = torch.randint(0, config.vocab_size, (2, 1), generator=g).to(device)
    mask = torch.cat([mask, torch.ones_like(step)], dim=1)
    args, kwargs = _capture(base, layer, input_ids=step, attention_mask=mask, use_cache=True,
                            **{cache_name: cache})
    with _own_forwards(own), routing.recording():
        want = _hidden(layer(*args, **_with_cache(kwargs, cache_name, cache)))
    what = f"{name}, a cached decode step after {PROMPT_TOKENS} tokens"
    with routing.replaying():
        got = _patched(what, where, lambda: layer(*args, **_with_cache(kwargs, cache_name, mine)))
    _compare(what, got, want, args, kwargs, where)


class _Routing:
    """A sparse layer's router (`layer.mlp.gate`, beside `layer.mlp.experts`): its outputs are
    kept while `recording()`, and its calls return them again, in order, while `replaying()`
    (see the module docstring). Both do nothing for a dense layer."""

    def __init__(self, layer: nn.Module) -> None:
        mlp = getattr(layer, "mlp", None)
        router = getattr(mlp, "gate", None) if hasattr(mlp, "experts") else None
        self.router = router if isinstance(router, nn.Module) else None
        self.kept: list[Any] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.kept = []

        def keep(module: nn.Module, args: tuple, out: Any) -> None:
            self.kept.append(out)

        with self._hooked(keep):
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        def give_back(module: nn.Module, args: tuple, out: Any) -> Any:
            return self.kept.pop(0) if self.kept else None

        with self._hooked(give_back):
            yield

    @contextlib.contextmanager
    def _hooked(self, hook: Callable[..., Any]) -> Iterator[None]:
        handle = None if self.router is None else self.router.register_forward_hook(hook)
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()


def _capture(base: nn.Module, layer: nn.Module, **inputs: Any) -> tuple[tuple, dict[str, Any]]:
    """The arguments the base model's own forward calls `layer` with for `inputs`; the forward
    stops there (a pre-hook raises), so the layers after it do not run."""
    calls: list[tuple[tuple, dict[str, Any]]] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        calls.append((args, dict(kwargs)))
        raise _Captured

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        base(**inputs)
    except _Captured:
        pass
    finally:
        handle.remove()
    assert calls, "the base model's forward did not call the layer"
    return calls[0]


def _find_cache(kwargs: dict[str, Any], name: str, where: str) -> Any:
    cache = kwargs.get(name)
    if cache is None:
        raise SelfCheckError(
            f"fusetune.patch self-check ({where}): the model called its decoder layers without "
            f"a KV cache under `{name}` (keywords: {', '.join(sorted(kwargs))}); the patched "
            "forwards cannot be checked against this release; the model is left unpatched")
    return cache


def _with_cache(kwargs: dict[str, Any], name: str, cache: Any) -> dict[str, Any]:
    return {**kwargs, name: cache}


def _patched(what: str, where: str, call: Callable[[], Any]) -> torch.Tensor:
    """The patched forward's output; an error it raises becomes a SelfCheckError."""
    try:
        return _hidden(call())
    except Exception as e:
        raise SelfCheckError(
            f"fusetune.patch self-check failed ({where}): {what}: the patched forward raised "
            f"{type(e).__name__}: {e}. The model is left unpatched") from e


def _hidden(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@contextlib.contextmanager
def _own_forwards(modules: list[nn.Module]) -> Iterator[None]:
    """The modules' class forwards while inside (the patched instance forwards put back after)."""
    saved = [(m, m.__dict__.pop("forward")) for m in modules if "forward" in m.__dict__]
    try:
        yield
    finally:
        for m, fwd in saved:
            m.forward = fwd


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, args: tuple,
             kwargs: dict[str, Any], where: str, relative_to_input: bool = True) -> None:
    tol = TOLERANCE[want.dtype]
    x = args[0] if args else kwargs.get("hidden_states")
    ref = want.double() - x.double() if relative_to_input and x is not None else want.double()
    finite = bool(torch.isfinite(got).all())
    err = ((got.double() - want.double()).norm() / ref.norm().clamp_min(1e-30)).item()
    if finite and err <= tol:
        return
    measure = "relative to the layer's change" if relative_to_input else "relative"
    detail = (f"differs by {err:.3g} ({measure}; tolerance {tol:g} for {want.dtype})"
              if finite else "has non-finite values where the model's own output is finite")
    raise SelfCheckError(
        f"fusetune.patch self-check failed ({where}): {what}: the patched output {detail}. "
        "The model is left unpatched. This transformers release may have changed what the "
        "layers' forwards do; fusetune.patch(model, verify=False) skips the check at your own "
        "risk")
