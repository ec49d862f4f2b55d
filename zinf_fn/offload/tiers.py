"""The tiers a placement makes: memory tiers (the compute device, CPU memory), the layout build's
stand-in, and ``make_tier``, the factory that knows every tier (``MemoryTier``, ``nvme.NvmeTier``).

What a tier is (the ``Tier`` protocol, the placements) lives in ``offload.protocol``, which every
tier and every user of one imports; only the runtime's composition root needs this factory.
"""

from __future__ import annotations

import torch

from ..io.buffers import aligned_empty
from ..io.futures import done
from ..observe.trace import NULL_TRACER, BusyClock
from .nvme import NvmeTier
from .protocol import PLACEMENTS, Tier


class MemoryTier:
    """Arrays held as tensors on ``device`` (placement "none": the compute device; "cpu": host
    memory).

    ``zero_fill``: new arrays start zeroed (init writes only the real part of each row); False
    leaves them uninitialised, for a caller that overwrites every byte (a checkpoint restore), and
    on base pages: that caller's I/O threads touch them first, as they read, and a fresh huge page's
    first touch costs more than its base pages' (the kernel clears 2 MiB at once, and on a VM the
    host may have to back it anew), so it would slow the read down (BENCHMARKS.md, issue 22).
    """

    def __init__(self, name: str, device: torch.device, pin: bool = False, zero_fill: bool = True):
        self.name = name
        self.device = torch.device(device)
        self._pin = pin and torch.cuda.is_available() and self.device.type == "cpu"
        self._zero_fill = zero_fill
        self._arrays: dict[str, torch.Tensor] = {}
        self.bytes_read = 0
        self.bytes_written = 0

    def allocate(self, key, rows, numel, dtype):
        if key in self._arrays:
            raise ValueError(f"tier {self.name!r}: array {key!r} already exists")
        # page-aligned host rows: a checkpoint reads into them with O_DIRECT
        if self.device.type == "cpu":
            array = aligned_empty(rows * numel, dtype, pin=self._pin, huge=self._zero_fill).view(
                rows, numel
            )
            self._arrays[key] = array.zero_() if self._zero_fill else array
        else:
            new = torch.zeros if self._zero_fill else torch.empty
            self._arrays[key] = new(rows, numel, dtype=dtype, device=self.device)

    def drop(self, key):
        del self._arrays[key]

    def share(self, key: str, source: MemoryTier, source_key: str) -> None:
        """Make ``key`` the same tensor as ``source``'s ``source_key`` (an fp32 param copy *is* the
        master)."""
        if key in self._arrays:
            raise ValueError(f"tier {self.name!r}: array {key!r} already exists")
        self._arrays[key] = source._arrays[source_key]

    def view(self, key, row):
        return self._arrays[key][row]

    def keep(self, key, row):
        pass  # every row is in memory

    def read_(self, key, row, out, start=0):
        out.copy_(self._arrays[key][row][start : start + out.numel()], non_blocking=True)
        self.bytes_read += out.numel() * out.element_size()
        return done(out)

    def write_(self, key, row, src, start=0):
        dst = self._arrays[key][row][start : start + src.numel()]
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src, non_blocking=True)
        self.bytes_written += src.numel() * src.element_size()
        return done()

    def keys(self):
        return list(self._arrays)

    def counters(self):
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written}

    def count_view_io(self, read=0, written=0):
        self.bytes_read += read
        self.bytes_written += written

    def close(self):
        pass


class MetaTier:
    """A tier that allocates nothing: it records each array's (rows, numel, dtype), for the layout
    build of ``zinf_fn.planner.memory``'s estimate (``zinf_fn.layout.build.layout``)."""

    def __init__(self, placement: str, device: torch.device):
        self.name, self.device = placement, torch.device(device)
        self.resident = placement != "nvme"  # rows a memory tier would hold (and could share)
        self.arrays: dict[str, tuple[int, int, torch.dtype]] = {}

    def allocate(self, key, rows, numel, dtype):
        self.arrays[key] = (rows, numel, dtype)

    def drop(self, key):
        del self.arrays[key]

    def share(self, key, source, source_key):
        # the param array *is* the master: no bytes of its own
        self.arrays[key] = (0, 0, torch.float32)

    def view(self, key, row):
        return None

    def keep(self, key, row):
        pass

    def read_(self, key, row, out, start=0):
        raise RuntimeError(f"MetaTier {self.name!r}: a layout build reads no rows (key {key!r})")

    write_ = read_

    def keys(self):
        return list(self.arrays)

    def counters(self):
        return {}

    def count_view_io(self, read=0, written=0):
        pass

    def close(self):
        pass


def can_share(param_tier: Tier, opt_tier: Tier, param_dtype: torch.dtype) -> bool:
    """Whether the param copy can *be* the master: an fp32 copy needs no second array and no cast
    (nor a write) after each update, where both tiers are plain memory tiers on one device (rows are
    views) or both NVMe tiers (``NvmeTier.share``: the param array is the master's files)."""
    p, o = param_tier, opt_tier
    if param_dtype != torch.float32:
        return False
    if _resident(p) and _resident(o):
        return p.device == o.device
    # the layout build's stand-ins of two NVMe tiers
    if isinstance(p, MetaTier) and isinstance(o, MetaTier):
        return p.name == o.name == "nvme"
    return isinstance(p, NvmeTier) and isinstance(o, NvmeTier)


def _resident(tier: Tier) -> bool:
    """A plain memory tier (or the layout build's stand-in for one): its rows are views."""
    return isinstance(tier, MemoryTier) or (isinstance(tier, MetaTier) and tier.resident)


def make_tier(
    placement: str,
    compute_device: torch.device,
    nvme_path: str | None = None,
    role: str = "",
    zero_fill: bool = True,
    tracer=NULL_TRACER,
    clock: BusyClock | None = None,
    nvme_engine: str = "direct",
) -> Tier:
    """The tier for a placement string ("none", "cpu" or "nvme"); ``zero_fill``: see ``MemoryTier``;
    ``tracer`` and ``clock`` observe the NVMe tier's I/O and ``nvme_engine`` moves it
    (``NvmeTier``)."""
    if placement == "none":
        return MemoryTier("none", compute_device, zero_fill=zero_fill)
    if placement == "cpu":
        return MemoryTier("cpu", torch.device("cpu"), pin=True, zero_fill=zero_fill)
    if placement == "nvme":
        return NvmeTier(nvme_path, role, engine=nvme_engine, tracer=tracer, clock=clock)
    raise ValueError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")
