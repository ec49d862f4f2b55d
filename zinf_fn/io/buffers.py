"""A fixed pool of reusable buffers: every transfer goes through one, nothing is allocated per step.

Buffers are keyed by (numel, dtype, device), the device as its tensors report it (``canonical_device``:
``"cuda"`` is ``cuda:<current>``, ``"cpu:0"`` is ``cpu``), so a buffer given back is found by the next
take. ``take`` hands out a free buffer or, while the pool is below its limit, makes one; past the limit
it raises a RuntimeError (the prefetch depth bounds how many are ever out at once; ``Config.staging_buffers``
sets the limit). On CUDA, host buffers are pinned so host->device copies can be asynchronous. Host
buffers start on a page boundary (``PAGE``), so the NVMe tier can move them with ``O_DIRECT``.
"""

from __future__ import annotations

import threading

import torch

from . import odirect
from .heap import HUGE_PAGE, advise_huge

PAGE = odirect.ALIGN   # a page: every O_DIRECT alignment divides it


class BufferPool:
    def __init__(self, limit_per_key: int = 8):
        self._limit = limit_per_key
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._made: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self.out = 0          # buffers handed out and not yet given back
        self.peak_out = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (numel, dtype, canonical_device(device))
        with self._lock:
            free = self._free.setdefault(key, [])
            if free:
                buf = free.pop()
            else:
                made = self._made.get(key, 0)
                if made >= self._limit:
                    raise RuntimeError(
                        f"buffer pool exhausted: all {made} buffers of {numel} x {dtype} on {key[2]} are out. "
                        "More buffers are in use at once than the prefetch depth and update workers account for; "
                        f"raise zf.Config(staging_buffers=...) above {made} (0 derives it from prefetch_depth)")
                self._made[key] = made + 1
                buf = _allocate(numel, dtype, key[2])
            self.out += 1
            self.peak_out = max(self.peak_out, self.out)
            return buf

    def give(self, buf: torch.Tensor) -> None:
        key = (buf.numel(), buf.dtype, buf.device)
        with self._lock:
            assert key in self._made, f"a buffer this pool did not make was given back: {key}"
            self._free.setdefault(key, []).append(buf)
            self.out -= 1

    @property
    def count(self) -> int:
        """Buffers this pool has ever made (flat across steps once warm)."""
        return sum(self._made.values())


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` as the tensors on it report it: ``torch.device("cuda")`` -> ``cuda:<current>``, ``"cpu:0"``
    -> ``cpu``. Devices compare by type *and* index, so a key or a check built from the spelling a user
    passed would never match ``tensor.device``."""
    device = torch.device(device)
    if device.type == "cpu":
        return device if device.index is None else torch.device("cpu")
    if device.index is None and device.type != "meta":
        return torch.empty(0, device=device).device
    return device


def _allocate(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    return aligned_empty(numel, dtype, pin=torch.cuda.is_available())


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """An uninitialised host tensor whose data starts on a page boundary (a view into a slightly larger one).

    One of ``HUGE_PAGE`` bytes or more (not pinned: CUDA's allocator maps those) starts on a huge-page
    boundary, its whole huge pages advised as such (``io.heap.advise_huge``)."""
    nbytes = numel * dtype.itemsize
    align = HUGE_PAGE if nbytes >= HUGE_PAGE and not pin else PAGE
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % align
    if align == HUGE_PAGE:
        advise_huge(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return raw[start : start + nbytes].view(dtype)
