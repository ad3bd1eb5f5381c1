"""Every table entry of this GPU against the default heuristic, re-timed in one run: whether the
configs the tables hold still beat the default on this machine.

The entries are those the lookup reads for this GPU (--tables first, then the shipped tables;
an entry of one lookup key once), narrowed by --kernel, --model (the points fusetune.patch
launches in those models), --weights and --rows. For each entry, on its own point: the entry's
config and the default heuristic's are checked against the kernel's reference, then timed as
the search times them (do_bench with the L2 flushed; CUDA-graph replays where the kernels are
short), in interleaved rounds, each starting one config further on; a config under two names
(the entry is the default, or the unfused form) is timed once for both. Verdicts: `slower`
where the entry's median exceeds the default's by more than the larger of their p20-p80
spreads, `faster` where it is below by more, else `even`. Marginal entries (the lookup runs the
default there) are timed as well, their winner against the default. Beside them: the kernel's
unfused form (UNFUSED = 1: the norm, cuBLAS and the epilogue as separate launches; ffn, qkv and
linear) and torch.compile of the model's torch code (ffn, qkv, linear, lola, rmsnorm, rope,
swiglu; with the point's options, checked against the reference as the configs are), and
what the lookup serves against the best of the three ways (fused configs, unfused,
torch.compile). The exit status is 1 where an entry the lookup serves (not marginal)
is slower than the default, or a config fails. Configs compile first in parallel processes
(--jobs) into Triton's on-disk cache, which the timing process then loads. The timing runs in
a spawned process, with --devices one per GPU (the entries shared out over several GPUs of one
model; an entry and its default always on the same GPU): a process that dies (an illegal
memory access, a crash of the compiler or the driver) fails the entry it was on, with that
reason, and a new process goes on with the rest. --search-again FILE writes the entries a new
search could serve faster (a config it times ran more than 2% faster than the served one, a
marginal entry's faster winner, a failed config) as points for `fusetune search --points`.
Ctrl-C or SIGTERM (`timeout`'s signal, a job scheduler's stop) stops the timing: the entries
measured so far are reported, the rest counted as not measured; `--resume` with that run's
--json measures only the rest and reports all.

`--device cpu` runs the flow on Triton's interpreter (the interpreter's tables, small dims;
timings meaningless).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.script_args import doc_summary

ROUNDS = 3
WITHIN = 1.02  # served / min(fused, unfused, torch.compile) counted as no slower


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def stop_on_term() -> None:
    """SIGTERM (timeout's default signal, a job scheduler's stop) ends the run as Ctrl-C does:
    what was measured is reported. Each process installs it (spawned ones start without)."""
    signal.signal(signal.SIGTERM, _stop)


def ignore_stops() -> None:
    """After the first stop: a second (timeout signals the process, then its group) must not
    interrupt the report of what was measured."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@dataclass
class Entry:
    kernel: str
    dims: tuple[tuple[str, int], ...]
    dtype: str
    rows: int
    weights: str
    activations: str
    config: dict[str, int]
    marginal: bool
    default: dict[str, int] = field(default_factory=dict)
    times: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    measured: bool = False
    # Beside the entry and the default: the kernel's unfused form (UNFUSED = 1) where it has
    # one, and torch.compile of the model's torch code (where _eager has it), in µs.
    unfused: dict[str, int] | None = None
    compile_us: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        mode = "".join(f", {m}" for m in (self.weights, self.activations and
                                          f"{self.activations} activations") if m)
        dims = ",".join(f"{k}={v}" for k, v in self.dims)
        return f"{self.kernel} {dims}, {self.dtype}{mode}, {self.rows} rows"

    def point(self) -> Any:
        from fusetune.spec import Point

        return Point.make(self.kernel, dict(self.dims), self.rows, 1, self.dtype, self.weights,
                          self.activations)


def entries(gpu: str, kernels: list[str], model: str | None, weights: str | None,
            rows: set[int] | None) -> list[Entry]:
    """The entries the lookup reads for `gpu`, narrowed as the command line asks."""
    import fusetune
    from fusetune.kernels import get_spec
    from fusetune.models import load_model, patched_dims
    from fusetune.runtime import tuned_entries

    wanted: dict[str, list[tuple[tuple[str, int], ...]]] | None = None
    if model is not None:  # one or several, comma-separated
        wanted = {}
        for name in model.split(","):
            for k, ds in patched_dims(load_model(name)).items():
                wanted.setdefault(k, []).extend(tuple(sorted(d.items())) for d in ds)
    out: dict[tuple[Any, ...], Entry] = {}
    for kernel in kernels:
        spec = get_spec(kernel)
        if wanted is not None and kernel not in wanted:
            continue
        formats = ["", *spec.weight_formats]
        for w in formats:
            if weights is not None and w != weights:
                continue
            for a in ("", *spec.activation_modes) if w else ("",):  # modes of FP8 weights
                for dims, dtype, r, config in tuned_entries(spec, gpu, w, a):
                    key = (kernel, dims, dtype, w, a, r)
                    if key in out or (rows is not None and r not in rows) or (
                            wanted is not None and dims not in wanted[kernel]):
                        continue  # a key's first entry is the one the lookup reads
                    res = fusetune.resolve(kernel, dict(dims), dtype, rows=r, weights=w,
                                           activations=a, gpu=gpu, warn=False)
                    out[key] = Entry(kernel, dims, dtype, r, w, a, dict(config),
                                     res.source == "exact" and res.marginal)
    return list(out.values())


def _compiled_afresh(eager: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    """torch.compile of an entry's torch code (timing.compile_static) with dynamo's caches
    emptied first: one process meets hundreds of shapes of the same function, each entry's
    compiled on its own."""
    import torch

    from benchmarks.timing import compile_static

    torch._dynamo.reset()
    return compile_static(eager)


def _compile(kernel: str, point: Any, configs: list[dict[str, int]], device: str
             ) -> list[str]:
    """In a compile process: each config of `point` compiled into Triton's cache (not run),
    then torch.compile's column warmed; the errors, one line each (the timing process reports
    them again as it checks)."""
    import torch

    from fusetune.kernels import get_spec
    from fusetune.tuner.compile_ahead import warmup_compiler

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    errors = []
    try:
        # the point's inputs on the device: beside the other processes' (large MoE experts)
        # they may not fit, and then the timing process compiles these configs itself
        compile_config = warmup_compiler(get_spec(kernel), point, device)
    except Exception as exc:
        return [f"inputs: {type(exc).__name__}: {exc}"]
    try:
        for c in configs:
            try:
                compile_config(c)
            except Exception as exc:  # reported by the check in the timing process
                errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        del compile_config  # the inputs, given back to the device for the other processes
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    eager = _compile_column(kernel, device)
    if eager is not None:
        # torch.compile of the model's code at this point, once: inductor's on-disk caches (its
        # graphs, their Triton kernels) then serve the timing process's compile of the entry,
        # which otherwise compiles every entry's shape itself, one after the other.
        import torch._inductor.config

        torch._inductor.config.compile_threads = 1  # the --jobs processes are the parallelism
        try:
            _compiled_afresh(eager)(get_spec(kernel).make_inputs(point, device))
        except Exception:  # the timing process compiles it itself and reports the error
            pass
        finally:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    return errors


def compile_all(todo: list[Entry], device: str, jobs: int) -> None:
    """Every entry's two configs compiled in `jobs` processes before anything is timed."""
    if jobs <= 0 or not device.startswith("cuda"):
        return
    t0 = time.perf_counter()
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_compile, e.kernel, e.point(), [e.config, e.default], device)
                   for e in todo]
        failed = sum(bool(f.result()) for f in futures)
    print(f"compiled {2 * len(todo)} configs in {jobs} processes: "
          f"{time.perf_counter() - t0:.0f} s ({failed} entries with a config that failed)",
          file=sys.stderr)


def _compile_column(kernel: str, device: str) -> Callable[[dict[str, Any]], Any] | None:
    """The torch code compiled and timed beside an entry on `device` (None: no column; on the
    interpreter none: inductor's CPU code against interpreted kernels is no comparison)."""
    return _eager(kernel) if device.startswith("cuda") else None


def _eager(kernel: str) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    """The model's own torch code for a kernel's inputs (make_inputs' names), its outputs named
    as the kernel's reference names them: the kernels' benchmarks' eager functions, FP8
    weights upcast with their scales first, as torch.compile gets them; None where there is
    none. Every option of a kernel's point (a residual, GeGLU's gate, q/k norms) is computed as
    the model computes it: the column is checked against the reference like any config."""
    import torch

    from benchmarks.bench_ffn import eager_ffn
    from benchmarks.bench_linear import eager_linear
    from benchmarks.bench_lola import eager_lola
    from benchmarks.bench_qkv import eager_qkv
    from benchmarks.bench_rmsnorm import eager_rmsnorm
    from benchmarks.bench_rope import hf_rope, llama_rope
    from benchmarks.bench_swiglu import eager_swiglu

    def w(inputs: dict[str, Any], name: str) -> Any:
        t, s = inputs[name], inputs.get(f"{name}_scale")
        return t if s is None else (t.to(inputs["x"].dtype) * s[:, None]).to(inputs["x"].dtype)

    def tables(i: dict[str, Any]) -> tuple[Any, Any, Any]:
        """(freqs_cis for interleaved pairs or None, cos, sin [B, S, 1, D]) of the inputs'
        tables, the forms the eager code takes."""
        cos, sin = i["cos"][:, :, None, :], i["sin"][:, :, None, :]
        if not i["interleaved"]:
            return None, cos, sin
        half = cos.shape[-1] // 2
        return torch.complex(cos[..., :half].float(), sin[..., :half].float()), cos, sin

    def rope(i: dict[str, Any]) -> Any:
        freqs_cis, cos, sin = tables(i)
        return hf_rope(i["x"], cos, sin) if freqs_cis is None else llama_rope(i["x"], freqs_cis)

    def qkv(i: dict[str, Any]) -> dict[str, Any]:
        q, k, v = eager_qkv(i["x"], i["rms_weight"], w(i, "wq"), w(i, "wk"), w(i, "wv"),
                            *tables(i), i["head_dim"], i.get("q_norm"), i.get("k_norm"),
                            i.get("qk_eps", 1e-6))
        return {"q": q, "k": k, "v": v}

    return {
        "ffn": lambda i: {"h": eager_ffn(i["x"], i["rms_weight"], w(i, "w1"), w(i, "w3"),
                                         i["eps"], i.get("activation", "silu"))},
        "linear": lambda i: {"y": eager_linear(i["x"], i["weight"], i.get("residual"),
                                               i.get("weight_scale"), i.get("bias"))},
        "lola": lambda i: {"y": eager_lola(i["x"], w(i, "weight"), i["bias"], i["eps"])},
        "qkv": qkv,
        "rmsnorm": lambda i: {"y": eager_rmsnorm(i["x"], i["weight"], i["eps"],
                                                 i.get("residual"))},
        "rope": lambda i: {"y": rope(i)},
        "swiglu": lambda i: {"y": eager_swiglu(i["a"], i["b"])},
    }.get(kernel)


def eager_error(kernel: str, inputs: dict[str, Any], outputs: dict[str, Any]) -> float:
    """The largest relative error of the torch code's outputs against the kernel's reference
    (float32 math) on the same inputs."""
    from fusetune.kernels import get_spec

    ref = get_spec(kernel).reference(inputs)
    return max(float((outputs[n].float() - r.float()).norm() / r.float().norm().clamp_min(1e-30))
               for n, r in ref.items())


def best(e: Entry) -> dict[str, float]:
    """The medians (µs) the entry is judged against: the best fused config timed (the entry's
    or the default's), the unfused form, torch.compile of the model's code."""
    fused = [median3(e.times[k])[1] for k in ("entry", "default")
             if e.times.get(k) and not (k == "entry" and e.config.get("UNFUSED"))]
    out = {"fused": min(fused)} if fused else {}
    if e.times.get("unfused"):
        out["unfused"] = median3(e.times["unfused"])[1]
    if e.compile_us:
        out["compile"] = statistics.median(e.compile_us)
    return out


def served_us(e: Entry) -> float:
    """What the lookup runs there: the entry's config, or the default's where it is marginal."""
    return median3(e.times["default" if e.marginal else "entry"])[1]


def search_again(e: Entry) -> str | None:
    """Why a new search of the entry's point could serve it faster, or None: its config
    failed here; a config the search times (the entry's, the default's, the unfused form)
    ran more than WITHIN faster than what the lookup serves; or the entry is marginal and its
    winner ran faster than the default beyond the spread. torch.compile is no candidate of a
    search, so it counts for none of these."""
    if not e.measured:
        return None
    if "entry" in e.failed:
        return f"failed: {e.failed['entry']}"
    if e.failed:
        return None
    b = best(e)
    candidates = [b[k] for k in ("fused", "unfused") if k in b]
    ratio = served_us(e) / min(candidates) if candidates else 1.0
    if ratio > WITHIN:
        return f"served {ratio:.3f}× the fastest config timed"
    if e.marginal and verdict(e) == "faster":
        return "marginal, its winner faster than the default"
    return None


def write_points(path: str, todo: list[Entry]) -> int:
    """The entries search_again picks, as a `points:` file for `fusetune search --points`
    (each with its reason as a comment); how many."""
    import yaml

    picked = [(e, why) for e in todo if (why := search_again(e))]
    lines = ["# bench_tables: entries a new search could serve faster "
             "(fusetune search -k all --points THIS_FILE --gpu G)", "points:"]
    for e, why in picked:
        point = {"kernel": e.kernel, "dims": dict(e.dims), "rows": e.rows, "dtype": e.dtype}
        point.update({k: v for k, v in (("weights", e.weights),
                                        ("activations", e.activations)) if v})
        flow = yaml.safe_dump(point, default_flow_style=True, sort_keys=False,
                              width=1 << 16).strip()  # one line, its reason beside it
        lines.append(f"- {flow}  # " + " ".join(why.split()))  # a comment: one line
    if not picked:
        lines[-1] = "points: []"
    Path(path).write_text("\n".join(lines) + "\n")
    return len(picked)


def verdict(e: Entry) -> str:
    if not e.measured:
        return "not measured"
    if e.failed:
        return "failed"
    (_, tuned, _), (_, default, _) = (median3(e.times["entry"]), median3(e.times["default"]))
    noise = max(spread(e.times["entry"]), spread(e.times["default"]))
    if tuned - default > noise:
        return "slower"
    return "faster" if default - tuned > noise else "even"


def median3(qs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Per quantile (p20, p50, p80), the median over the rounds."""
    p20, p50, p80 = (statistics.median(q[i] for q in qs) for i in range(3))
    return p20, p50, p80


def spread(qs: list[tuple[float, float, float]]) -> float:
    p20, _, p80 = median3(qs)
    return p80 - p20


def measure(todo: list[Entry], backend: str, device: str, rounds: int, rep_ms: int,
            sent: Callable[[int, Entry], None]) -> None:
    """Checks and times each entry's config and the default's, interleaved, point by point
    (one point's inputs on the device at a time); `sent(i, entry)` after each. Returns at an
    interrupt (KeyboardInterrupt): the entry being timed then and those after it are not sent."""
    try:
        for i, e in enumerate(todo):
            _measure_one(e, backend, device, rounds, rep_ms)
            print(f"[{device} {i + 1}/{len(todo)}] {e.label}: {verdict(e)}", file=sys.stderr)
            sent(i, e)
    except KeyboardInterrupt:
        ignore_stops()


def _measure_one(e: Entry, backend: str, device: str, rounds: int, rep_ms: int) -> None:
    """One entry on its own point; the point's inputs are freed when it returns."""
    from fusetune.kernels import get_spec
    from fusetune.tuner.bench import Evaluator, round_order
    from fusetune.tuner.space import config_key

    spec = get_spec(e.kernel)
    point = e.point()
    ev = Evaluator(spec, point, backend, device)
    configs = {"entry": e.config, "default": e.default}
    if spec.algorithm_keys and not point.fp8_activations:
        e.unfused = spec.canonical({**e.default, "UNFUSED": 1}, point)
        configs["unfused"] = e.unfused
    for name, c in configs.items():
        out = ev.check(c)
        if not out.ok:
            e.failed[name] = f"{out.status}: {out.reason}"
    eager = _compile_column(e.kernel, device)
    compiled: Callable[[], Any] | None = None
    if eager is not None and not e.failed:
        from triton.testing import do_bench

        compiled_fn, inputs = _compiled_afresh(eager), dict(ev.inputs)
        # compiles, outside the timing; a column computing something else is no comparison
        err = eager_error(e.kernel, inputs, compiled_fn(inputs))
        tol = spec.tolerance_for(point)
        if err <= tol:
            compiled = lambda: compiled_fn(inputs)
        else:  # reported as a failure; the configs are timed all the same
            e.failed["compile"] = f"wrong_result: relative error {err:.2e} > {tol:.1e}"
    if not set(configs) & set(e.failed):
        # A config under two names (the entry is the default, or the unfused form) is timed
        # once, its timings under both: two timings of one config differ by the run's noise,
        # and the better of the two is no measure of either.
        keys = {name: config_key(spec.canonical(c, point)) for name, c in configs.items()}
        timed: dict[str, list[tuple[float, float, float]]] = {}
        e.times = {name: timed.setdefault(k, []) for name, k in keys.items()}
        once: dict[str, str] = {}  # each config by its first name
        for name, k in keys.items():
            once.setdefault(k, name)
        order = list(once.items()) + ([("", "compile")] if compiled is not None else [])
        for r in range(rounds):
            # each config and torch.compile's code takes each place in the rounds
            for k, name in round_order(order, r):
                if compiled is not None and name == "compile":
                    e.compile_us.append(do_bench(compiled, rep=rep_ms,
                                                 return_mode="median") * 1e3)
                    continue
                q = ev.timing(configs[name], rep_ms)
                if not isinstance(q, tuple):
                    e.failed[name] = f"{q.status}: {q.reason}"
                    break
                timed[k].append(q)
            if set(configs) & set(e.failed):
                break
    e.measured = True


def _measure_child(todo: list[Entry], backend: str, device: str, rounds: int, rep_ms: int,
                   conn: Any) -> None:
    """A timing process: measures `todo` on `device`, sending each entry's result as it comes
    (what was measured survives the process), then None."""
    import torch

    stop_on_term()
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        measure(todo, backend, device, rounds, rep_ms,
                lambda i, e: conn.send((i, e.times, e.failed, e.compile_us, e.unfused)))
    except KeyboardInterrupt:  # before measuring began (still importing): nothing measured
        pass
    ignore_stops()  # a second interrupt must not lose the end
    conn.send(None)
    conn.close()


def measure_devices(todo: list[Entry], backend: str, devices: list[str], rounds: int,
                    rep_ms: int) -> bool:
    """measure() in timing processes (spawned), the entries dealt out over `devices`, one
    process each. A process that dies (a config's illegal memory access, a crash of the
    compiler or the driver) fails the entry it was measuring, with the reason, and a new one
    goes on with the rest of its share. False if interrupted; every process then reports what
    it measured."""
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    running: dict[Any, tuple[Any, str, list[int]]] = {}

    def start(device: str, indices: list[int]) -> None:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_measure_child, args=([todo[j] for j in indices], backend,
                                                        device, rounds, rep_ms, send))
        proc.start()
        send.close()
        running[recv] = (proc, device, indices)

    for k, device in enumerate(devices):
        share = list(range(k, len(todo), len(devices)))
        if share:
            start(device, share)
    interrupted = False
    while running:
        try:
            ready = wait(list(running))
        except KeyboardInterrupt:  # stop every process; each still reports what it measured
            interrupted = True
            ignore_stops()  # once is enough
            for proc, _, _ in running.values():
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGINT)
            continue
        for conn in ready:
            proc, device, indices = running[conn]
            try:
                message = conn.recv()
            except EOFError:
                message = EOFError
            if isinstance(message, tuple):
                i, times, failed, compile_us, unfused = message
                e = todo[indices[i]]
                e.times, e.failed, e.compile_us, e.unfused = times, failed, compile_us, unfused
                e.measured = True
                continue
            del running[conn]
            proc.join()
            rest = [j for j in indices if not todo[j].measured]
            if message is None or not rest or interrupted:
                continue
            # Died in the middle of its share: the entry it was on is the culprit.
            culprit = todo[rest[0]]
            culprit.failed = {"entry": f"crashed: the timing process on {device} died (exit "
                                       f"code {proc.exitcode}) checking or timing this entry "
                                       "or its default"}
            culprit.measured = True
            print(f"[{device}] {culprit.label}: {culprit.failed['entry']}; a new process "
                  "goes on", file=sys.stderr)
            if rest[1:]:
                start(device, rest[1:])
    return not interrupted and all(e.measured for e in todo)


def report(todo: list[Entry], gpu: Any, devices: list[str], markdown: str | None,
           json_path: str | None, again_path: str | None = None) -> int:
    import torch
    import triton

    name = (torch.cuda.get_device_name(devices[0]) if devices[0].startswith("cuda")
            else "Triton interpreter")
    many = f" ×{len(devices)} (entries shared out)" if len(devices) > 1 else ""
    lines = [f"GPU {name}{many} ({gpu.name}), torch {torch.__version__}, "
             f"Triton {triton.__version__}; µs: medians over the rounds of do_bench's p50 "
             "(L2 flushed); verdict against the larger p20-p80 spread of the two", "",
             "| entry | marginal | entry µs | default µs | entry / default | unfused µs | "
             "torch.compile µs | served / best | verdict |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    groups: dict[tuple[str, str], Counter[str]] = {}
    worst = 0.0  # the largest served / min(fused, unfused, torch.compile)
    ratios = 0  # entries with that ratio
    within = 0  # those within WITHIN of it
    for e in todo:
        v = verdict(e)
        groups.setdefault((e.kernel, e.weights or e.dtype), Counter())[v] += 1
        if not e.measured:
            lines.append(f"| {e.label} | {'yes' if e.marginal else ''} | – | – | – | – | – | – "
                         f"| {v} |")
            continue
        if e.failed:
            why = "; ".join(f"{k}: {w}" for k, w in e.failed.items())
            lines.append(f"| {e.label} | {'yes' if e.marginal else ''} | – | – | – | – | – | – "
                         f"| failed: {why} |")
            continue
        t, d = median3(e.times["entry"])[1], median3(e.times["default"])[1]
        shown = (f"{v} (the lookup runs the default)" if e.marginal and v == "slower" else
                 f"{v} (marginal: the lookup runs the default; search it again)"
                 if e.marginal and v == "faster" else v)
        b = best(e)
        unf, comp = b.get("unfused"), b.get("compile")
        ratio = served_us(e) / min(b.values())
        worst = max(worst, ratio)
        ratios, within = ratios + 1, within + (ratio <= WITHIN)
        lines.append(f"| {e.label} | {'yes' if e.marginal else ''} | {t:.2f} | {d:.2f} | "
                     f"{t / d:.3f} | {'–' if unf is None else f'{unf:.2f}'} | "
                     f"{'–' if comp is None else f'{comp:.2f}'} | {ratio:.3f} | {shown} |")
    lines += ["", "| kernel | weights | entries | faster | even | slower | failed | not measured |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    total: Counter[str] = Counter()
    for (kernel, w), c in sorted(groups.items()):
        total += c
        lines.append(f"| {kernel} | {w} | {sum(c.values())} | {c['faster']} | {c['even']} | "
                     f"{c['slower']} | {c['failed']} | {c['not measured']} |")
    lines.append(f"| all | | {sum(total.values())} | {total['faster']} | {total['even']} | "
                 f"{total['slower']} | {total['failed']} | {total['not measured']} |")
    # A marginal entry's winner never runs (the lookup serves the default there): slower, it
    # costs nothing. What fails the run: an entry the lookup serves that loses, or fails.
    served_slower = sum(verdict(e) == "slower" and not e.marginal for e in todo)
    # A marginal entry whose winner runs faster than the default beyond the spread here: the
    # search's timings judged it a tie, this run does not (a flag to look at, not a failure).
    unserved = sum(verdict(e) == "faster" and e.marginal for e in todo)
    lines += ["", f"{served_slower} entries the lookup serves are slower than the default; "
              f"{total['failed']} failed. Served against the best of the fused configs timed, "
              f"the unfused form and torch.compile (served / best): at most {worst:.3f}; "
              f"{within} of {ratios} within {WITHIN}."]
    if unserved:
        lines.append(f"{unserved} marginal entries' winners ran faster than the default here, "
                     "which the lookup runs there: search them again (`fusetune search "
                     "--points`; --search-again FILE writes them) to have the winner served.")
    if again_path:
        n = write_points(again_path, todo)
        lines.append(f"{n} entries a new search could serve faster (a config it times beat the "
                     f"served one by more than {WITHIN}×, a marginal entry's faster winner, a "
                     f"failed config) written to {again_path}: `fusetune search -k all "
                     f"--points {again_path} --gpu {gpu.name}`, then `fusetune export --update`.")
    text = "\n".join(lines)
    print(text)
    if markdown:
        Path(markdown).write_text(text + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps([_record(e, gpu.name) for e in todo], indent=1))
    return 1 if served_slower or total["failed"] else 0


def _record(e: Entry, gpu: str) -> dict[str, Any]:
    """An entry as --json writes it (and --resume reads it)."""
    return {"gpu": gpu, "kernel": e.kernel, "dims": dict(e.dims), "dtype": e.dtype,
            "rows": e.rows, "weights": e.weights, "activations": e.activations,
            "marginal": e.marginal, "config": e.config, "default_config": e.default,
            "times": e.times, "unfused_config": e.unfused, "compile_us": e.compile_us,
            "failed": e.failed, "verdict": verdict(e)}


# What makes a record the measurement of an entry (its lookup key, config and default), and
# what --resume takes from it.
SAME_ENTRY = ("kernel", "dims", "dtype", "rows", "weights", "activations", "config",
              "default_config")
RESUMED = (*SAME_ENTRY, "times", "failed", "compile_us", "unfused_config")


def _same_entry(record: dict[str, Any]) -> str:
    return json.dumps({k: record[k] for k in SAME_ENTRY}, sort_keys=True)


def resume(todo: list[Entry], path: str, gpu: str) -> int:
    """Takes each entry's results from an earlier run's --json where that run measured the
    same entry (lookup key, config and default) on this GPU model; returns how many (0 where
    the file does not exist yet). A run stopped by Ctrl-C, SIGTERM or a time limit goes on
    from there, and its report is that of one run."""
    if not Path(path).exists():  # the first of runs that go on from each other
        return 0
    try:
        records = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--resume {path}: not a bench_tables --json file ({exc})") from exc
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"--resume {path}: not a bench_tables --json file (a list of entries)")
    other = sorted({str(r.get("gpu", "an unnamed GPU")) for r in records} - {gpu})
    if other:
        raise ValueError(f"--resume {path}: measured on {', '.join(other)}, not {gpu}")
    done: dict[str, dict[str, Any]] = {}
    for i, r in enumerate(records):
        if r.get("verdict") == "not measured":
            continue
        missing = [f for f in RESUMED if f not in r]
        if missing:
            raise ValueError(f"--resume {path}: entry {i} is not a bench_tables entry (no "
                             f"{', '.join(missing)})")
        done[_same_entry(r)] = r
    n = 0
    for e in todo:
        r = done.get(_same_entry(_record(e, gpu)))
        if r is None:
            continue
        e.times = {k: [tuple(q) for q in qs] for k, qs in r["times"].items()}
        e.failed, e.compile_us, e.unfused = r["failed"], r["compile_us"], r["unfused_config"]
        e.measured, n = True, n + 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__ or ""))
    ap.add_argument("--tables", help="a table file read before the shipped tables")
    ap.add_argument("--kernel", default="all",
                    help="kernels, comma-separated (default: every kernel with entries)")
    ap.add_argument("--model", help="only the points fusetune.patch launches in these models "
                                    "(presets or Hugging Face config.json files, "
                                    "comma-separated)")
    ap.add_argument("--weights", help="only this weight format ('' for 16-bit, fp8-e4m3, ...)")
    ap.add_argument("--rows", help="only these row counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved timing rounds")
    ap.add_argument("--rep-ms", type=int, default=100,
                    help="do_bench's measuring time per config and round, ms (the search's: 100)")
    ap.add_argument("--jobs", type=int, default=8,
                    help="processes that compile the configs first (0: the timing process "
                         "compiles each as it checks it)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the flow on Triton's interpreter (set TRITON_INTERPRET=1)")
    ap.add_argument("--devices", help="CUDA devices to share the entries out over: all, or "
                                      "indices such as 0,1 (one GPU model; default: the "
                                      "current device)")
    ap.add_argument("--markdown", help="write the table here too")
    ap.add_argument("--json", help="write every entry's timings here")
    ap.add_argument("--search-again", metavar="FILE",
                    help="write the entries a new search could serve faster here, as a points "
                         "file for `fusetune search --points` (a config the search times beat "
                         f"the served one by more than {WITHIN}×, a marginal entry's winner "
                         "ran faster than the default, or the entry's config failed)")
    ap.add_argument("--resume", metavar="JSON",
                    help="an earlier run's --json (may be --json's own file; none yet: "
                         "all measured): its measured entries are kept, the rest measured, "
                         "one report of all (a stopped run goes on)")
    args = ap.parse_args()
    stop_on_term()

    import fusetune
    from fusetune import gpus
    from fusetune.kernels import REGISTRY, get_spec
    from fusetune.tables import gpu_for_device

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        gpu, backend = gpu_for_device(torch.device("cuda")), "cuda"
        devices = [str(torch.device("cuda", torch.cuda.current_device()))]
        if args.devices is not None:
            try:
                chosen = gpus.select_devices(args.devices)
            except (ValueError, gpus.GpuNotFoundError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            gpu, devices = chosen[0].spec, [f"cuda:{g.index}" for g in chosen]
    else:
        if args.devices is not None:
            print("error: --devices selects CUDA devices; --device cpu runs on the interpreter",
                  file=sys.stderr)
            return 2
        devices = ["cpu"]
        gpu, backend = gpus.resolve("interpreter"), "interpreter"
    if args.tables:
        fusetune.load_tables(args.tables)
    kernels = list(REGISTRY) if args.kernel == "all" else args.kernel.split(",")
    try:
        for k in kernels:
            get_spec(k)  # an unknown name: the registry's error names the valid ones
        rows = None if args.rows is None else {int(r) for r in args.rows.split(",")}
        todo = entries(gpu.name, kernels, args.model, args.weights, rows)
    except ValueError as e:  # a bad kernel, model or row count: the message names it
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not todo:
        print(f"no table entries for {gpu.name} with these filters", file=sys.stderr)
        return 2
    for e in todo:
        spec, p = get_spec(e.kernel), e.point()
        e.default = dict(spec.canonical(spec.default_config(p, gpu), p))
    kept = 0
    if args.resume:
        try:
            kept = resume(todo, args.resume, gpu.name)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    left = [e for e in todo if not e.measured]
    print(f"{len(todo)} entries of {gpu.name}"
          + (f" ({kept} measured by {args.resume})" if args.resume else ""), file=sys.stderr)
    try:
        compile_all(left, devices[0], args.jobs)
    except KeyboardInterrupt:
        ignore_stops()
        print("interrupted while compiling: nothing measured", file=sys.stderr)
        return 130
    complete = not left or measure_devices(left, backend, devices, args.rounds, args.rep_ms)
    status = report(todo, gpu, devices, args.markdown, args.json, args.search_again)
    if not complete:
        print(f"interrupted: {sum(not e.measured for e in todo)} of {len(todo)} entries not "
              "measured", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
