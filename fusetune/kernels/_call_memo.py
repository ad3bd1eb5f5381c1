"""What a launcher's checks and table lookup decided, kept per call signature.

A launcher checks its inputs (shapes, dtypes, devices, strides, eps, layout) and looks its
config up on every call; at decode sizes that Python costs more than the kernel takes on the
GPU. Both depend on nothing but the tensors' metadata and the call's other arguments (and the
loaded tables), so a launcher keeps the config it resolved under a key of exactly those, with
the replay of the call's launches (_replay), and a repeated call skips to the launch: `repeat`
on every call, `first` at the end of a call checked in full. A call with gradients enabled
is checked in full every time (whether an input requires grad is not part of the key).
`fusetune.runtime.reset` and `load_tables` clear every memo along with the lookup's own cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from fusetune.kernels._replay import record

T = TypeVar("T")

_MAX_ENTRIES = 1024  # per launcher: beyond it (a run of many shapes) the memo starts afresh
_memos: list[CallMemo] = []
_generation = 0  # counts clear_all calls: an entry decided before the last one is not kept


def tensor_key(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """The metadata a launcher's checks read from a tensor (None stays None)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


class CallMemo(dict):  # type: ignore[type-arg]
    """key -> what the checks and the lookup decided (a config, or a small plan)."""

    def __init__(self) -> None:
        super().__init__()
        _memos.append(self)

    @staticmethod
    def active(config: Any) -> bool:
        """Whether a call may use the memo: its config comes from the tables and no
        gradient can be asked for."""
        return config is None and not torch.is_grad_enabled()

    @staticmethod
    def generation() -> int:
        """Taken before a call's lookup and handed to `keep`: tables loaded (and the memos
        cleared) in between, by another thread, make the decision stale."""
        return _generation

    def repeat(self, key: tuple[Any, ...], inputs: Sequence[torch.Tensor | None],
               run: Callable[[Any], T]) -> T | None:
        """A call of `key` seen before: its launches replayed on `inputs` (_replay), or where
        it has no replay (or the replay declines) run(config) with the kept config. None for a
        key not seen yet: the caller checks the call in full and ends with `first`."""
        kept = self.get(key)
        if kept is None:
            return None
        config, plan = kept
        out = None if plan is None else plan.run(inputs)
        return out if out is not None else run(config)

    def first(self, key: tuple[Any, ...], inputs: Sequence[torch.Tensor | None], config: Any,
              since: int, run: Callable[[Any], T]) -> T:
        """run(config), a call of `key` checked in full, recorded: the config and the replay
        of its launches are kept (unless tables were loaded after `since`)."""
        out, plan = record(lambda: run(config), inputs)
        self.keep(key, (config, plan), since)
        return out

    def keep(self, key: tuple[Any, ...], value: Any, since: int) -> Any:
        if since != _generation:
            return value
        if len(self) >= _MAX_ENTRIES:
            self.clear()
        self[key] = value
        return value


def clear_all() -> None:
    global _generation
    _generation += 1
    for memo in _memos:
        memo.clear()
