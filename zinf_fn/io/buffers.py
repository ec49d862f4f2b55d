"""A fixed pool of reusable buffers: every transfer goes through one, nothing is allocated per step.

The one free-list of the project: the engine's transfers (``runtime``), a checkpoint save's row
snapshots and a restore's slices (``checkpoints``) each hold a ``BufferPool``.

Buffers are keyed by (numel, dtype, device), the device as its tensors report it
(``canonical_device``: ``"cuda"`` is ``cuda:<current>``, ``"cpu:0"`` is ``cpu``), so a buffer given
back is found by the next take. ``take`` hands out a free buffer or, while the pool is below its
limit, makes one; past the limit it raises a RuntimeError (the engine: the prefetch depth bounds how
many are ever out at once; ``Config.staging_buffers`` sets the limit); ``reserve`` makes buffers
ahead (the engine's pool: what the streaming parts declare, made at init). A pool may instead have a
byte budget, and a taker an abort event: past the budget it waits for buffers to come back (a save's
copier waits for its writer), and idle buffers of other sizes are dropped to make room. ``take_all``
takes several at once, so two takers never each hold part of what they need. On CUDA, host buffers
are pinned so host->device copies can be asynchronous. Host buffers start on a page boundary
(``PAGE``), so they move with ``O_DIRECT``.
"""

from __future__ import annotations

import threading

import torch

from . import odirect
from .heap import HUGE_PAGE, advise_huge

PAGE = odirect.ALIGN  # a page: every O_DIRECT alignment divides it


class PoolExhausted(RuntimeError):
    """Every buffer of a key is out (or the pool's budget is), and the taker would not wait."""


class PoolAborted(RuntimeError):
    """A wait for buffers was given up: the caller's abort event was set
    (``BufferPool.take_all``)."""


class BufferPool:
    """``limit_per_key``: buffers of one (numel, dtype, device) made at most (None: no limit, the
    caller bounds how many are out); ``budget_bytes``: bytes made at most, every key together (None:
    no budget), idle buffers of other keys dropped to make room, and always room while no buffer is
    out; ``pin``: host buffers pinned (None: where CUDA is available); ``huge``: large host buffers
    on huge pages (``aligned_empty``)."""

    def __init__(
        self,
        limit_per_key: int | None = 8,
        budget_bytes: int | None = None,
        pin: bool | None = None,
        huge: bool = True,
    ):
        self._limit, self.budget_bytes = limit_per_key, budget_bytes
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._huge = huge
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._made: dict[tuple, int] = {}
        self._cond = threading.Condition()
        self.out = 0  # buffers handed out and not yet given back
        self.peak_out = 0
        self.bytes_made = 0  # bytes of the buffers this pool holds (out or free)
        self.peak_bytes = 0

    def reserve(self, specs: list[tuple[int, torch.dtype, torch.device, int]]) -> None:
        """Make ``count`` buffers of each ``(numel, dtype, device, count)`` of ``specs`` now (beyond
        those made; at most the limit of a key), free, and write them once: a fixed pool, whose
        memory is resident from here on (a shortfall shows now, not mid-step) and which a taker that
        holds no more than planned never grows."""
        for numel, dtype, device, count in specs:
            key = (numel, dtype, canonical_device(device))
            with self._cond:
                n = max(0, min(count, self._limit or count) - self._made.get(key, 0))
                self._made[key] = self._made.get(key, 0) + n
                self.bytes_made += n * _nbytes(key)
                self.peak_bytes = max(self.peak_bytes, self.bytes_made)
            # zero_: its pages resident
            made = [_allocate(*key, self._pin, self._huge).zero_() for _ in range(n)]
            with self._cond:
                self._free.setdefault(key, []).extend(made)

    def take(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        abort: threading.Event | None = None,
    ) -> torch.Tensor:
        """A free buffer of ``numel`` x ``dtype`` on ``device``, or a new one; see ``take_all``."""
        return self.take_all([(numel, dtype, device)], abort)[0]

    def take_all(
        self, specs: list[tuple], abort: threading.Event | None = None
    ) -> list[torch.Tensor]:
        """One buffer per ``(numel, dtype, device)`` of ``specs``, all at once (free ones first,
        then new ones). Past the limit or the budget: without ``abort`` a RuntimeError at once; with
        it, wait for buffers to come back (``give``) until ``abort`` is set (``PoolAborted``;
        ``wake`` makes waiters look)."""
        keys = [(n, dtype, canonical_device(device)) for n, dtype, device in specs]
        with self._cond:
            while not self._reserve(keys):
                if abort is None:
                    raise self._exhausted(keys)
                if abort.is_set():
                    raise PoolAborted("gave up waiting for buffers: the caller aborted")
                self._cond.wait(0.05)  # sync: wait for a buffer to come back
            # free ones first
            bufs = [free.pop() if (free := self._free.get(key)) else None for key in keys]
            self.out += len(keys)
            self.peak_out = max(self.peak_out, self.out)
        try:
            return [
                buf if buf is not None else _allocate(*key, self._pin, self._huge)
                for key, buf in zip(keys, bufs, strict=True)
            ]
        except BaseException:  # out of memory: nothing was handed out
            self._unreserve(
                [key for key, buf in zip(keys, bufs, strict=True) if buf is None],
                [buf for buf in bufs if buf is not None],
            )
            raise

    def give(self, buf: torch.Tensor) -> None:
        self.give_all([buf])

    def give_all(self, bufs) -> None:
        with self._cond:
            for buf in bufs:
                key = (buf.numel(), buf.dtype, buf.device)
                assert key in self._made, f"a buffer this pool did not make was given back: {key}"
                self._free.setdefault(key, []).append(buf)
                self.out -= 1
            self._cond.notify_all()

    def wake(self) -> None:
        """Make every waiting ``take_all`` look at its abort event now."""
        with self._cond:
            self._cond.notify_all()

    def idle(self) -> list[torch.Tensor]:
        """The buffers held free now (a snapshot): where the pool's idle memory lives."""
        with self._cond:
            return [buf for free in self._free.values() for buf in free]

    @property
    def count(self) -> int:
        """Buffers this pool has ever made (flat across steps once warm)."""
        return sum(self._made.values())

    def _reserve(self, keys: list[tuple]) -> bool:
        """Under the lock: count the buffers ``keys`` need beyond the free ones as made; False
        (nothing counted) where the limit or the budget has no room for them."""
        wanted: dict[tuple, int] = {}
        for key in keys:
            wanted[key] = wanted.get(key, 0) + 1
        short = {key: max(0, n - len(self._free.get(key, ()))) for key, n in wanted.items()}
        if self._limit is not None and any(
            self._made.get(k, 0) + n > self._limit for k, n in short.items()
        ):
            return False
        need = sum(n * _nbytes(key) for key, n in short.items())
        if self.budget_bytes is not None:
            self._drop_idle(set(wanted), need)
            if self.bytes_made + need > self.budget_bytes and self.out:
                return False
        for key, n in short.items():
            self._made[key] = self._made.get(key, 0) + n
        self.bytes_made += need
        self.peak_bytes = max(self.peak_bytes, self.bytes_made)
        return True

    def _unreserve(self, unmade: list[tuple], taken: list[torch.Tensor]) -> None:
        """Undo a ``take_all`` whose new buffers could not be made: ``taken`` back to the free
        lists."""
        with self._cond:
            for key in unmade:
                self._made[key] -= 1
                self.bytes_made -= _nbytes(key)
            self.out -= len(unmade)
        self.give_all(taken)

    def _drop_idle(self, keep: set, need: int) -> None:
        """Free idle buffers of keys not in ``keep`` while the budget has no room for ``need`` more
        bytes."""
        for key, free in self._free.items():
            while key not in keep and free and self.bytes_made + need > self.budget_bytes:
                free.pop()
                self._made[key] -= 1
                self.bytes_made -= _nbytes(key)

    def _exhausted(self, keys: list[tuple]) -> PoolExhausted:
        numel, dtype, device = keys[0]
        if self.budget_bytes is not None:
            return PoolExhausted(
                f"buffer pool over its budget: {self.bytes_made} of {self.budget_bytes} bytes are "
                f"out, and {len(keys)} more buffer(s) were asked for; raise the "
                "budget"
            )
        made = self._made.get(keys[0], 0)
        return PoolExhausted(
            f"buffer pool exhausted: all {made} buffers of {numel} x {dtype} on {device} are out. "
            "More buffers are in use at once than the prefetch depth and update workers account "
            "for; "
            f"raise zf.Config(staging_buffers=...) above {made} (0 derives it from prefetch_depth)"
        )


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` as the tensors on it report it: ``torch.device("cuda")`` -> ``cuda:<current>``,
    ``"cpu:0"`` -> ``cpu``. Devices compare by type *and* index, so a key or a check built from the
    spelling a user passed would never match ``tensor.device``."""
    device = torch.device(device)
    if device.type == "cpu":
        return device if device.index is None else torch.device("cpu")
    if device.index is None and device.type != "meta":
        return torch.empty(0, device=device).device
    return device


def _nbytes(key: tuple) -> int:
    numel, dtype, _ = key
    return numel * dtype.itemsize


def _allocate(
    numel: int, dtype: torch.dtype, device: torch.device, pin: bool, huge: bool
) -> torch.Tensor:
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    return aligned_empty(numel, dtype, pin=pin, huge=huge)


def aligned_empty(
    numel: int, dtype: torch.dtype, pin: bool = False, huge: bool = True
) -> torch.Tensor:
    """An uninitialised host tensor whose data starts on a page boundary (a view into a slightly
    larger one).

    With ``huge``, one of ``HUGE_PAGE`` bytes or more (not pinned: CUDA's allocator maps those)
    starts on a huge-page boundary, its whole huge pages advised as such
    (``io.heap.advise_huge``)."""
    nbytes = numel * dtype.itemsize
    align = HUGE_PAGE if huge and nbytes >= HUGE_PAGE and not pin else PAGE
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % align
    if align == HUGE_PAGE:
        advise_huge(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return raw[start : start + nbytes].view(dtype)
