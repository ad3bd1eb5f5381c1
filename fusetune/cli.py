"""The `fusetune` command: parses flags, delegates, prints."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table

from fusetune.cli_options import (
    DEFAULT_DB,
    PointArgs,
    int_list,
    one_kernel_point_options,
    point_options,
    str_list,
)
from fusetune.tuner.search import (
    DEFAULT_GRID,
    INTERPRETER_GRID,
    Request,
    SearchError,
    Target,
    choose_target,
    make_points,
    parse_dims,
)

# What `coverage` says of a point whose table entry is marginal.
MARGINAL_NOTE = "marginal: the default config runs"
# `--kernel` values that tune every kernel a model launches (its inference or training path).
MODEL_KERNELS = ("all", "training")

# Wide enough for the tables when output goes to a file or a CI log.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True, highlight=False)


def _numerics(p: Any) -> str:
    """A stored point's weight format and activation mode as `show` prints them."""
    if not p.weights:
        return "-"
    return p.weight_format + (f" {p.activations} act." if p.activations else "")


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _config_str(config: dict[str, int] | None, kernel: str | None = None) -> str:
    """KEY=VALUE pairs of `config`; with `kernel`, its flags (KernelSpec.flags: THREAD_SUM,
    TMA, ...) at the value that leaving them out means are left out: the same kernel, shorter."""
    if not config:
        return "-"
    from fusetune.kernels import REGISTRY

    # a database may hold kernels this version does not have
    spec = REGISTRY.get(kernel) if kernel is not None else None
    if config.get("UNFUSED"):  # its other keys mean nothing (fusetune/kernels/_unfused.py)
        form = spec.unfused_form if spec is not None else "the unfused form"
        return f"UNFUSED=1 ({form})"
    flags: dict[str, int] = spec.omitted_values if spec is not None else {}
    return " ".join(f"{k}={v}" for k, v in config.items() if not (k in flags and flags[k] == v))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fusetune")
def main() -> None:
    """fusetune: tune fused Triton kernels offline, launch them with per-GPU lookup tables.

    \b
    fusetune gpus                          the GPU catalogue, visible devices marked
    fusetune search --kernel rmsnorm       tune every point of the default grid
    fusetune export tables.yaml            winners -> lookup table
    fusetune show                          what the database holds
    """


@main.command()
def gpus() -> None:
    """List the GPU catalogue; the devices this machine sees are marked."""
    from fusetune import gpus as g

    visible = g.visible_gpus()
    t = Table(title="GPU catalogue")
    for col in ("name", "aliases", "device name", "cc", "SMs", "smem/block KB", "regs/block",
                "L2 MB", "GB/s", "fp16 TF/s", "bf16 TF/s", "FP8 MMA", "fp8 TF/s", "visible"):
        t.add_column(col, overflow="fold")  # long values wrap, never cut
    for r in g.format_catalogue(visible):
        t.add_row(str(r["name"]), str(r["aliases"]), str(r["display"]), str(r["cc"]),
                  str(r["sms"]), str(r["smem_kb"]), str(r["regs"]), str(r["l2_mb"]),
                  str(r["bandwidth_gbs"]),
                  str(r["fp16_tflops"]), str(r["bf16_tflops"]), str(r["fp8"]),
                  str(r["fp8_tflops"]), f"[bold green]{r['visible']}[/]" if r["visible"] else "")
    console.print(t)
    if not visible:
        console.print("No CUDA GPU is visible here: `fusetune search` would use the Triton "
                      "interpreter (--backend interpreter) or plan only (--dry-run --gpu NAME).")


def _resolve_points(args: PointArgs, target: Target, small: bool
                    ) -> tuple[Any, Any, list[Any]]:
    """(kernel spec, search space, points) of the shared options; `small`: the interpreter's
    defaults for what was not given."""
    from fusetune.kernels import get_spec
    from fusetune.tuner.space import SpaceError, load_space

    grid = INTERPRETER_GRID if small else DEFAULT_GRID
    model = args.model
    try:
        spec = get_spec(args.kernel)
        space = load_space(spec, args.space_path)
        if not spec.rows:
            return spec, space, _own_points(spec, args)
        if model is None and args.dim is None and args.dims_opt is None:
            model = grid["model"]
        dims = parse_dims(spec, model, args.dim, args.dims_opt)
        dtypes = args.dtype or grid["dtype"]
        # --weights fp16 / bf16 name the activations' dtype: Point.weights "" (one key for both)
        weights = ("" if args.weights is None else
                   {spec.point_weights(args.weights, d) for d in dtypes}.pop())
        activations = spec.point_activations(args.activations, weights)
        batches, seqs = args.batch or grid["batch"], args.seq or grid["seq"]
        if spec.default_rows and not small and args.batch is None and args.seq is None:
            batches, seqs = list(spec.default_rows), [1]  # the kernel's own rows
        req = Request(args.kernel, dims, batches, seqs, dtypes, weights, activations)
        points = make_points(req)
    except (SearchError, SpaceError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if small and (args.batch is None or args.seq is None or model == grid["model"]):
        err.print(f"[yellow]note:[/] interpreter defaults: dims {dims}, batch {req.batches}, "
                  f"seq {req.seqs}, dtype {','.join(req.dtypes)}")
    return spec, space, points


def _own_points(spec: Any, args: PointArgs) -> list[Any]:
    """The points of a kernel keyed by its own arguments (fusetune.autotune): its key values
    from --dims, one point per --dtype (float16 unless given), no rows; the other tensors'
    dtypes come from its make_inputs."""
    from fusetune.spec import Point

    given = _given((("model", "--model"), ("batch", "--batch"), ("seq", "--seq"),
                    ("weights", "--weights")))
    given += ["--activations"] if args.activations != "16bit" else []
    if given:
        raise click.UsageError(
            f"{spec.name} is keyed by its arguments {', '.join(spec.dim_names)}: give their "
            f"values as --dims {','.join(f'{k}=...' for k in spec.dim_names)} (several "
            f"points: --points FILE) and leave out {', '.join(given)}")
    dims = parse_dims(spec, None, args.dim, args.dims_opt)
    points = []
    for dtype in args.dtype or ["float16"]:
        if dtype not in spec.dtypes:
            raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(spec.dtypes)}")
        point = Point.make(spec.name, dims, 1, 1, dtype)
        points.append(Point.make(spec.name, dims, 1, 1, dtype, spec.signature(point)))
    return points


def _model_groups(args: PointArgs, small: bool, rows_opt: list[int] | None = None
                  ) -> list[tuple[Any, Any, list[Any]]]:
    """`--kernel all`: (spec, space, points) for every kernel and dims a model run by
    fusetune.patch launches, at its decode batch sizes (1, 2, 4, ... up to --max-batch) and
    prefill token counts (--prefill), or at --batch x --seq where given, or at the row counts
    `rows_opt` (--rows: a point of batch R, seq 1 for each; the lookup keys on rows).
    `--kernel training`: the same for the kernels of fusetune.patch's training path, at the
    token rows of a training step (models.TRAINING_ROWS unless --rows or --batch x --seq)."""
    from fusetune.kernels import get_spec
    from fusetune.models import TRAINING_ROWS, launched_dims, load_model, model_rows
    from fusetune.spec import Point
    from fusetune.tuner.space import SpaceError, load_space

    training = args.kernel == "training"
    what = "--kernel training tunes every kernel a model launches in training" if training \
        else "--kernel all tunes every kernel a model launches"
    if args.model is None:
        raise click.ClickException(f"{what}: give --model (a preset, or a Hugging Face model "
                                   "directory or config.json)")
    if args.dim is not None or args.dims_opt is not None or args.space_path is not None:
        raise click.ClickException(f"--kernel {args.kernel} takes its dims from --model and each "
                                   "kernel's own space: leave out --dim, --dims and --space")
    if training:
        # The training path runs 16-bit weights, and it has no decode steps or prefills.
        given = _given((("weights", "--weights"), ("activations", "--activations"),
                        ("max_batch", "--max-batch"), ("prefill", "--prefill")))
        if given:
            raise click.UsageError(f"--kernel training tunes the training path (16-bit weights, "
                                   f"a step's token rows): leave out {', '.join(given)}; give "
                                   f"the rows as --rows R,R,... or --batch and --seq")
    try:
        model = load_model(args.model)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    own_rows = False  # whether a kernel's default_rows replace the model's rows
    if rows_opt is not None:
        rows = [(r, 1) for r in dict.fromkeys(rows_opt)]
    elif args.batch is not None or args.seq is not None:
        grid = INTERPRETER_GRID if small else DEFAULT_GRID
        rows = [(b, s) for s in (args.seq or grid["seq"]) for b in (args.batch or grid["batch"])]
    elif training:
        rows = [(r, 1) for r in TRAINING_ROWS]
    else:
        batches = [1 << i for i in range(args.max_batch.bit_length())
                   if 1 << i <= args.max_batch]
        rows = model_rows(batches, args.prefill)
        own_rows = not small and not _given((("max_batch", "--max-batch"),
                                             ("prefill", "--prefill")))
    dtypes = args.dtype or [model.dtype]
    groups = []
    own: list[str] = []
    try:
        for kernel, uses in launched_dims(model, training).items():
            spec = get_spec(kernel)
            space = load_space(spec)
            weights = activations = ""
            if spec.weight_formats and args.weights is not None:
                weights = {spec.point_weights(args.weights, d) for d in dtypes}.pop()
                activations = spec.point_activations(args.activations, weights)
            elif args.activations != "16bit" and args.weights is None:
                raise click.ClickException("--activations fp8 needs --weights fp8-e4m3 or "
                                           "fp8-e5m2")
            kernel_rows = rows
            if own_rows and spec.default_rows:
                kernel_rows = [(r, 1) for r in spec.default_rows]
                own.append(f"{kernel} at rows {', '.join(map(str, spec.default_rows))}")
            for _, dims in uses:
                points = [Point.make(kernel, dims, b, s, d, weights, activations)
                          for d in dtypes for b, s in kernel_rows]
                groups.append((spec, space, points))
    except (SearchError, SpaceError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    err.print(f"[bold]{model.name}[/]: {len(groups)} kernels and dims, rows "
              f"{', '.join(str(b * s) for b, s in rows)}"
              + "".join(f" ({o}: its own, --max-batch and --prefill replace them)" for o in own)
              + f", {','.join(dtypes)}")
    return groups


def _target(backend: str, gpu_name: str | None, dry_run: bool,
            devices: str | None = None) -> Target:
    try:
        target = choose_target(backend, gpu_name, dry_run, devices)
    except (SearchError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    for note in target.notes:
        err.print(f"[yellow]warning:[/] {note}")
    return target


@main.command()
@point_options
@click.option("--trials", type=click.IntRange(min=1), default=40, show_default=True,
              help="Distinct configs evaluated per point (small spaces are covered whole).")
@click.option("--time-budget", type=click.FloatRange(min=0), default=None,
              help="Seconds of sampling per point (the finalists are still re-timed).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampler seed.")
@click.option("--dry-run", is_flag=True,
              help="Print the plan (points, space size, configs pruned by the GPU's limits and "
                   "why) without running anything; needs no GPU.")
@click.option("--devices", default=None, metavar="all|0,1,...",
              help="Measure on several GPUs of this host at once: 'all' (every visible GPU, or "
                   "every one of the --gpu model) or device indices. One worker process per "
                   "device (implies --isolate); the points are shared out as a queue. The "
                   "devices must be one GPU model.")
@click.option("--rows", "rows_opt", callback=int_list, default=None, metavar="R,R,...",
              help="--kernel all or training: the row counts (batch x seq) to tune, one point "
                   "of R rows each (batch R, seq 1: the lookup keys on rows, so that point "
                   "answers `exact` for R rows however they are split), instead of "
                   "--max-batch and --prefill (and --batch/--seq); e.g. "
                   "1,4,16,64,256,1024,4096, the rows `fusetune coverage` reports.")
@click.option("--points", "points_file", type=click.Path(dir_okay=False), default=None,
              metavar="FILE",
              help="Tune the points a file names instead of --model/--dims and the rows "
                   "options: a fusetune table (every entry it holds for --gpu: re-tune a table "
                   "after a Triton upgrade) or a list `points: [{kernel, dims, rows (or batch "
                   "and seq), dtype, weights, activations}, ...]`. --kernel all takes every "
                   "kernel in it, a kernel name only that kernel's points.")
@click.option("--stale", is_flag=True,
              help="With --points TABLE: only the entries the lookup no longer serves because "
                   "they were tuned on another version of the code their config runs (after "
                   "an edit to a kernel; an edit to the unfused form alone stales only its "
                   "entries).")
def search(args: PointArgs, trials: int, time_budget: float | None, seed: int,
           dry_run: bool, devices: str | None, rows_opt: list[int] | None,
           points_file: str | None, stale: bool) -> None:
    """Tune KERNEL at every (batch, seq, dtype) point: one Optuna study per point.

    Every evaluated config is stored with its status (ok, infeasible, oor, compile_error,
    runtime_error, wrong_result, crashed) and reason; each point's winner is re-timed beside the
    default heuristic. Interrupt at any time and run the same command again to resume: finished
    trials are kept and not redone. With --devices, several GPUs of this host (one model) share
    the points, a worker process each.
    """
    if stale and points_file is None:
        raise click.UsageError("--stale picks among the entries of --points TABLE: give it")
    if points_file is not None:
        _check_points_option(args, rows_opt)
    elif rows_opt is not None:
        _check_rows_option(args)
    target = _target(args.backend, args.gpu_name, dry_run, devices)
    small = target.backend == "interpreter" and not dry_run
    if points_file is not None:
        groups = _file_groups(points_file, args, target, stale)
        if not groups:
            err.print(f"{points_file}: no entry for {target.gpu.name} was tuned on other code "
                      "than this fusetune's: nothing to search")
            return
    elif args.kernel in MODEL_KERNELS:
        groups = _model_groups(args, small, rows_opt)
    else:
        groups = [_resolve_points(args, target, small)]
    if dry_run and devices is not None:
        err.print(f"[yellow]note:[/] --devices {devices} is ignored with --dry-run")
    gpu = target.gpu
    if (not dry_run and target.backend == "cuda" and not gpu.fp8_tensor_cores
            and any(p.fp8_activations for _, _, points in groups for p in points)):
        major, minor = gpu.compute_capability
        raise click.ClickException(f"--activations fp8 needs FP8 tensor cores (compute "
                                   f"capability 8.9+); {gpu.name} has {major}.{minor}")
    if dry_run:
        for spec, space, points in groups:
            _print_plan(spec, space, points, target, trials)
    elif target.devices:
        _run_search_on_devices(groups, target, args.db, trials, time_budget, seed,
                               args.trial_timeout, _compile_workers(args, target, False))
    else:
        _run_search(groups, target, args.db, trials, time_budget, seed, args.worker_timeout,
                    compile_workers=_compile_workers(args, target, False),
                    compile_timeout=args.trial_timeout)


def _check_points_option(args: PointArgs, rows_opt: list[int] | None) -> None:
    """`search --points`: the file names the points; the options that would name them too
    are a UsageError naming them."""
    given = _given((("model", "--model"), ("dim", "--dim"), ("dims_opt", "--dims"),
                    ("batch", "--batch"), ("seq", "--seq"), ("dtype", "--dtype"),
                    ("weights", "--weights"), ("activations", "--activations"),
                    ("max_batch", "--max-batch"), ("prefill", "--prefill")))
    given += ["--rows"] if rows_opt is not None else []
    if args.space_path is not None and args.kernel in MODEL_KERNELS:
        given.append(f"--space (with --kernel {args.kernel}: give a kernel's name)")
    if given:
        raise click.UsageError(f"--points names the points itself (kernel, dims, rows, dtype, "
                               f"weights): leave out {', '.join(given)}")


def _file_groups(path: str, args: PointArgs, target: Target, stale: bool = False
                 ) -> list[_Group]:
    """`search --points`: (spec, space, points) for each kernel, dims and weights of the
    file's points (a table's entries for the target's GPU; with `stale`, those tuned on other
    code only, possibly none)."""
    from fusetune.models import TRAINING_KERNELS
    from fusetune.tuner.point_file import load_points
    from fusetune.tuner.space import SpaceError, load_space

    training = args.kernel == "training"
    try:
        groups = [(spec, load_space(spec, args.space_path), points)
                  for spec, points in load_points(path, target.gpu.name,
                                                  "all" if training else args.kernel, stale)
                  if not training or spec.name in TRAINING_KERNELS]
    except (SearchError, SpaceError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if not groups and stale:
        return []
    if not groups:
        raise click.ClickException(f"--points {path}: no points of the training kernels "
                                   f"({', '.join(TRAINING_KERNELS)}) for {target.gpu.name} in it")
    n = sum(len(points) for _, _, points in groups)
    err.print(f"[bold]{path}[/]: {n} {'stale ' if stale else ''}points of {len(groups)} "
              f"kernels and dims for {target.gpu.name}")
    return groups


def _check_rows_option(args: PointArgs) -> None:
    """`search --rows`: only with --kernel all or training, and instead of the other ways to
    give rows (UsageError naming the options given with it)."""
    if args.kernel not in MODEL_KERNELS:
        raise click.UsageError(f"--rows applies to --kernel all and training; for --kernel "
                               f"{args.kernel} give the rows as --batch R1,R2,... --seq 1")
    given = _given((("max_batch", "--max-batch"), ("prefill", "--prefill"),
                    ("batch", "--batch"), ("seq", "--seq")))
    if given:
        raise click.UsageError(f"--rows gives the row counts itself: leave out "
                               f"{', '.join(given)} (or leave out --rows)")


def _given(options: Sequence[tuple[str, str]]) -> list[str]:
    """Of (parameter name, option) pairs, the options given on the command line (not left at
    their defaults), in that order."""
    ctx = click.get_current_context()
    return [opt for name, opt in options
            if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)]


def _print_plan(spec: Any, space: Any, points: Sequence[Any], target: Any, trials: int) -> None:
    from fusetune.tuner.space import ENUMERATE_LIMIT, Plan, search_plan

    gpu = target.gpu
    console.print(f"[bold]Plan[/] for {spec.name} on {gpu.name} ({gpu.display}): "
                  f"{len(points)} points; space {space.source}: {space.size:,} raw configs "
                  f"({' × '.join(f'{p.name}:{len(p.values)}' for p in space.params)})")
    console.print(f"Limits applied: {gpu.smem_per_block} B shared memory per block, "
                  f"{gpu.regs_per_thread} registers per thread, {gpu.max_threads_per_block} "
                  "threads per block.")
    t = Table()
    weights = f", weights {points[0].weights}" if points[0].weights else ""
    weights += f", {points[0].activations} activations" if points[0].activations else ""
    sampled = space.size > ENUMERATE_LIMIT
    if sampled:
        console.print(f"Points: dims {points[0].dims_label}{weights}. The space is larger than "
                      f"{ENUMERATE_LIMIT:,} configs: each point's plan is a random sample of it "
                      "(the shares below are estimates); a search prices every config it meets "
                      "before compiling it.")
    else:
        console.print(f"Points: dims {points[0].dims_label}{weights}; 'distinct' counts configs "
                      "after merging those that compile to the same kernel.")
    cols = (("batch", "seq", "dtype", "rows", "sampled", "fit", "pruned because", "will try")
            if sampled else ("batch", "seq", "dtype", "rows", "distinct", "feasible", "pruned",
                             "pruned because", "will try"))
    for col in cols:
        t.add_column(col, overflow="fold")  # long values wrap, never cut
    total_pruned = 0
    for p in points:
        plan = search_plan(space, spec, p, gpu)
        will = plan.target(trials)
        will_s = f"{will} (sampled)" if will < plan.raw_size and will == trials else str(will)
        if isinstance(plan, Plan):
            total_pruned += len(plan.infeasible)
            why = "; ".join(f"{n} {k}" for k, n in plan.pruned_reasons.most_common()) or "-"
            t.add_row(str(p.batch), str(p.seq), p.dtype, str(p.rows), str(plan.distinct),
                      str(len(plan.feasible)), str(len(plan.infeasible)), why, will_s)
        else:
            why = "; ".join(f"{100 * n / plan.drawn:.0f}% {k}"
                            for k, n in plan.draw_reasons.most_common()) or "-"
            fit = 100 * (plan.drawn - sum(plan.draw_reasons.values())) / plan.drawn
            t.add_row(str(p.batch), str(p.seq), p.dtype, str(p.rows), str(plan.drawn),
                      f"{fit:.0f}%", why, will_s)
    console.print(t)
    if sampled:
        console.print(f"The configs pruned in all under {gpu.name}'s limits are counted as the "
                      "search meets them; the shares above are of each point's sampled raw "
                      "configs.")
    else:
        console.print(f"{total_pruned} configs pruned in all under {gpu.name}'s limits, before "
                      "compiling anything.")


def _shown(db: str) -> str:
    """The database URL as printed: without its password."""
    from fusetune.db.store import safe_url

    return safe_url(db)


def _store(db: str) -> Any:
    """fusetune's tables in the existing database `db` (what show and export read), or a
    one-line error naming the database."""
    from fusetune.db.store import Store

    try:
        return Store(db, create=False)
    except Exception as e:
        raise click.ClickException(f"cannot open database {_shown(db)!r}: {e}") from None


def _open_store(db: str) -> tuple[Any, Any]:
    """fusetune's tables and Optuna's storage in the database `db`."""
    from fusetune.db.store import Store
    from fusetune.tuner.search import open_storage

    try:
        return Store(db), open_storage(db)
    except Exception as e:
        raise click.ClickException(f"cannot open database {_shown(db)!r}: {e}") from None


def _open_context(spec: Any, space: Any, target: Target, db: str,
                  trial_timeout: float | None, device: str | None = None,
                  compile_workers: int = 0, compile_timeout: float = 300.0) -> Any:
    """What every point of a run shares; configs run in a worker process if `trial_timeout`.
    `device`: one of the target's devices (default: its first). `compile_workers`: processes
    that compile configs ahead of that device (0: none), each config within `compile_timeout`
    seconds. Close it with `close()`."""
    import torch
    import triton

    from fusetune.tuner.compile_ahead import CompileAhead
    from fusetune.tuner.study import Context
    from fusetune.tuner.worker import Worker

    device = device or target.device
    store, storage = _open_store(db)
    worker = (Worker(spec.search_ref, target.backend, device, trial_timeout)
              if trial_timeout is not None else None)
    compiler = (CompileAhead(spec.search_ref, device, compile_workers, compile_timeout)
                if compile_workers > 0 else None)
    return Context(spec, space, target.gpu, target.backend, device, store, storage,
                   triton.__version__, torch.__version__, worker, compiler)


def _compile_workers(args: PointArgs, target: Target, default_on: bool = True) -> int:
    """--compile-workers for this target: as given, else the default (`default_on`: the grid;
    the search compiles ahead only when asked), or 0 where nothing compiles."""
    from fusetune.tuner.compile_ahead import resolve_workers

    n, note = resolve_workers(args.compile_workers, target.backend,
                              max(1, len(target.devices)), default_on=default_on)
    if note:
        err.print(f"[yellow]note:[/] {note}")
    return n


def _print_compile_time(configs: int, compile_s: float, ahead: int, stats: Any) -> None:
    """What compiling cost the evaluating process, and what the compile processes did (their
    CompileStats, None without compile processes)."""
    if configs == 0:
        return
    line = (f"Compiling and checking in the evaluating process: {compile_s:.1f} s for {configs} "
            f"configs ({compile_s / configs:.2f} s each)")
    if stats is not None:
        line += f"; {ahead} of them were compiled ahead: {stats.summary()}"
    console.print(line)


def _progress() -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[msg]}"), console=console,
                    transient=False)


_Group = tuple[Any, Any, Sequence[Any]]  # (kernel spec, search space, points) of one search


def _run_search(groups: Sequence[_Group], target: Any, db: str, trials: int,
                time_budget: float | None, seed: int, trial_timeout: float | None,
                compile_workers: int = 0, compile_timeout: float = 300.0) -> None:
    """Tunes each group's points on the target's device, one group after the other. One
    context serves them all: the worker process (if `trial_timeout`) and the compile processes
    start once (they serve any kernel) and are stopped once, at the end or on an error."""
    from fusetune.tuner.study import SearchOptions

    options = SearchOptions(trials=trials, time_budget_s=time_budget, seed=seed)
    spec, space, _ = groups[0]
    shared = _open_context(spec, space, target, db, trial_timeout,
                           compile_workers=compile_workers, compile_timeout=compile_timeout)
    try:
        for spec, space, points in groups:
            _search_points(shared.for_kernel(spec, space, spec.search_ref), points, options, target,
                           db, compile_workers)
    finally:
        shared.close()


def _search_points(ctx: Any, points: Sequence[Any], options: Any, target: Any, db: str,
                   compile_workers: int) -> None:
    """Tunes `points` of `ctx`'s kernel, one after the other; prints the winners."""
    from fusetune.tuner.bench import DeviceLostError
    from fusetune.tuner.sampling import SEARCH_BATCH
    from fusetune.tuner.study import PointTuner

    # The compile processes' stats count every kernel they served: this one's are the change.
    before = dataclasses.replace(ctx.compiler.stats) if ctx.compiler is not None else None
    console.print(f"Tuning {ctx.spec.name} on {target.gpu.name} ({target.device}, "
                  f"{target.backend}) into {_shown(db)}: {len(points)} points, up to "
                  f"{options.trials} configs each"
                  + (f"; {compile_workers} processes compile ahead, {SEARCH_BATCH} configs "
                     "asked at a time." if compile_workers else "."))
    results = []
    progress = _progress()
    try:
        with progress:
            for p in points:
                task = progress.add_task(p.label, total=None, msg="starting")

                def update(done: int, total: int, msg: str, task: Any = task) -> None:
                    progress.update(task, completed=done, total=total, msg=msg)

                tuner = PointTuner(ctx, p, options, update)
                res = tuner.run()
                progress.update(task, completed=res.n_evaluated, total=res.n_evaluated,
                                msg=f"done: {_fmt(res.time_us)} µs")
                results.append(res)
    except KeyboardInterrupt:
        err.print(f"\n[yellow]interrupted[/]: every finished trial is stored in {_shown(db)}; "
                  "run the same command again to resume.")
        sys.exit(130)
    except DeviceLostError as e:
        err.print(f"\n[red]error:[/] the GPU context is lost ({e}). That config is recorded as "
                  "crashed; run the same command again to continue (or use --isolate).")
        sys.exit(1)
    _print_summary(results, target)
    _print_compile_time(sum(r.n_new for r in results), sum(r.compile_s for r in results),
                        sum(r.compiled_ahead for r in results),
                        ctx.compiler.stats.since(before) if ctx.compiler is not None else None)


class _DeviceProgress:
    """The progress of a search on several devices: a line per point and device."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.tasks: dict[tuple[str, str], Any] = {}

    def start(self, device: str, point: Any, joined: bool) -> Any:
        task = self.progress.add_task(f"{device} {point.label}" + (" (joined)" if joined else ""),
                                      total=None, msg="starting")
        self.tasks[(device, point.label)] = task

        def update(done: int, total: int, msg: str) -> None:
            self.progress.update(task, completed=done, total=total, msg=msg)

        return update

    def done(self, device: str, point: Any, result: Any) -> None:
        task = self.tasks[(device, point.label)]
        if result is None:
            self.progress.update(task, msg="done helping")
        else:
            self.progress.update(task, completed=result.n_evaluated, total=result.n_evaluated,
                                 msg=f"done: {_fmt(result.time_us)} µs")


def _run_search_on_devices(groups: Sequence[_Group], target: Target, db: str, trials: int,
                           time_budget: float | None, seed: int, trial_timeout: float,
                           compile_workers: int = 0) -> None:
    """`search --devices`: a worker per device (and `compile_workers` compile processes per
    device), the points of each group shared out between them (tuner/devices.py), one group
    after the other. The devices run configs in worker processes whatever --isolate says, each
    within `trial_timeout` seconds. Each device's processes start once and serve every group;
    they are stopped once, at the end or on an error."""
    from fusetune.tuner.study import SearchOptions

    options = SearchOptions(trials=trials, time_budget_s=time_budget, seed=seed)
    spec, space, _ = groups[0]
    contexts: list[Any] = []
    try:
        for d in target.devices:
            contexts.append(_open_context(spec, space, target, db, trial_timeout, d,
                                          compile_workers=compile_workers,
                                          compile_timeout=trial_timeout))
        for spec, space, points in groups:
            _search_points_on_devices(
                [c.for_kernel(spec, space, spec.search_ref) for c in contexts], points, options,
                target, db)
    finally:
        for ctx in contexts:
            ctx.close()


def _search_points_on_devices(contexts: Sequence[Any], points: Sequence[Any], options: Any,
                              target: Target, db: str) -> None:
    """Tunes `points` of the contexts' kernel on their devices at once; prints the winners.
    The contexts stay open."""
    from fusetune.tuner.devices import DeviceSearch

    console.print(f"Tuning {contexts[0].spec.name} on {len(contexts)}× {target.gpu.name} "
                  f"({', '.join(target.devices)}, {target.backend}) into {_shown(db)}: "
                  f"{len(points)} points, up to {options.trials} configs each, a worker per "
                  "device.")
    search = DeviceSearch(contexts, points, options, close_contexts=False)
    try:
        with _progress() as progress:
            search.display = _DeviceProgress(progress)
            results = search.run()
    except KeyboardInterrupt:
        err.print(f"\n[yellow]interrupted[/]: every finished trial is stored in {_shown(db)}; "
                  "run the same command again to resume.")
        sys.exit(130)
    _print_summary(results, target)
    console.print("Per device: " + "; ".join(
        f"{s.device} {s.points} points, joined {s.joined}, {s.evaluated} configs run"
        for s in search.stats.values()))


def _print_summary(results: Sequence[Any], target: Any) -> None:
    gpu = target.gpu
    t = Table(title=f"Winners on {gpu.name}" + (" (interpreter: timings meaningless)"
                                                if target.backend == "interpreter" else ""))
    for col in ("point", "winner", "µs", "default µs", "speedup", "floor µs", "GB/s", "% of BW",
                "evaluated", "failed"):
        t.add_column(col, overflow="fold")  # long values wrap, never cut
    for r in results:
        gbs = r.cost.bytes / (r.time_us * 1e3) if r.time_us else None
        pct = 100 * gbs / gpu.bandwidth_gbs if gbs and gpu.bandwidth_gbs else None
        peak = gpu.peak_tflops(r.point.dtype, r.point.activations)
        floor = r.cost.floor_us(gpu.bandwidth_gbs, peak)  # datasheet rates: a lower bound
        failed = sum(n for s, n in r.statuses.items() if s not in ("ok", "infeasible"))
        t.add_row(r.point.label, _config_str(r.winner, r.point.kernel), _fmt(r.time_us, ".2f"),
                  _fmt(r.default_us, ".2f"), _fmt(r.speedup, ".2f") + ("×" if r.speedup else ""),
                  _fmt(floor, ".2f"), _fmt(gbs, ".0f"), _fmt(pct, ".0f"), str(r.n_evaluated),
                  str(failed))
    console.print(t)
    for r in results:
        _print_retime_failures(r, console)


def _print_retime_failures(result: Any, out: Console) -> None:
    """Finalists left out of the winner's choice because their re-timing failed, and why."""
    for key, why in result.retime_failed.items():
        out.print(f"[yellow]{result.point.label}: re-timing the finalist {key} failed, so it "
                  f"was not chosen: {why}[/yellow]")


@main.command()
@click.option("--model", default=None,
              help="A preset (llama-3-8b, qwen2.5-7b, ...) or a Hugging Face model directory or "
                   "its config.json.")
@click.option("--points", "points_file", type=click.Path(dir_okay=False), default=None,
              help="Instead of --model: the points a file names (a table, or `points: [...]` "
                   "as `search --points` reads), of any kernel, your own included "
                   "(package.module:name, or its registered name, in --kernel).")
@click.option("--kernel", "-k", default="all", show_default=True,
              help="With --points: only this kernel's points.")
@click.option("--gpu", "gpu_name", default=None,
              help="The GPU whose tables answer (h100, h200, ...). Default: the first visible "
                   "GPU.")
@click.option("--dtype", default=None, help="Activation dtype. Default: the model's.")
@click.option("--weights", default=None,
              help="fp8-e4m3 or fp8-e5m2 for FP8 projections (default: the model's dtype).")
@click.option("--activations", type=click.Choice(("16bit", "fp8")), default="16bit",
              show_default=True, help="fp8: FP8 activations beside FP8 weights.")
@click.option("--rows", callback=int_list, default=None,
              help="Row counts (batch x sequence) to look up. Default: 1,4,16,64,256,1024,4096; "
                   "with --training 4096,8192,16384.")
@click.option("--training", is_flag=True,
              help="The kernels of the patched model's training path (rmsnorm and its "
                   "backward, rope and rope_bwd on q and on k, swiglu and swiglu_bwd) instead "
                   "of its inference path; 16-bit weights.")
@click.option("--tables", "table_paths", multiple=True, type=click.Path(dir_okay=False),
              help="Table files to read before the shipped tables (default: FUSETUNE_TABLES, "
                   "then the shipped ones).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def coverage(model: str | None, points_file: str | None, kernel: str, gpu_name: str | None,
             dtype: str | None, weights: str | None, activations: str,
             rows: list[int] | None, training: bool, table_paths: tuple[str, ...],
             as_json: bool) -> None:
    """Where each config of a patched model (or of a file's points) comes from on one GPU.

    For every kernel and dims that fusetune.patch launches in MODEL and every row count: exact
    (a table entry of those rows), rows (another row count of the same dims), nearby (carried
    over from the nearest tuned dims, checked against the GPU's limits) or default (the
    heuristic), with the speedup over the default that the entry recorded. An exact or rows
    entry marked marginal (its winner was not 1% faster than the default) is
    shown so: the point is tuned, and the default config runs there. A config that runs the
    kernel's unfused form (UNFUSED=1) is marked (unfused). With --points FILE instead of
    --model: the points the file names, of any kernel, your own included.
    """
    import json

    import fusetune
    from fusetune.coverage import coverage as model_coverage
    from fusetune.models import TRAINING_ROWS, load_model
    from fusetune.spec import point_activations, point_weights

    if (model is None) == (points_file is None):
        raise click.UsageError("give --model (a model's points) or --points FILE")
    if points_file is not None:
        given = [o for o, v in (("--dtype", dtype), ("--weights", weights), ("--rows", rows))
                 if v is not None] + (["--training"] if training else [])
        if given:
            raise click.UsageError(f"--points names the points itself: leave out "
                                   f"{', '.join(given)}")
        _points_coverage(points_file, kernel, gpu_name, table_paths, as_json)
        return
    assert model is not None
    if training and (weights is not None or activations != "16bit"):
        raise click.UsageError("--training: the training path runs 16-bit weights; leave out "
                               "--weights and --activations")
    if rows is None:
        rows = list(TRAINING_ROWS) if training else [1, 4, 16, 64, 256, 1024, 4096]
    try:
        m = load_model(model)
        gpu = _tables_gpu(gpu_name)
        d = dtype or m.dtype
        w = "" if weights is None else point_weights(weights, d)
        a = point_activations(activations, w)
        if table_paths:
            fusetune.load_tables(*table_paths)
        report = model_coverage(m, gpu, d, w, a, rows, training)
    except (ValueError, fusetune.TableError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in report], indent=1))
        return
    t = Table(title=f"Configs of {m.name}{' (training)' if training else ''} on {gpu}, {d}"
              + (f", weights {w}" if w else "") + (f", {a} activations" if a else ""))
    for col in ("kernel", "use", "dims", "rows", "source", "from", "recorded speedup"):
        t.add_column(col, overflow="fold")
    for r in report:
        origin = "-"
        if r.source == "nearby" and r.tuned_dims is not None:
            origin = ",".join(f"{k}={v}" for k, v in r.tuned_dims.items()) + f" @ {r.tuned_rows}"
        elif r.tuned_rows is not None:
            origin = f"rows {r.tuned_rows}" + (f" ({MARGINAL_NOTE})" if r.marginal else "")
        t.add_row(r.kernel, r.use, ",".join(f"{k}={v}" for k, v in r.dims.items()), str(r.rows),
                  r.source + (" (unfused)" if r.unfused else ""), origin,
                  _fmt(r.speedup, ".2f") + ("×" if r.speedup else ""))
    console.print(t)
    counts = {s: sum(1 for r in report if r.source == s)
              for s in ("exact", "rows", "nearby", "default")}
    marginal = sum(1 for r in report if r.marginal)
    console.print("; ".join(f"{n} {s}" for s, n in counts.items())
                  + (f" ({marginal} of the exact and rows {MARGINAL_NOTE})"
                     if marginal else ""))
    if counts["default"]:
        untuned = list(dict.fromkeys(r.rows for r in report if r.source == "default"))
        command = _tune_command(model, gpu, untuned, training, dtype, weights, activations)
        console.print(f"The {counts['default']} default points have no tuned config on {gpu}: "
                      f"tune them with `{command}`, then `fusetune export TABLE` and read it "
                      "with --tables (or FUSETUNE_TABLES).", soft_wrap=True, markup=False)


def _tables_gpu(gpu_name: str | None) -> str:
    """The GPU whose tables `coverage` reads: --gpu's canonical name, else the first visible
    GPU's (a ClickException where none is)."""
    from fusetune import gpus

    if gpu_name is None:
        visible = gpus.visible_gpus()
        if not visible:
            raise click.ClickException("no GPU is visible: name the GPU whose tables to read "
                                       "with --gpu (h100, h200, ...)")
        return visible[0].spec.name
    return gpus.resolve(gpu_name).name


def _points_coverage(path: str, kernel: str, gpu_name: str | None, table_paths: tuple[str, ...],
                     as_json: bool) -> None:
    """`coverage --points FILE`: the lookup's answer at every point of the file, on one GPU."""
    import json

    import fusetune
    from fusetune.runtime import resolve
    from fusetune.tuner.point_file import load_points

    try:
        gpu = _tables_gpu(gpu_name)
        if table_paths:
            fusetune.load_tables(*table_paths)
        found = []
        for spec, points in load_points(path, gpu, kernel):
            for p in points:
                res = resolve(spec, p.dim, p.dtype, rows=p.rows, weights=p.weights,
                              activations=p.activations, gpu=gpu, warn=False)
                found.append((spec, p, res))
    except (SearchError, ValueError, fusetune.TableError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps([{"kernel": p.kernel, "dims": p.dim, "rows": p.rows,
                                "dtype": p.dtype, "weights": p.weights,
                                "activations": p.activations, "source": r.source,
                                "speedup": r.speedup, "marginal": r.marginal}
                               for _, p, r in found], indent=1))
        return
    t = Table(title=f"Configs of the points of {path} on {gpu}")
    for col in ("kernel", "dims", "rows", "dtype", "source", "recorded speedup"):
        t.add_column(col, overflow="fold")
    for _, p, r in found:
        dtype = p.dtype + (f" w={p.weights}" if p.weights else "") + (
            f" a={p.activations}" if p.activations else "")
        t.add_row(p.kernel, p.dims_label, str(p.rows), dtype,
                  r.source + (f" ({MARGINAL_NOTE})" if r.marginal else "")
                  + (" (unfused)" if r.config.get("UNFUSED") else ""),
                  _fmt(r.speedup, ".2f") + ("×" if r.speedup else ""))
    console.print(t)
    counts = {s: sum(1 for _, _, r in found if r.source == s)
              for s in ("exact", "rows", "nearby", "default")}
    console.print("; ".join(f"{n} {s}" for s, n in counts.items()))
    if counts["default"]:
        refs = sorted({spec.search_ref for spec, _, r in found if r.source == "default"})
        console.print(f"The {counts['default']} default points have no tuned config on {gpu}: "
                      f"tune them with `fusetune search --kernel {refs[0]} --points {path} "
                      f"--gpu {gpu}` (each kernel: {', '.join(refs)}), then `fusetune export "
                      "TABLE`.", soft_wrap=True, markup=False)


def _tune_command(model: str, gpu: str, rows: Sequence[int], training: bool, dtype: str | None,
                  weights: str | None, activations: str) -> str:
    """The `fusetune search` command that tunes the kernels of `model`'s path (inference, or
    `training`) on `gpu` at `rows`, with coverage's --dtype, --weights and --activations."""
    target = ["--backend", "interpreter"] if gpu == "interpreter" else ["--gpu", gpu]
    args = ["fusetune", "search", "--kernel", "training" if training else "all", "--model",
            model, *target, "--rows", ",".join(map(str, rows))]
    if dtype is not None:
        args += ["--dtype", dtype]
    if weights is not None:
        args += ["--weights", weights]
    if activations != "16bit":
        args += ["--activations", activations]
    return shlex.join(args)


@main.command("evaluate-search")
@one_kernel_point_options
@click.option("--grid/--no-grid", "run_grid", default=True, show_default=True,
              help="First time every distinct feasible config of each point that the database "
                   "does not hold yet (resumable). --no-grid replays what is stored: no GPU "
                   "needed, e.g. on a copy of the GPU machine's database.")
@click.option("--seeds", type=click.IntRange(min=1), default=10, show_default=True,
              help="Replays per strategy (sampler seeds 0..N-1).")
@click.option("--strategies", callback=str_list, default=None,
              help="Comma-separated: random, tpe, gp, fusetune (what `fusetune search` does "
                   "one config at a time: start configs, a climb through their neighbours, "
                   "then TPE), fusetune-batch (what it does with --compile-workers: a few "
                   "configs asked at a time), fusetune-tpe (fusetune without the climb), "
                   "fusetune-cold (its sampler alone). "
                   "Default: random,tpe,gp,fusetune,fusetune-batch.")
@click.option("--budget", type=click.IntRange(min=1), default=None,
              help="Evaluations per replay. Default: the grid's size (every run can get there).")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the report as Markdown to this file.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the report, with every replay, as JSON to this file.")
def evaluate_search(args: PointArgs, run_grid: bool, seeds: int, strategies: list[str] | None,
                    budget: int | None, markdown_path: str | None, json_path: str | None
                    ) -> None:
    """How many evaluations search strategies need to come within 2% of the best config.

    \b
    1. The exhaustive grid (--grid): every distinct config of the space that the GPU can hold,
       timed once through the search's evaluator and stored in --db like a search's results.
       Configs the database already holds for the point are not timed again.
    2. Replays, no GPU needed: each strategy samples configs one at a time from the stored
       timings (pruned configs cost nothing, failed ones cost an evaluation), for each seed;
       the table gives the evaluations until the best so far is within 2% (5%, 10%) of the
       grid's optimum.
    """
    target = (_target(args.backend, args.gpu_name, dry_run=False) if run_grid
              else _replay_target(args.backend, args.gpu_name))
    if args.kernel in MODEL_KERNELS:  # after the target: the kernels load for its backend
        from fusetune.kernels import REGISTRY

        raise click.BadParameter(
            f"{args.kernel!r}: evaluate-search measures one kernel's points; give one of "
            f"{', '.join(sorted(REGISTRY))} (`fusetune search --kernel {args.kernel}` tunes "
            "the kernels of a model)", param_hint="'--kernel'")
    chosen, skipped = _choose_strategies(strategies)
    spec, space, points = _resolve_points(args, target,
                                          target.backend == "interpreter" and run_grid)
    store, storage = _open_store(args.db)
    if run_grid:
        rows = _run_grids(spec, space, points, target, args)
    else:
        backend = None if args.backend == "auto" else args.backend
        rows = [_stored_point(store, target.gpu.name, p, backend) for p in points]

    from fusetune.tuner.grid import GridError, load_grid
    from fusetune.tuner.replay import replay_strategies
    from fusetune.tuner.replay_report import PointReport, header_lines, rich_table, write_reports

    reports = []
    for row in rows:
        grid = load_grid(store, storage, row, spec, space)
        try:
            grid.require_complete(spec.source_hash)
            with _progress() as progress:
                tasks = {s.name: progress.add_task(s.name, total=seeds, msg="") for s in chosen}

                def update(name: str, done: int, tasks: dict[str, Any] = tasks) -> None:
                    progress.update(tasks[name], completed=done)

                summaries = replay_strategies(grid, space, spec, chosen, seeds, budget, update)
            report = PointReport(grid, summaries, row.gpu, row.backend, skipped)
            for line in header_lines(report):
                console.print(line)
            console.print(rich_table(report))
        except GridError as e:
            raise click.ClickException(str(e)) from None
        reports.append(report)
    for path in write_reports(reports, markdown_path, json_path):
        console.print(f"wrote {path}")


def _replay_target(backend: str, gpu_name: str | None) -> Target:
    """The GPU whose stored points are replayed; no device needed."""
    from fusetune import gpus as g

    if backend == "interpreter":
        return Target("interpreter", g.INTERPRETER, "none")
    if gpu_name:
        try:
            return Target("cuda", g.resolve(gpu_name), "none")
        except g.UnknownGpuError as e:
            raise click.ClickException(str(e)) from None
    visible = g.visible_gpus()
    if visible:
        return Target("cuda", visible[0].spec, "none")
    err.print("[yellow]note:[/] no --gpu given and no GPU visible: replaying the interpreter's "
              "points")
    return Target("interpreter", g.INTERPRETER, "none")


def _choose_strategies(names: list[str] | None) -> tuple[list[Any], dict[str, str]]:
    """The strategies to replay, and those skipped because a module they need is missing."""
    from fusetune.tuner.sampling import DEFAULT_STRATEGIES, get_strategy

    chosen, skipped = [], {}
    for name in dict.fromkeys(names or DEFAULT_STRATEGIES):
        try:
            strategy = get_strategy(name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="'--strategies'") from None
        missing = strategy.missing()
        if missing:
            skipped[name] = (f"needs {', '.join(missing)}, not installed "
                             f"(pip install {' '.join(missing)})")
            err.print(f"[yellow]note:[/] {name} skipped: {skipped[name]}")
            continue
        chosen.append(strategy)
    if not chosen:
        raise click.ClickException("no strategy left to replay: " + "; ".join(
            f"{n} {why}" for n, why in skipped.items()))
    return chosen, skipped


def _stored_point(store: Any, gpu: str, point: Any, backend: str | None) -> Any:
    from fusetune.tuner.grid import GridError, stored_point

    try:
        row, note = stored_point(store, gpu, point, backend)
    except GridError as e:
        raise click.ClickException(str(e)) from None
    if note:
        err.print(f"[yellow]note:[/] {note}")
    return row


def _run_grids(spec: Any, space: Any, points: Sequence[Any], target: Target,
               args: PointArgs) -> list[Any]:
    """Runs (or resumes) each point's grid; returns the points' stored rows."""
    from fusetune.tuner.bench import DeviceLostError
    from fusetune.tuner.grid import run_grid
    from fusetune.tuner.study import PointTuner, SearchOptions

    ctx = _open_context(spec, space, target, args.db, args.worker_timeout,
                        compile_workers=_compile_workers(args, target),
                        compile_timeout=args.trial_timeout)
    n = ctx.compiler.stats.workers if ctx.compiler is not None else 0
    console.print(f"Exhaustive grid of {spec.name} on {target.gpu.name} ({target.device}, "
                  f"{target.backend}) into {args.db}: {len(points)} points"
                  + (f"; {n} processes compile ahead." if n else "."))
    rows, runs = [], []
    try:
        with _progress() as progress:
            for p in points:
                tuner = PointTuner(ctx, p, SearchOptions(), exhaustive=True)
                task = progress.add_task(p.label, total=len(tuner.plan.feasible),
                                         msg=f"{len(tuner.plan.infeasible)} pruned")

                def update(done: int, total: int, msg: str, task: Any = task) -> None:
                    progress.update(task, completed=done, total=total, msg=msg)

                run = run_grid(tuner, update)
                runs.append(run)
                res = run.result
                ahead = f", {run.compiled_ahead} compiled ahead" if ctx.compiler else ""
                progress.update(task, msg=f"{run.timed} timed in {run.wall_s:.0f} s (compiling "
                                          f"{run.compile_s:.0f} s{ahead}); winner "
                                          f"{_fmt(res.time_us if res else None, '.2f')} µs")
                rows.append(ctx.store.point(tuner.point_id))
                if res is not None:
                    _print_retime_failures(res, err)
    except KeyboardInterrupt:
        err.print(f"\n[yellow]interrupted[/]: every timed config is stored in {args.db}; run "
                  "the same command again to resume the grid.")
        sys.exit(130)
    except DeviceLostError as e:
        err.print(f"\n[red]error:[/] the GPU context is lost ({e}). That config is recorded as "
                  "crashed; run the same command again to continue (or use --isolate).")
        sys.exit(1)
    finally:
        ctx.close()
    _print_compile_time(sum(r.timed for r in runs), sum(r.compile_s for r in runs),
                        sum(r.compiled_ahead for r in runs),
                        ctx.compiler.stats if ctx.compiler is not None else None)
    return rows


def _gpu_filter(name: str | None, store: Any) -> str | None:
    """The GPU of --gpu as the database names it: a catalogue GPU by its canonical name, a GPU
    outside the catalogue by its device name's slug (what a search on it stored). A catalogue
    GPU the database holds no points of under its canonical name, but under its device name's
    slug (measured before the catalogue had it), by that slug."""
    from fusetune.tables import canonical_gpu

    if not name:
        return None
    stored = store.gpus()
    try:
        gpu = canonical_gpu(name, stored)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if gpu not in stored:
        for other in stored:
            try:
                if canonical_gpu(other) == gpu:
                    return str(other)
            except ValueError:  # a GPU outside the catalogue
                continue
    return gpu


def _kernel_filter(kernel: str | None, store: Any) -> str | None:
    """--kernel of show and export: a kernel the database holds points of (a kernel this
    version may no longer have), else one that search takes (get_spec's check: a ClickException
    naming the valid kernels otherwise)."""
    if kernel is None:
        return None
    stored = sorted({p.kernel for p in store.points()})
    if kernel in stored:
        return kernel
    from fusetune.kernels import REGISTRY, get_spec

    try:
        name = get_spec(kernel).name  # "package.module:name" of a kernel of one's own: its name
    except ValueError as e:
        retired = [k for k in stored if k not in REGISTRY]
        raise click.ClickException(
            str(e) + (f"; or one that {_shown(store.url)} holds: {', '.join(retired)}"
                      if retired else "")) from None
    return name


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--gpu", "gpu_name", default=None, help="Only this GPU (name or alias).")
@click.option("--kernel", "-k", default=None, help="Only this kernel.")
@click.option("--db", "--storage", "db", default=DEFAULT_DB, show_default=True,
              help="Database URL (sqlite:///..., postgresql://...).")
@click.option("--update", is_flag=True,
              help="PATH is an existing table: put the database's winners into it (each "
                   "replaces the entries of the same lookup key: GPU, kernel, dims, dtype, "
                   "weights, activations, rows = batch x seq whatever the split) and keep its "
                   "other entries, instead of writing a new table.")
def export(path: str, gpu_name: str | None, kernel: str | None, db: str, update: bool) -> None:
    """Write the winners in the database to the lookup table PATH (YAML).

    Each entry's time_us and default_us are the winner's and the default heuristic's config's
    medians in the interleaved re-timing that picked the winner; p20_us, p80_us (and
    default_p20_us, default_p80_us) the 20th and 80th percentiles of the config's first
    timing, written where they bracket that median. `marginal`: the winner's median is less
    than 1% below the default's (GPU timings only), so the lookup runs the default there.
    """
    from fusetune.export import build_tables, update_tables
    from fusetune.tables import TableError

    if update and not Path(path).is_file():
        raise click.ClickException(f"--update: {path} does not exist (leave out --update to "
                                   "write a new table)")
    store = _store(db)
    gpu = _gpu_filter(gpu_name, store)
    kernel = _kernel_filter(kernel, store)
    doc = build_tables(store, gpu=gpu, kernel=kernel)
    if not doc["gpus"]:
        raise click.ClickException(
            f"no winners in {_shown(db)}" + (f" for gpu={gpu}" if gpu else "")
            + (f" kernel={kernel}" if kernel else "") + ": run `fusetune search` first")
    if not update:
        n = _write(doc, path)
        console.print(f"wrote {n} entries for {', '.join(doc['gpus'])} to {path}")
        return
    try:
        doc, done = update_tables(Path(path).read_text(), path, doc)
    except TableError as e:
        raise click.ClickException(f"--update: {e}") from None
    except OSError as e:
        raise click.ClickException(f"--update: cannot read {path}: {_os_error(e)}") from None
    n = _write(doc, path)
    console.print(f"updated {path}: {done.replaced} entries replaced, {done.added} added, "
                  f"{done.kept} kept ({n} in all)")


def _is_dir(path: Path) -> bool | None:
    """Whether `path` is a directory; None where that cannot be told (no permission to look)."""
    try:
        return path.is_dir()
    except OSError:
        return None


def _os_error(e: OSError, writing: bool = False) -> str:
    """Why reading or (`writing`) writing a file failed: the directory at fault (missing, not a
    directory, or one that takes no new file), else the system's words."""
    if not e.filename:
        return e.strerror or str(e)
    folder = Path(e.filename).parent
    if isinstance(e, NotADirectoryError):
        return f"{str(folder)!r} is not a directory"
    is_dir = _is_dir(folder)
    if isinstance(e, FileNotFoundError) and is_dir is False:
        return f"directory {str(folder)!r} does not exist"
    if writing and is_dir:
        # A directory that exists and refuses the file (permissions, a read-only or virtual
        # file system such as /proc); the system's words unless they would say "no such file".
        why = "" if isinstance(e, FileNotFoundError) or not e.strerror else f" ({e.strerror})"
        return f"directory {str(folder)!r} cannot be written{why}"
    return e.strerror or str(e)


def _write(doc: dict[str, Any], path: str) -> int:
    """write_tables, or a one-line error naming the file and why it cannot be written."""
    from fusetune.export import write_tables
    from fusetune.tables import TableError

    try:
        return write_tables(doc, path)
    except OSError as e:
        raise click.ClickException(f"cannot write {path}: {_os_error(e, writing=True)}") from None
    except TableError as e:  # a table the runtime would refuse is not written
        raise click.ClickException(f"not writing {path}: {e}") from None


@main.command()
@click.option("--db", "--storage", "db", default=DEFAULT_DB, show_default=True,
              help="Database URL (sqlite:///..., postgresql://...).")
@click.option("--gpu", "gpu_name", default=None, help="Only this GPU.")
@click.option("--kernel", "-k", default=None, help="Only this kernel.")
@click.option("--point", "point_id", type=int, default=None,
              help="One point (its id in the listing): its fastest configs and why the others "
                   "failed.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="How many configs --point lists.")
def show(db: str, gpu_name: str | None, kernel: str | None, point_id: int | None,
         top: int) -> None:
    """Print what the database holds: points, results by status, winners."""
    if point_id is not None:
        _show_point(_store(db), point_id, top)
        return

    store = _store(db)
    gpu = _gpu_filter(gpu_name, store)
    kernel = _kernel_filter(kernel, store)
    winners = {p.id: w for p, w in store.winners(gpu=gpu, kernel=kernel)}
    cols = ("id", "gpu", "kernel", "dims", "b", "s", "dtype", "weights", "backend", "triton",
            "results", "winner", "µs", "default µs", "speedup")
    rows: list[tuple[str, ...]] = []
    for p in store.points():
        if (gpu and p.gpu != gpu) or (kernel and p.kernel != kernel):
            continue
        counts = store.status_counts(p.id)
        w = winners.get(p.id)
        speed = w.default_us / w.time_us if w and w.default_us else None
        rows.append((str(p.id), p.gpu, p.kernel, p.dims, str(p.batch), str(p.seq), p.dtype,
                     _numerics(p), p.backend, p.triton_version,
                     " ".join(f"{k}:{v}" for k, v in sorted(counts.items())),
                     _config_str(w.config if w else None, p.kernel),
                     _fmt(w.time_us if w else None, ".2f"),
                     _fmt(w.default_us if w else None, ".2f"), _fmt(speed, ".2f")))
    if not rows:
        console.print(f"{_shown(db)} holds no points"
                      + (" matching the filters" if gpu or kernel else ""))
        return
    # gpu, backend and triton shared by every point go to the title: room for the winners.
    same = [i for i, c in enumerate(cols)
            if c in ("gpu", "backend", "triton") and len({r[i] for r in rows}) == 1]
    shared = ", ".join(f"{cols[i]} {rows[0][i]}" for i in same)
    t = Table(title=f"Points in {_shown(db)}" + (f" ({shared})" if shared else ""))
    keep = [i for i in range(len(cols)) if i not in same]
    # Long values wrap, never cut; the winner column fits its longest KEY=VALUE.
    winner = cols.index("winner")
    widest = max((len(kv) for r in rows for kv in r[winner].split()), default=1)
    for i in keep:
        t.add_column(cols[i], overflow="fold",
                     min_width=widest if i == winner else None)
    for r in rows:
        t.add_row(*(r[i] for i in keep))
    console.print(t)


def _show_point(store: Any, point_id: int, top: int) -> None:
    p = store.point(point_id)
    if p is None:
        ids = [str(q.id) for q in store.points()]
        raise click.ClickException(f"no point {point_id} in {store.url}; points: "
                                   f"{', '.join(ids) or 'none'} (see `fusetune show`)")
    counts = store.status_counts(p.id)
    weights = f" weights {_numerics(p)}" if p.weights else ""
    console.print(f"Point {p.id}: {p.kernel} {p.dims} b={p.batch} s={p.seq} {p.dtype}{weights} "
                  f"on {p.gpu} "
                  f"({p.backend}, Triton {p.triton_version}, torch {p.torch_version}); results: "
                  + " ".join(f"{k}:{v}" for k, v in sorted(counts.items())))
    t = Table(title=f"Fastest {top} correct configs")
    for col in ("config", "p20 µs", "p50 µs", "p80 µs", "rel err", "compile s", "regs",
                "spills", "smem KB", "trial"):
        t.add_column(col, overflow="fold")  # long values wrap, never cut
    for r in store.top_results(p.id, top):
        t.add_row(_config_str(r.config, p.kernel), _fmt(r.p20_us, ".2f"), _fmt(r.time_us, ".2f"),
                  _fmt(r.p80_us, ".2f"), _fmt(r.rel_err, ".1e"), _fmt(r.compile_s, ".2f"),
                  _fmt(r.n_regs, "d"), _fmt(r.n_spills, "d"),
                  _fmt(None if r.smem_bytes is None else r.smem_bytes / 1024, ".1f"),
                  "-" if r.trial_number is None else str(r.trial_number))
    console.print(t)
    failures = store.failure_reasons(p.id)
    if failures:
        f = Table(title="Failed or pruned configs, by reason")
        for col in ("status", "reason", "configs"):
            f.add_column(col, overflow="fold")
        for status, reason, n in failures:
            f.add_row(status, reason, str(n))
        console.print(f)


if __name__ == "__main__":
    main()
