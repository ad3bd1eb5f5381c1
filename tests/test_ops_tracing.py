"""fusetune's public functions under torch.compile (Triton interpreter on CPU): each one is its
custom op in the graph (no graph break), gives what the eager call gives, and the
differentiable ones (rmsnorm, rope, swiglu) give eager's gradients, through their backward
kernels' ops. Called eagerly, none of them goes through the custom-op dispatcher."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import fusetune
from fusetune import api, ops
from fusetune.kernels import ffn as ffn_mod
from fusetune.kernels import linear as linear_mod
from fusetune.kernels import lola as lola_mod
from fusetune.kernels import moe as moe_mod
from fusetune.kernels import qkv as qkv_mod
from fusetune.kernels import rmsnorm as rmsnorm_mod
from fusetune.kernels import rmsnorm_bwd as rmsnorm_bwd_mod
from fusetune.kernels import rope as rope_mod
from fusetune.kernels import swiglu as swiglu_mod
from fusetune.kernels._rotary import rotary_tables
from fusetune.spec import ConfigError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
HEAD_DIM = 16
DTYPES = [torch.float32, torch.float16]
LAUNCHERS: dict[str, Callable[..., Any]] = {
    "rmsnorm": rmsnorm_mod.rmsnorm, "rmsnorm_bwd": rmsnorm_bwd_mod.rmsnorm_bwd,
    "rope": rope_mod.rope, "qkv": qkv_mod.qkv, "ffn": ffn_mod.ffn, "swiglu": swiglu_mod.swiglu,
    "linear": linear_mod.linear, "lola": lola_mod.lola, "moe": moe_mod.moe,
}
RMSNORM_CFG = {"BLOCK_D": 32, "ROWS": 2, "num_warps": 4, "num_stages": 1}


@pytest.fixture(autouse=True)
def _fresh(fresh_tables: None) -> Iterator[None]:
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)
    torch._dynamo.reset()  # no compiled code, guards or recompile counts from another test
    yield
    torch._dynamo.reset()


def rand(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + sum(shape))
    return (scale * torch.randn(*shape, generator=gen)).to(device=DEVICE, dtype=dtype)


def tables(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(seq, device=DEVICE)[None] + 3
    return rotary_tables(positions, HEAD_DIM, theta=10000.0)


def case(name: str, dtype: torch.dtype) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
    """A function that calls fusetune's `name` (with a torch op after it, as a model does) and
    its tiny inputs."""
    x, g, dy = rand(2, 3, 64, dtype=dtype), rand(64, dtype=dtype, seed=1), rand(2, 3, 64,
                                                                                 dtype=dtype)
    cos, sin = tables(3)
    if name == "rmsnorm":
        return (lambda x, w: fusetune.rmsnorm(x, w, eps=EPS) * 2), (x, g)
    if name == "rmsnorm_bwd":
        return (lambda x, w, dy: fusetune.rmsnorm_bwd(x, w, dy, eps=EPS)), (x, g, dy)
    if name == "rope":
        return ((lambda x, c, s: fusetune.rope(x, c, s, interleaved=True) + 1),
                (rand(2, 3, 4, HEAD_DIM, dtype=dtype), cos, sin))
    if name == "qkv":
        ws = tuple(rand(n, 64, dtype=dtype, scale=0.125, seed=2) for n in (64, 32, 32))

        def call_qkv(x: torch.Tensor, g: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                     wv: torch.Tensor, c: torch.Tensor, s: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
            q, k, v = fusetune.qkv(x, g, wq, wk, wv, c, s, eps=EPS, head_dim=HEAD_DIM,
                                   interleaved=False, bk=g[:32])
            return q.transpose(1, 2), k, v

        return call_qkv, (x, g, *ws, cos, sin)
    if name == "ffn":
        w1, w3 = (rand(96, 64, dtype=dtype, scale=0.125, seed=s) for s in (3, 4))
        return (lambda x, g, w1, w3: fusetune.ffn(x, g, w1, w3, eps=EPS).sum(-1)), (x, g, w1, w3)
    if name == "swiglu":
        ab = rand(2, 3, 192, dtype=dtype)  # two halves of one row, as a fused gate/up output
        return (lambda ab: fusetune.swiglu(ab[..., :96], ab[..., 96:]) * 2), (ab,)
    if name == "linear":
        w, b = rand(48, 64, dtype=dtype, scale=0.125), rand(48, dtype=dtype)
        r = rand(2, 3, 48, dtype=dtype)
        return (lambda x, w, b, r: fusetune.linear(x, w, bias=b, residual=r) - r), (x, w, b, r)
    if name == "lola":
        w, b = rand(40, 64, dtype=dtype, scale=0.125), rand(40, dtype=dtype)
        return (lambda x, w, b: fusetune.lola(x, w, b, eps=1e-5) + 1), (x, w, b)
    if name == "moe":
        return (lambda x, *rest: fusetune.moe(x, *rest) + x), (x.view(6, 64), *moe_args(dtype))
    raise AssertionError(name)


def moe_args(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Four experts of hidden 32 for 6 tokens: gate_up, down, topk_ids, topk_weights (top 2)."""
    gate_up = rand(4, 64, 64, dtype=dtype, scale=0.125, seed=5)
    down = rand(4, 64, 32, dtype=dtype, scale=0.125, seed=6)
    ids = torch.tensor([[0, 1], [2, 0], [3, 1], [1, 2], [0, 3], [2, 3]], device=DEVICE)
    weights = torch.softmax(rand(6, 2, dtype=torch.float32, seed=8), dim=-1)
    return gate_up, down, ids, weights


def outputs(out: Any) -> tuple[torch.Tensor | None, ...]:
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_no_graph_break_and_eager_results(name: str, dtype: torch.dtype) -> None:
    fn, args = case(name, dtype)
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert len(explained.graphs) == 1
    assert f"torch.ops.fusetune.{name}.default(" in explained.graphs[0].code
    want = outputs(fn(*args))
    got = outputs(torch.compile(fn, fullgraph=True, backend="eager")(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride()
        assert torch.equal(g, w)  # the same kernel with the same config


def test_rmsnorm_bwd_gradient_not_asked_for_is_none() -> None:
    x, w, dy = (rand(*shape, dtype=torch.float32) for shape in ((5, 64), (64,), (5, 64)))

    def fn(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[Any, ...]:
        return (fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, grad_weight=False),
                fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, grad_x=False, grad_weight=False))

    (dx, dw), nothing = torch.compile(fn, fullgraph=True, backend="eager")(x, w, dy)
    assert dw is None and nothing == (None, None)
    assert torch.equal(dx, fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, grad_weight=False)[0])


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_signatures_are_the_launchers(name: str) -> None:
    def params(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    public = getattr(fusetune, name)
    assert public is getattr(api, name)
    assert params(public) == params(LAUNCHERS[name])
    assert public.__doc__.startswith(LAUNCHERS[name].__doc__.rstrip())


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_eager_calls_do_not_dispatch_to_the_op(name: str, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an eager call went through the custom op")

    for attr in dir(ops):
        if attr.startswith("_") and attr.endswith("_op"):
            monkeypatch.setattr(ops, attr, refuse)
    fn, args = case(name, torch.float32)
    fn(*args)


# ---- gradients under compile ------------------------------------------------------------------


class Graphs:
    """An AOTAutograd backend (what torch.compile's default backend traces before Inductor)
    that runs the traced graphs as they are and keeps their code."""

    def __init__(self) -> None:
        self.forward: list[str] = []
        self.backward: list[str] = []

        def keep(into: list[str]) -> Callable[..., Any]:
            def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
                into.append(gm.code)
                return make_boxed_func(gm.forward)
            return compiler

        self.backend = aot_autograd(fw_compiler=keep(self.forward),
                                    bw_compiler=keep(self.backward))


def grads(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], dy: torch.Tensor
          ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    leaves = [a.detach().requires_grad_(a.requires_grad) for a in args]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


DIFFERENTIABLE = ["rmsnorm", "rope", "swiglu"]


def grad_case(name: str, dtype: torch.dtype, which: tuple[bool, ...]
              ) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...], torch.Tensor]:
    """A differentiable function of fusetune's `name`, its inputs (requiring grad as `which`
    says) and the output's gradient."""
    if name == "rmsnorm":
        args = (rand(2, 3, 64, dtype=dtype), rand(64, dtype=dtype, seed=1))

        def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return fusetune.rmsnorm(x * 1.5, w, eps=EPS)
    elif name == "rope":
        cos, sin = tables(3)
        args = (rand(2, 4, 3, HEAD_DIM, dtype=dtype), cos, sin)  # [batch, heads, seq, ...]

        def fn(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return fusetune.rope(x.transpose(1, 2), c, s, interleaved=False)  # strided x
    else:
        args = (rand(2, 3, 96, dtype=dtype), rand(2, 3, 96, dtype=dtype, seed=1))

        def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return fusetune.swiglu(a, b * 0.5)
    which = which + (False,) * (len(args) - len(which))
    args = tuple(a.requires_grad_(w) for a, w in zip(args, which, strict=True))
    dy = rand(*fn(*(a.detach() for a in args)).shape, dtype=dtype, seed=7)
    return fn, args, dy


GRAD_CASES = [("rmsnorm", (True, True)), ("rmsnorm", (True, False)), ("rmsnorm", (False, True)),
              ("rope", (True,)), ("swiglu", (True, True)), ("swiglu", (False, True))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "which"), GRAD_CASES)
def test_compiled_gradients_are_eagers(name: str, which: tuple[bool, ...], dtype: torch.dtype
                                       ) -> None:
    fn, args, dy = grad_case(name, dtype, which)
    want_y, want = grads(fn, args, dy)
    graphs = Graphs()
    got_y, got = grads(torch.compile(fn, fullgraph=True, backend=graphs.backend), args, dy)
    assert torch.equal(got_y, want_y)
    asked_for = which + (False,) * (len(args) - len(which))
    for g, w, asked in zip(got, want, asked_for, strict=True):
        assert (g is None) == (w is None) == (not asked)
        if asked:
            assert torch.equal(g, w)  # the same backward kernel
    assert len(graphs.forward) == len(graphs.backward) == 1
    assert f"torch.ops.fusetune.{name}.default(" in graphs.forward[0]
    assert f"torch.ops.fusetune.{name}_bwd.default(" in graphs.backward[0]


def test_compiled_training_step_with_aot_eager() -> None:
    # rmsnorm -> rope -> swiglu in one graph, through torch's own aot_eager backend.
    x = rand(2, 3, 64, dtype=torch.float32).requires_grad_()
    w = rand(64, dtype=torch.float32, seed=1).requires_grad_()
    cos, sin = tables(3)

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = fusetune.rmsnorm(x, w, eps=EPS)
        r = fusetune.rope(h.view(2, 3, 4, HEAD_DIM), cos, sin, interleaved=True).view(2, 3, 64)
        return fusetune.swiglu(r, h).square().sum()

    want = torch.autograd.grad(step(x, w), (x, w))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x, w), (x, w))
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


# ---- arguments that cross the op, and errors --------------------------------------------------


def test_config_crosses_the_op() -> None:
    x, w = rand(5, 64, dtype=torch.float32), rand(64, dtype=torch.float32, seed=1)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fusetune.rmsnorm(x, w, eps=EPS, config=RMSNORM_CFG)

    explained = torch._dynamo.explain(fn)(x, w)
    assert explained.graph_break_count == 0
    assert "'BLOCK_D=32,ROWS=2,num_warps=4,num_stages=1'" in explained.graphs[0].code
    got = torch.compile(fn, fullgraph=True, backend="eager")(x, w)
    assert torch.equal(got, fusetune.rmsnorm(x, w, eps=EPS, config=RMSNORM_CFG))


def test_config_reaches_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    launcher = rmsnorm_mod.rmsnorm

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs["config"])
        return launcher(*args, **kwargs)

    monkeypatch.setattr(rmsnorm_mod, "rmsnorm", spy)
    x, w = rand(5, 64, dtype=torch.float32), rand(64, dtype=torch.float32, seed=1)
    torch.compile(lambda x, w: fusetune.rmsnorm(x, w, eps=EPS, config=RMSNORM_CFG),
                  fullgraph=True, backend="eager")(x, w)
    torch.compile(lambda x, w: fusetune.rmsnorm(x, w, eps=EPS), fullgraph=True,
                  backend="eager")(x, w)
    assert seen == [RMSNORM_CFG, None]


def test_bad_config_fails_at_compile_naming_the_key() -> None:
    x, w = rand(5, 64, dtype=torch.float32), rand(64, dtype=torch.float32, seed=1)
    compiled = torch.compile(lambda x, w: fusetune.rmsnorm(
        x, w, eps=EPS, config={**RMSNORM_CFG, "ROWS": 3}), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="ROWS=3 must be a power of two") as info:
        compiled(x, w)
    assert isinstance(info.value, (ConfigError, torch._dynamo.exc.Unsupported))


def test_config_as_op_argument_round_trip() -> None:
    # Validated first, so the flags that a config may leave out are there, at their defaults.
    config = {"BLOCK_D": 64, "ROWS": 1, "PROGRAMS": 4, "num_warps": 4, "num_stages": 1}
    arg = ops.config_arg(rmsnorm_bwd_mod.SPEC, config)
    assert arg == "BLOCK_D=64,ROWS=1,PROGRAMS=4,num_warps=4,num_stages=1,PREFETCH=0,EVICT=0"
    assert ops._config(arg) == rmsnorm_bwd_mod.SPEC.validate_config(config)
    assert ops.config_arg(rmsnorm_bwd_mod.SPEC, None) == "" and ops._config("") is None


def test_rope_tables_that_require_grad_are_refused() -> None:
    x = rand(1, 3, 2, HEAD_DIM, dtype=torch.float32).requires_grad_()
    cos, sin = tables(3)
    compiled = torch.compile(lambda x, c, s: fusetune.rope(x, c, s, interleaved=True),
                             fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="rope: cos or sin requires grad"):
        compiled(x, cos.requires_grad_(), sin)


@pytest.mark.parametrize("name", ["qkv", "ffn", "linear", "lola", "moe", "rmsnorm_bwd"])
def test_no_backward_ops_refuse_inputs_that_require_grad(name: str) -> None:
    fn, args = case(name, torch.float32)
    args = (args[0].requires_grad_(), *args[1:])
    with pytest.raises(RuntimeError, match=f"{name}: an input requires grad"):
        fn(*args)  # eager
    with pytest.raises(Exception, match=f"{name}: an input requires grad"):
        torch.compile(fn, fullgraph=True, backend="eager")(*args)


# ---- the ops themselves -----------------------------------------------------------------------


def test_lower_as_fallbacks_covers_every_op() -> None:
    from torch._inductor import lowering

    names = {op._qualname for op in ops.OPS}
    assert names == {f"fusetune::{n}" for n in (*LAUNCHERS, "rope_bwd", "swiglu_bwd",
                                                 "rmsnorm_add")}
    ops.lower_as_fallbacks()
    assert all(op._opoverload in lowering.lowerings for op in ops.OPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_new_ops_pass_opcheck(dtype: torch.dtype) -> None:
    # Schemas, fake implementations against the real ones, the autograd registrations, and
    # AOTAutograd tracing each forward's backward into its backward kernel's op.
    cos, sin = tables(3)
    x = rand(2, 3, 4, HEAD_DIM, dtype=dtype)
    a, b = rand(2, 3, 96, dtype=dtype), rand(2, 3, 96, dtype=dtype, seed=1)
    torch.library.opcheck(ops._rope_op, (x.clone().requires_grad_(), cos, sin, False))
    torch.library.opcheck(ops._rope_bwd_op, (x, cos, sin, True))
    torch.library.opcheck(ops._swiglu_op, (a.clone().requires_grad_(), b.clone()
                                           .requires_grad_()))
    torch.library.opcheck(ops._swiglu_bwd_op, (a, b, rand(2, 3, 192, dtype=dtype)[..., :96]))
    xl, w, bias = rand(5, 64, dtype=dtype), rand(40, 64, dtype=dtype, scale=0.125), rand(
        40, dtype=dtype)
    torch.library.opcheck(ops._lola_op, (xl, w, bias, 1e-5, None, False))
    torch.library.opcheck(ops._moe_op, (rand(6, 64, dtype=dtype), *moe_args(dtype)))
    xq, g = rand(2, 3, 64, dtype=dtype), rand(64, dtype=dtype, seed=1)
    ws = tuple(rand(n, 64, dtype=dtype, scale=0.125, seed=2) for n in (64, 32, 32))
    torch.library.opcheck(ops._qkv_op, (xq, g, *ws, cos, sin, EPS, HEAD_DIM, None, None, None,
                                        None, None, None, False, True, ""))
    torch.library.opcheck(ops._rmsnorm_op, (xq.clone().requires_grad_(), g, EPS,
                                            ops.config_arg(rmsnorm_mod.SPEC, RMSNORM_CFG)))
