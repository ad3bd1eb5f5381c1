"""Click options shared by the commands that measure points (`search`, `evaluate-search`):
which kernel and points, where results go, how configs run. Parsed into one `PointArgs`."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import click

from fusetune.tuner.search import BACKEND_CHOICES, DEFAULT_GRID

DEFAULT_DB = "sqlite:///fusetune.db"


def _items(param: click.Parameter, value: str, expected: str) -> list[str]:
    """The comma-separated items of `value`; an empty one ("1,,2", "1,2,") is refused, as it is
    a value left out rather than a separator to skip."""
    items = [v.strip() for v in value.split(",")]
    if "" in items:
        raise click.BadParameter(f"{value!r}: empty item; expected {expected}", param=param)
    return items


def int_list(_ctx: Any, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    items = _items(param, value, "comma-separated integers, e.g. 1,16,64")
    try:
        out = [int(v) for v in items]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers, e.g. 1,16,64",
                                 param=param) from None
    if any(v < 1 for v in out):
        raise click.BadParameter(f"{value!r}: expected positive integers", param=param)
    return out


def str_list(_ctx: Any, param: click.Parameter, value: str | None) -> list[str] | None:
    return None if value is None else _items(param, value, "comma-separated names")


def dims_map(_ctx: Any, param: click.Parameter, value: str | None) -> dict[str, int] | None:
    if value is None:
        return None
    out: dict[str, int] = {}
    for part in value.split(","):
        name, _, num = part.partition("=")
        name = name.strip()
        try:
            out[name] = int(num)
        except ValueError:
            raise click.BadParameter(f"{value!r}: {part!r} is not name=integer; expected "
                                     "e.g. dim=4096,hidden=11008", param=param) from None
    return out  # the values are the kernel's to judge (search.parse_dims)


@dataclass
class PointArgs:
    """The shared options, as parsed."""

    kernel: str
    gpu_name: str | None
    model: str | None
    dim: int | None
    dims_opt: dict[str, int] | None
    batch: list[int] | None
    seq: list[int] | None
    dtype: list[str] | None
    weights: str | None  # --weights as given (checked against the kernel and dtypes later)
    activations: str  # --activations: "16bit" or "fp8" (checked against the weights later)
    max_batch: int  # --kernel all: decode batch sizes 1, 2, 4, ... up to this
    prefill: list[int]  # --kernel all: prefill token counts
    db: str
    backend: str
    space_path: str | None
    isolate: bool
    trial_timeout: float
    compile_workers: int | None  # None: the default for the backend

    @property
    def worker_timeout(self) -> float | None:
        """Seconds per config in a worker subprocess, or None to run configs in-process."""
        return self.trial_timeout if self.isolate else None


_KERNELS_HELP = ("rmsnorm, rope, qkv, ffn, lola, linear, moe; for training rmsnorm_bwd, rope_bwd, "
                 "swiglu, swiglu_bwd; or a kernel of your own: package.module:name of a "
                 "@fusetune.autotune kernel, or the name an installed package registers it by "
                 "(entry points `fusetune.kernels`), its key arguments given as --dims")
# --kernel of `search`: one kernel, or the kernels of a model's path.
_KERNEL_OR_MODEL = click.option(
    "--kernel", "-k", required=True,
    help=f"Kernel to tune ({_KERNELS_HELP}), or "
         "`all`: every kernel that fusetune.patch launches in --model (qkv, ffn, "
         "linear for o_proj and down_proj, rmsnorm; moe for a mixture of experts' "
         "layers), at its decode and prefill "
         "rows (--max-batch, --prefill) or at `search --rows`; with `search "
         "--points FILE`, every kernel the file names. `training`: every kernel "
         "of the patched model's training path (rmsnorm and rmsnorm_bwd, rope and "
         "rope_bwd on q and on k, swiglu and swiglu_bwd), at a step's token rows "
         "(4096, 8192, 16384 unless --rows or --batch/--seq).")
# --kernel of the commands that measure one kernel's points (`evaluate-search`).
_ONE_KERNEL = click.option(
    "--kernel", "-k", required=True,
    help=f"Kernel whose points are measured: one kernel ({_KERNELS_HELP}). The kernels of a "
         "whole model are tuned by `fusetune search --kernel all` (or training).")
_GPU_AND_MODEL = (
    click.option("--gpu", "gpu_name", default=None,
                 help="GPU the tables are for (3090, h100, a100-80gb; see `fusetune gpus`). Must "
                      "be a visible device when configs run. Default: the first visible GPU."),
    click.option("--model", default=None,
                 help="The dims' model: a preset (llama-2-7b, llama-3-8b, llama-3-70b, "
                      "mistral-7b, qwen2.5-7b, phi-3-mini, mixtral-8x7b, ...) or a Hugging "
                      "Face model directory or its config.json (Llama, Mistral, Qwen2, Qwen3, "
                      "Gemma 2/3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE; read locally, no "
                      "weights). "
                      "Default: "
                      f"{DEFAULT_GRID['model']}."),
)
# The rows of a model's path (`--kernel all`); PointArgs holds these defaults where a command
# has no such options.
_MODEL_DEFAULTS: dict[str, Any] = {"max_batch": 8, "prefill": [512, 4096]}
_MODEL_ROWS = (
    click.option("--max-batch", type=click.IntRange(min=1), default=_MODEL_DEFAULTS["max_batch"],
                 show_default=True,
                 help="--kernel all: decode batch sizes 1, 2, 4, ... up to this. Left out "
                      "with --prefill too, moe takes its own token counts (1-8192)."),
    click.option("--prefill", callback=int_list,
                 default=",".join(map(str, _MODEL_DEFAULTS["prefill"])), show_default=True,
                 help="--kernel all: prefill token counts (a batch of one prompt each)."),
)
_OPTIONS = (
    click.option("--dim", type=click.IntRange(min=1), default=None,
                 help="Width of the normalized rows (instead of --model)."),
    click.option("--dims", "dims_opt", callback=dims_map, default=None,
                 help="All dims as name=value,... (instead of --model)."),
    click.option("--batch", callback=int_list, default=None,
                 help="Batch sizes, comma-separated. Default: "
                      f"{','.join(map(str, DEFAULT_GRID['batch']))} (moe: the token counts a "
                      "server hands a layer, 1, 2, 4, ... 8192, at seq 1)."),
    click.option("--seq", callback=int_list, default=None,
                 help="Sequence lengths (1 = decode). Default: "
                      f"{','.join(map(str, DEFAULT_GRID['seq']))}."),
    click.option("--dtype", callback=str_list, default=None,
                 help=f"Activation dtypes. Default: {','.join(DEFAULT_GRID['dtype'])} "
                      "(a kernel of your own: the dtype its make_inputs is given, float16 "
                      "by default)."),
    click.option("--weights", default=None,
                 help="Weight format (ffn, qkv, linear, lola, moe): fp8-e4m3 or fp8-e5m2 (FP8 with "
                      "a float32 scale per output channel, as from fusetune.quantize_fp8), or "
                      "fp16 / bf16, the activations' own dtype (the default; weights other than "
                      "FP8 are read in x's dtype). Part of each point's key and of the exported "
                      "tables."),
    click.option("--activations", type=click.Choice(("16bit", "fp8")), default="16bit",
                 show_default=True,
                 help="How FP8 weights meet the activations: 16bit keeps them in their dtype "
                      "(weight-only FP8: the 16-bit tolerance against the dequantized weights); "
                      "fp8 rounds them to e4m3 per row for the FP8 tensor cores (faster "
                      "products, a few percent of error; needs --weights fp8-*). It changes the "
                      "results, so it is part of each point's key, never tuned."),
    click.option("--db", "--storage", "db", default=DEFAULT_DB, show_default=True,
                 help="Database URL for results and Optuna studies (sqlite:///..., "
                      "postgresql://... where several hosts tune together)."),
    click.option("--backend", type=click.Choice(BACKEND_CHOICES), default="auto",
                 show_default=True,
                 help="cuda, or Triton's CPU interpreter (meaningless timings; automatic when no "
                      "GPU is visible, with a smaller default grid)."),
    click.option("--space", "space_path", type=click.Path(dir_okay=False), default=None,
                 help="A search-space YAML to use instead of the kernel's own."),
    click.option("--isolate/--in-process", default=False, show_default=True,
                 help="Run configs in a worker subprocess: a config that crashes or hangs is "
                      "recorded (crashed / timeout) and the worker restarted, the run goes on."),
    click.option("--trial-timeout", type=click.FloatRange(min=1), default=300,
                 show_default=True,
                 help="Seconds one config may take (compile, check and timing) with --isolate."),
    click.option("--compile-workers", type=click.IntRange(min=0), default=None,
                 help="Processes that compile configs ahead of the GPU, in parallel, so that "
                      "the GPU process only loads them from Triton's cache (the search then "
                      "asks its sampler for a few configs at a time). 0: off. Default: off for "
                      "`search` (it pays only for long searches: their start-up costs ~10 s, about "
                      "a minute on a machine whose Triton cache is still empty), "
                      "half the CPUs, at most 8, for `evaluate-search`'s grid; off (ignored) on "
                      "the interpreter."),
)
_NAMES = tuple(f.name for f in fields(PointArgs))


def _add_options(command: Callable[..., Any], options: tuple[Any, ...]) -> Callable[..., Any]:
    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        args = PointArgs(**{name: kwargs.pop(name) if name in kwargs
                            else copy.copy(_MODEL_DEFAULTS[name]) for name in _NAMES})
        return command(args, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def point_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Adds the shared options to a click command (`--kernel` takes a kernel's name, `all` or
    `training`); it receives them as its first argument, one `PointArgs`, and its own options as
    keywords."""
    return _add_options(command, (_KERNEL_OR_MODEL, *_GPU_AND_MODEL, *_MODEL_ROWS, *_OPTIONS))


def one_kernel_point_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """As point_options, for a command that measures one kernel's points: `--kernel` takes a
    kernel's name only, and the options of a model's path (--max-batch, --prefill) are left
    out (PointArgs holds their defaults)."""
    return _add_options(command, (_ONE_KERNEL, *_GPU_AND_MODEL, *_OPTIONS))
