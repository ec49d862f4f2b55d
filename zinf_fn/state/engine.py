"""The engine behind a state as a whole: its identity, what it moved and holds, the guards a save
installs, its flush and close (``EngineHandle``, one part of ``zinf_fn.state.StateView``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..observe import counters
from ..observe.counters import Counters
from ..runtime import Runtime
from ..store import Store
from ..train import TrainState


class EngineHandle:
    """The part of ``StateView`` over the engine as a whole: a key for caches across steps, its
    counters and idle buffers, the save guards run before a step changes a row, its flush and
    close. It reads the runtime and its store."""

    state: TrainState
    _runtime: Runtime
    _store: Store

    @property
    def identity(self) -> object:
        """One object per engine (the same for every state of a run): a key for caches kept across
        steps."""
        return self._store

    def counters(self) -> Counters:
        """The tiers' byte counters, the buffer pool, the write-behind and the fetcher, as they are
        now."""
        return counters.read(self._runtime)

    def idle_buffers(self) -> list[torch.Tensor]:
        """The staging buffers the pool holds idle now (a snapshot): where staging memory lives."""
        return counters.idle_buffers(self._runtime)

    @contextlib.contextmanager
    def save_guard(self, guard: Callable[[Any], None]) -> Iterator[None]:
        """While inside, every step runs ``guard(unit)`` before it changes a row of ``unit``."""
        self.add_save_guard(guard)
        try:
            yield
        finally:
            self.remove_save_guard(guard)

    def add_save_guard(self, guard: Callable[[Any], None]) -> None:
        self._store.write_guards.append(guard)

    def remove_save_guard(self, guard: Callable[[Any], None]) -> None:
        """Remove ``guard`` if it is installed (a no-op otherwise)."""
        if guard in self._store.write_guards:
            self._store.write_guards.remove(guard)

    def flush(self) -> None:
        """sync: the last step's write-behind is on disk; raises its first failed write (layer and
        state)."""
        self._runtime.flush()

    def close(self) -> None:
        """Flush (raising a failed write), then stop the state's workers and close its tiers (files
        stay)."""
        self._runtime.close()
