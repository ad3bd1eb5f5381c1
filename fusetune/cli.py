"""The `fusetune` command: parses flags, delegates, prints."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from fusetune.tuner.search import (
    BACKEND_CHOICES,
    DEFAULT_GRID,
    INTERPRETER_GRID,
    Request,
    SearchError,
    choose_target,
    make_points,
    parse_dims,
)

DEFAULT_DB = "sqlite:///fusetune.db"
# Wide enough for the tables when output goes to a file or a CI log.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True, highlight=False)


def _int_list(_ctx: Any, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers, e.g. 1,16,64",
                                 param=param) from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter(f"{value!r}: expected positive integers", param=param)
    return out


def _str_list(_ctx: Any, _param: click.Parameter, value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def _dims(_ctx: Any, param: click.Parameter, value: str | None) -> dict[str, int] | None:
    if value is None:
        return None
    out: dict[str, int] = {}
    for part in value.split(","):
        name, _, num = part.partition("=")
        try:
            out[name.strip()] = int(num)
        except ValueError:
            raise click.BadParameter(f"{part!r}: expected name=integer, e.g. dim=4096",
                                     param=param) from None
    return out


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _config_str(config: dict[str, int] | None) -> str:
    return "-" if not config else " ".join(f"{k}={v}" for k, v in config.items())


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
                "GB/s", "fp16 TF/s", "bf16 TF/s", "visible"):
        t.add_column(col)
    for r in g.format_catalogue(visible):
        t.add_row(str(r["name"]), str(r["aliases"]), str(r["display"]), str(r["cc"]),
                  str(r["sms"]), str(r["smem_kb"]), str(r["regs"]), str(r["bandwidth_gbs"]),
                  str(r["fp16_tflops"]), str(r["bf16_tflops"]),
                  f"[bold green]{r['visible']}[/]" if r["visible"] else "")
    console.print(t)
    if not visible:
        console.print("No CUDA GPU is visible here: `fusetune search` would use the Triton "
                      "interpreter (--backend interpreter) or plan only (--dry-run --gpu NAME).")


@main.command()
@click.option("--kernel", "-k", required=True, help="Kernel to tune (rmsnorm, ...).")
@click.option("--gpu", "gpu_name", default=None,
              help="GPU the tables are for (3090, h100, a100-80gb; see `fusetune gpus`). Must be "
                   "a visible device, except with --dry-run. Default: the first visible GPU.")
@click.option("--model", default=None,
              help="Model preset for the dims (llama-2-7b, llama-3-8b, gpt2, ...). "
                   f"Default: {DEFAULT_GRID['model']}.")
@click.option("--dim", type=click.IntRange(min=1), default=None,
              help="Width of the normalized rows (instead of --model).")
@click.option("--dims", "dims_opt", callback=_dims, default=None,
              help="All dims as name=value,... (instead of --model).")
@click.option("--batch", callback=_int_list, default=None,
              help="Batch sizes, comma-separated. Default: "
                   f"{','.join(map(str, DEFAULT_GRID['batch']))}.")
@click.option("--seq", callback=_int_list, default=None,
              help="Sequence lengths (1 = decode). Default: "
                   f"{','.join(map(str, DEFAULT_GRID['seq']))}.")
@click.option("--dtype", callback=_str_list, default=None,
              help=f"Activation dtypes. Default: {','.join(DEFAULT_GRID['dtype'])}.")
@click.option("--trials", type=click.IntRange(min=1), default=40, show_default=True,
              help="Distinct configs evaluated per point (small spaces are enumerated).")
@click.option("--time-budget", type=click.FloatRange(min=0), default=None,
              help="Seconds of sampling per point (the finalists are still re-timed).")
@click.option("--db", default=DEFAULT_DB, show_default=True,
              help="Database URL for results and Optuna studies (sqlite:///..., postgresql://...).")
@click.option("--backend", type=click.Choice(BACKEND_CHOICES), default="auto", show_default=True,
              help="cuda, or Triton's CPU interpreter (meaningless timings; automatic when no GPU "
                   "is visible, with a smaller default grid).")
@click.option("--space", "space_path", type=click.Path(dir_okay=False), default=None,
              help="A search-space YAML to use instead of the kernel's own.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampler seed.")
@click.option("--isolate/--in-process", default=False, show_default=True,
              help="Run configs in a worker subprocess: a config that crashes or hangs is "
                   "recorded (crashed / timeout) and the worker restarted, the search goes on.")
@click.option("--trial-timeout", type=click.FloatRange(min=1), default=300, show_default=True,
              help="Seconds one config may take (compile, check and timing) with --isolate.")
@click.option("--dry-run", is_flag=True,
              help="Print the plan (points, space size, configs pruned by the GPU's limits and "
                   "why) without running anything; needs no GPU.")
def search(kernel: str, gpu_name: str | None, model: str | None, dim: int | None,
           dims_opt: dict[str, int] | None, batch: list[int] | None, seq: list[int] | None,
           dtype: list[str] | None, trials: int, time_budget: float | None, db: str,
           backend: str, space_path: str | None, seed: int, isolate: bool,
           trial_timeout: float, dry_run: bool) -> None:
    """Tune KERNEL at every (batch, seq, dtype) point: one Optuna study per point.

    Every evaluated config is stored with its status (ok, infeasible, oor, compile_error,
    runtime_error, wrong_result, crashed) and reason; each point's winner is re-timed beside the
    default heuristic. Interrupt at any time and run the same command again to resume: finished
    trials are kept and not redone.
    """
    try:
        target = choose_target(backend, gpu_name, dry_run)
    except (SearchError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    for note in target.notes:
        err.print(f"[yellow]warning:[/] {note}")

    from fusetune.kernels import get_spec
    from fusetune.tuner.space import SpaceError, load_space

    small = target.backend == "interpreter" and not dry_run
    grid = INTERPRETER_GRID if small else DEFAULT_GRID
    try:
        spec = get_spec(kernel)
        space = load_space(spec, space_path)
        if model is None and dim is None and dims_opt is None:
            model = grid["model"]
        dims = parse_dims(spec.dim_names, model, dim, dims_opt, spec.dims_from_model)
        req = Request(kernel, dims, batch or grid["batch"], seq or grid["seq"],
                      dtype or grid["dtype"])
        points = make_points(req)
    except (SearchError, SpaceError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if small and (batch is None or seq is None or model == grid["model"]):
        err.print(f"[yellow]note:[/] interpreter defaults: dims {dims}, batch {req.batches}, "
                  f"seq {req.seqs}, dtype {','.join(req.dtypes)}")

    if dry_run:
        _print_plan(spec, space, points, target, trials)
        return
    _run_search(spec, space, points, target, db, trials, time_budget, seed,
                trial_timeout if isolate else None)


def _print_plan(spec: Any, space: Any, points: Sequence[Any], target: Any, trials: int) -> None:
    from fusetune.tuner.space import make_plan

    gpu = target.gpu
    console.print(f"[bold]Plan[/] for {spec.name} on {gpu.name} ({gpu.display}): "
                  f"{len(points)} points; space {space.source}: {space.size} raw configs "
                  f"({' × '.join(f'{p.name}:{len(p.values)}' for p in space.params)})")
    console.print(f"Limits applied: {gpu.smem_per_block} B shared memory per block, "
                  f"{gpu.regs_per_thread} registers per thread, {gpu.max_threads_per_block} "
                  "threads per block.")
    t = Table()
    console.print(f"Points: dims {points[0].dims_label}; "
                  "'distinct' counts configs after merging those that compile to the same kernel.")
    for col in ("batch", "seq", "dtype", "rows", "distinct", "feasible", "pruned",
                "pruned because", "will try"):
        t.add_column(col)
    total_pruned = 0
    for p in points:
        plan = make_plan(space, spec, p, gpu)
        total_pruned += len(plan.infeasible)
        why = "; ".join(f"{n} {k}" for k, n in plan.pruned_reasons.most_common()) or "-"
        will = len(plan.feasible) if len(plan.feasible) <= trials else f"{trials} (sampled)"
        t.add_row(str(p.batch), str(p.seq), p.dtype, str(p.rows), str(plan.distinct),
                  str(len(plan.feasible)), str(len(plan.infeasible)), why, str(will))
    console.print(t)
    console.print(f"{total_pruned} configs pruned in all under {gpu.name}'s limits, before "
                  "compiling anything.")


def _run_search(spec: Any, space: Any, points: Sequence[Any], target: Any, db: str,
                trials: int, time_budget: float | None, seed: int,
                trial_timeout: float | None) -> None:
    import torch
    import triton
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fusetune.db.store import Store
    from fusetune.tuner.bench import DeviceLostError
    from fusetune.tuner.search import open_storage
    from fusetune.tuner.study import Context, PointTuner, SearchOptions

    try:
        store = Store(db)
        storage = open_storage(db)
    except Exception as e:
        raise click.ClickException(f"cannot open database {db!r}: {e}") from None
    from fusetune.tuner.worker import Worker

    worker = (Worker(spec.name, target.backend, target.device, trial_timeout)
              if trial_timeout is not None else None)
    ctx = Context(spec, space, target.gpu, target.backend, target.device, store, storage,
                  triton.__version__, torch.__version__, worker)
    options = SearchOptions(trials=trials, time_budget_s=time_budget, seed=seed)
    console.print(f"Tuning {spec.name} on {target.gpu.name} ({target.device}, {target.backend}) "
                  f"into {db}: {len(points)} points, up to {trials} configs each.")
    results = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[msg]}"), console=console,
                        transient=False)
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
        err.print(f"\n[yellow]interrupted[/]: every finished trial is stored in {db}; run the "
                  "same command again to resume.")
        sys.exit(130)
    except DeviceLostError as e:
        err.print(f"\n[red]error:[/] the GPU context is lost ({e}). That config is recorded as "
                  "crashed; run the same command again to continue (or use --isolate).")
        sys.exit(1)
    finally:
        if worker is not None:
            worker.close()
    _print_summary(results, target)


def _print_summary(results: Sequence[Any], target: Any) -> None:
    gpu = target.gpu
    t = Table(title=f"Winners on {gpu.name}" + (" (interpreter: timings meaningless)"
                                                if target.backend == "interpreter" else ""))
    for col in ("point", "winner", "µs", "default µs", "speedup", "floor µs", "GB/s", "% of BW",
                "evaluated", "failed"):
        t.add_column(col)
    for r in results:
        gbs = r.cost.bytes / (r.time_us * 1e3) if r.time_us else None
        pct = 100 * gbs / gpu.bandwidth_gbs if gbs and gpu.bandwidth_gbs else None
        peak = gpu.peak_bf16_tflops if r.point.dtype == "bfloat16" else gpu.peak_fp16_tflops
        floor = r.cost.floor_us(gpu.bandwidth_gbs, peak)  # datasheet rates: a lower bound
        failed = sum(n for s, n in r.statuses.items() if s not in ("ok", "infeasible"))
        t.add_row(r.point.label, _config_str(r.winner), _fmt(r.time_us, ".2f"),
                  _fmt(r.default_us, ".2f"), _fmt(r.speedup, ".2f") + ("×" if r.speedup else ""),
                  _fmt(floor, ".2f"), _fmt(gbs, ".0f"), _fmt(pct, ".0f"), str(r.n_evaluated),
                  str(failed))
    console.print(t)


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--gpu", "gpu_name", default=None, help="Only this GPU (name or alias).")
@click.option("--kernel", "-k", default=None, help="Only this kernel.")
@click.option("--db", default=DEFAULT_DB, show_default=True, help="Database URL.")
def export(path: str, gpu_name: str | None, kernel: str | None, db: str) -> None:
    """Write the winners in the database to the lookup table PATH (YAML)."""
    from fusetune import gpus as g
    from fusetune.db.store import Store
    from fusetune.export import build_tables, write_tables

    try:
        gpu = g.resolve(gpu_name).name if gpu_name else None
    except g.UnknownGpuError as e:
        raise click.ClickException(str(e)) from None
    doc = build_tables(Store(db), gpu=gpu, kernel=kernel)
    if not doc["gpus"]:
        raise click.ClickException(
            f"no winners in {db}" + (f" for gpu={gpu}" if gpu else "")
            + (f" kernel={kernel}" if kernel else "") + ": run `fusetune search` first")
    n = write_tables(doc, path)
    console.print(f"wrote {n} entries for {', '.join(doc['gpus'])} to {path}")


@main.command()
@click.option("--db", default=DEFAULT_DB, show_default=True, help="Database URL.")
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
    from fusetune import gpus as g
    from fusetune.db.store import Store

    if point_id is not None:
        _show_point(Store(db), point_id, top)
        return

    try:
        gpu = g.resolve(gpu_name).name if gpu_name else None
    except g.UnknownGpuError as e:
        raise click.ClickException(str(e)) from None
    store = Store(db)
    winners = {p.id: w for p, w in store.winners(gpu=gpu, kernel=kernel)}
    t = Table(title=f"Points in {db}")
    for col in ("id", "gpu", "kernel", "dims", "b", "s", "dtype", "backend", "triton",
                "results", "winner", "µs", "default µs", "speedup"):
        t.add_column(col)
    n = 0
    for p in store.points():
        if (gpu and p.gpu != gpu) or (kernel and p.kernel != kernel):
            continue
        n += 1
        counts = store.status_counts(p.id)
        w = winners.get(p.id)
        speed = w.default_us / w.time_us if w and w.default_us else None
        t.add_row(str(p.id), p.gpu, p.kernel, p.dims, str(p.batch), str(p.seq), p.dtype,
                  p.backend,
                  p.triton_version, " ".join(f"{k}:{v}" for k, v in sorted(counts.items())),
                  _config_str(w.config if w else None), _fmt(w.time_us if w else None, ".2f"),
                  _fmt(w.default_us if w else None, ".2f"), _fmt(speed, ".2f"))
    if n == 0:
        console.print(f"{db} holds no points" + (" matching the filters" if gpu or kernel else ""))
        return
    console.print(t)


def _show_point(store: Any, point_id: int, top: int) -> None:
    p = store.point(point_id)
    if p is None:
        ids = [str(q.id) for q in store.points()]
        raise click.ClickException(f"no point {point_id} in {store.url}; points: "
                                   f"{', '.join(ids) or 'none'} (see `fusetune show`)")
    counts = store.status_counts(p.id)
    console.print(f"Point {p.id}: {p.kernel} {p.dims} b={p.batch} s={p.seq} {p.dtype} on {p.gpu} "
                  f"({p.backend}, Triton {p.triton_version}, torch {p.torch_version}); results: "
                  + " ".join(f"{k}:{v}" for k, v in sorted(counts.items())))
    t = Table(title=f"Fastest {top} correct configs")
    for col in ("config", "p20 µs", "p50 µs", "p80 µs", "rel err", "compile s", "trial"):
        t.add_column(col)
    for r in store.top_results(p.id, top):
        t.add_row(_config_str(r.config), _fmt(r.p20_us, ".2f"), _fmt(r.time_us, ".2f"),
                  _fmt(r.p80_us, ".2f"), _fmt(r.rel_err, ".1e"), _fmt(r.compile_s, ".2f"),
                  "-" if r.trial_number is None else str(r.trial_number))
    console.print(t)
    failures = store.failure_reasons(p.id)
    if failures:
        f = Table(title="Failed or pruned configs, by reason")
        for col in ("status", "reason", "configs"):
            f.add_column(col)
        for status, reason, n in failures:
            f.add_row(status, reason, str(n))
        console.print(f)


if __name__ == "__main__":
    main()
