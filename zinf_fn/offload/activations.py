"""Layer-boundary checkpoints kept off the compute device: in host memory ("cpu") or on NVMe.

The forward scan keeps, for every block l, its input carry of each micro-batch (the checkpoint
the reverse scan recomputes block l from). With ``Config(offload_activations="cpu"|"nvme")`` those
carries leave the compute device as they are made: the carries of block l (all micro-batches) are
packed into one byte row ``l`` of an array ``"boundaries"`` in a tier -- a host-memory row, or a
zarr3 chunk under ``<nvme_path>/rank<r>/activations`` written behind the forward scan. The reverse
scan walks blocks L-1..0 and reads row l-1 .. l-depth back ahead of the block it is computing.

Contract: ``restore(l, keep(l, carries))`` returns carries with the same structure, shapes, dtypes
and bits as ``carries`` (contiguous, whatever the strides were), valid until ``forget(l)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ..trace import WaitClock
from .buffers import BufferPool
from .tiers import MemoryTier

ALIGN = 64   # byte offset of every leaf in a packed row, so each view is aligned for its dtype
KEY = "blocks/boundaries"   # row l: the input carries of block l (errors then name "blocks.l")


class _Leaf(NamedTuple):
    micro: int
    index: int        # position among the micro-batch carry's leaves
    offset: int       # bytes into the row
    shape: tuple
    dtype: torch.dtype


class _Layout(NamedTuple):
    treedefs: list    # one per micro-batch
    leaves: list      # the tensor leaves, in order
    others: list      # per micro-batch: the non-tensor leaves, by index
    nbytes: int


def _layout(carries: list) -> _Layout:
    treedefs, leaves, others, offset = [], [], [], 0
    for m, carry in enumerate(carries):
        flat, treedef = optree.tree_flatten(carry)
        treedefs.append(treedef)
        others.append({i: x for i, x in enumerate(flat) if not isinstance(x, torch.Tensor)})
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                leaves.append(_Leaf(m, i, offset, tuple(x.shape), x.dtype))
                offset += -(-x.numel() * x.element_size() // ALIGN) * ALIGN
    return _Layout(treedefs, leaves, others, max(offset, ALIGN))


class OffloadedCheckpoints:
    """``keep`` / ``restore`` / ``forget`` of the boundary carries, through a tier; see the module docstring."""

    def __init__(self, placement: str, n_layers: int, pool: BufferPool, device: torch.device, depth: int,
                 writes, nvme_path: str | None = None, role: str = "rank0/activations"):
        if placement == "nvme":
            from .nvme import NvmeTier

            self.tier = NvmeTier(nvme_path, role)
        elif placement == "cpu":
            self.tier = MemoryTier("cpu", torch.device("cpu"), pin=True)
        else:
            raise ValueError(f"offload_activations must be 'cpu' or 'nvme' here, got {placement!r}")
        self.n_layers, self.pool, self.device, self.depth = n_layers, pool, torch.device(device), depth
        self.layout: _Layout | None = None
        self.writes = writes   # a write-behind (overlap.stream.WriteBehind) of at most `depth` rows
        self._reads: dict[int, tuple] = {}      # layer -> (buffer, future or None, pooled)
        self._held: dict[int, tuple] = {}       # layer -> (buffer, pooled): restored, in use
        self._reading = False                   # False in the forward scan, True in the reverse one
        self._next_read = 0
        self.waits = WaitClock()

    # -- forward -----------------------------------------------------------------------------------
    def keep(self, layer: int, carries: list) -> Any:
        """Pack block ``layer``'s input carries into its row; returns the token ``restore`` takes."""
        if self.layout is None:
            self.layout = _layout(carries)
            self.tier.allocate(KEY, self.n_layers, self.layout.nbytes, torch.uint8)
        row = self.tier.view(KEY, layer)
        if row is not None:      # host memory: pack straight into the row
            self._pack_(carries, row)
            self.tier.bytes_written += row.numel()
        else:
            staged = self.pool.take(self.layout.nbytes, torch.uint8, self.tier.device)
            self._pack_(carries, staged)
            self.writes.put([(self.tier, KEY, layer, staged, True)])
        self._reading = False
        return None

    # -- backward ----------------------------------------------------------------------------------
    def restore(self, layer: int, token: Any) -> list:
        """The carries ``keep(layer, ...)`` packed, read back ahead of the reverse scan."""
        with self.waits.waiting(f"checkpoint {layer}"):
            if not self._reading:         # first restore of this backward pass
                self.writes.drain()       # sync: every row is on its tier before it is read back
                self._reading, self._next_read = True, layer
            self._issue_reads(layer - self.depth)
            buf, future, pooled = self._reads.pop(layer)
            if future is not None:
                future.result()   # sync: the checkpoint is back in memory
        if buf.device != self.device:
            on_device = self.pool.take(buf.numel(), torch.uint8, self.device)
            on_device.copy_(buf)
            if pooled:
                self.pool.give(buf)
            buf, pooled = on_device, True
        self._held[layer] = (buf, pooled)
        return self._unpack(buf)

    def forget(self, layer: int) -> None:
        """Block ``layer``'s backward is done: its restored carries are no longer used."""
        buf, pooled = self._held.pop(layer)
        if pooled:
            self.pool.give(buf)

    def abandon(self) -> None:
        """After a failed step: wait for the I/O in flight and give every buffer back."""
        for buf, future, pooled in self._reads.values():
            try:
                if future is not None:
                    future.result()
            except Exception:  # noqa: BLE001, S110 - the step already failed
                pass
            if pooled:
                self.pool.give(buf)
        for buf, pooled in self._held.values():
            if pooled:
                self.pool.give(buf)
        self._reads.clear()
        self._held.clear()
        self._reading = False
        try:
            self.writes.drain()
        except Exception:  # noqa: BLE001, S110
            pass

    def close(self) -> None:
        if hasattr(self.tier, "close"):
            self.tier.close()

    # -- helpers -------------------------------------------------------------------------------------
    def _issue_reads(self, last: int) -> None:
        """Issue the reads of rows next_read, next_read - 1, ..., down to ``last`` (the reverse scan order)."""
        while self._next_read >= max(last, 0):
            layer = self._next_read
            view = self.tier.view(KEY, layer)
            if view is not None:
                self.tier.bytes_read += view.numel()
                self._reads[layer] = (view, None, False)
            else:
                buf = self.pool.take(self.layout.nbytes, torch.uint8, self.tier.device)
                self._reads[layer] = (buf, self.tier.read_(KEY, layer, buf), True)
            self._next_read = layer - 1

    def _pack_(self, carries: list, out: torch.Tensor) -> None:
        flats = [optree.tree_leaves(c) for c in carries]
        for leaf in self.layout.leaves:
            x = flats[leaf.micro][leaf.index]
            n = x.numel() * x.element_size()
            out[leaf.offset : leaf.offset + n].view(x.dtype).view(x.shape).copy_(x)

    def _unpack(self, buf: torch.Tensor) -> list:
        per_micro = [dict(others) for others in self.layout.others]
        for leaf in self.layout.leaves:
            n = torch.Size(leaf.shape).numel() * leaf.dtype.itemsize
            per_micro[leaf.micro][leaf.index] = buf[leaf.offset : leaf.offset + n].view(leaf.dtype).view(leaf.shape)
        return [optree.tree_unflatten(treedef, [flat[i] for i in range(len(flat))])
                for treedef, flat in zip(self.layout.treedefs, per_micro, strict=True)]
