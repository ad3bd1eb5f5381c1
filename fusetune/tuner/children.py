"""The tuner's child processes (benchmark workers, compile processes): how they start, and how
their deaths are told."""

from __future__ import annotations

import multiprocessing as mp
import signal


def start_child(proc: mp.process.BaseProcess) -> None:
    """Starts `proc` (a spawned process) with SIGINT blocked, as the child inherits it.

    Ctrl-C reaches every process of the terminal's group. A child ignores SIGINT once its loop
    runs (the parent stops it), but it spends its first seconds importing torch and Triton,
    where a Ctrl-C raised KeyboardInterrupt and printed a traceback from every process still
    starting. Blocked from the start, the signal stays pending in the child and is never
    delivered. The calling thread's mask is restored at once: a Ctrl-C meanwhile reaches it
    then."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: no process group gets the signal
        proc.start()
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def death(proc: mp.process.BaseProcess, what: str) -> str:
    """Why the child `what` ("the worker", "compile process") ended, from its exit code."""
    code = proc.exitcode
    if code is None:
        return f"{what} stopped answering"
    if code < 0:
        try:
            return f"{what} was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"{what} was killed by signal {-code}"
    return f"{what} exited with code {code}"
