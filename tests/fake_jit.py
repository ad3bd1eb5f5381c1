"""Triton's JIT faked for two kernels, and the fake kernel spec of fake_kernels with one more
MODE, 7: right, after launching those two kernels through Triton's JIT entry point.

FAKE_MAIN and FAKE_FINISH are real JITFunction objects, so a launch `FAKE_MAIN[grid](x)` goes
through JITFunction.run as a Triton kernel's does, and what observes Triton's launches sees
them. Importing this module makes JITFunction.run answer for these two (a stand-in for the
CompiledKernel, nothing compiled or run) and hand every other kernel to Triton's own run,
unchanged. (Apart from fake_kernels so that processes using only that one do not import
Triton.)"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import fake_kernels
from fake_kernels import log
from triton.runtime.jit import JITFunction

from fusetune.spec import Config, Tensors

MODE_WITH_KERNELS = 7


class FakeCompiledKernel:
    """What Triton's JIT returns for a launch: here only the figures a GPU reports on loading
    a kernel (registers, spills) and its compiled shared memory."""

    def __init__(self, name: str, n_regs: int, n_spills: int, shared: int) -> None:
        self.name, self.n_regs, self.n_spills = name, n_regs, n_spills
        self.metadata = SimpleNamespace(shared=shared)


# The bodies of the two fake kernels (never run; unannotated like a Triton kernel's)
def _main_body(x):
    pass


def _finish_body(x):
    pass


FAKE_MAIN = JITFunction(_main_body)
FAKE_FINISH = JITFunction(_finish_body)
COMPILED = {id(FAKE_MAIN): FakeCompiledKernel("main", 96, 0, 49152),
            id(FAKE_FINISH): FakeCompiledKernel("finish", 40, 8, 1024)}
# MODE 7's figures as a config: most registers, spills of both together, most shared memory
MODE7_STATS = (96, 8, 49152)


# Triton's own JITFunction.run, as it was before this module replaced it
TRITON_RUN = getattr(JITFunction.__dict__["run"], "triton_run", JITFunction.__dict__["run"])


def _install() -> None:
    if getattr(JITFunction.__dict__["run"], "fake_jit", False):
        return  # installed already
    triton_run = JITFunction.__dict__["run"]

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        kernel = COMPILED.get(id(self))
        if kernel is None:
            return triton_run(self, *args, **kwargs)
        log(f"{'warmup' if kwargs.get('warmup') else 'launch'} {kernel.name}")
        return kernel

    run.fake_jit = True  # type: ignore[attr-defined]
    run.triton_run = triton_run  # type: ignore[attr-defined]
    JITFunction.run = run


_install()


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    if config["MODE"] == MODE_WITH_KERNELS:
        FAKE_MAIN[(1,)](inputs["x"])
        FAKE_FINISH[(1,)](inputs["x"])
        FAKE_MAIN[(1,)](inputs["x"])  # launched twice: counted once
    fake_kernels.SPEC.launch(inputs, outputs, config)  # (MODE 7 computes the right result)


SPEC = dataclasses.replace(fake_kernels.SPEC, launch=_launch)
