"""Layer-boundary checkpoints kept off the compute device: in host memory ("cpu") or on NVMe.

The forward scan keeps, for every block l, its input carry of each micro-batch (the checkpoint
the reverse scan recomputes block l from). With ``Config(offload_activations="cpu"|"nvme")`` those
carries leave the compute device as they are made: the carries of block l (all micro-batches) are
packed into one byte row ``l`` of an array ``"boundaries"`` in a tier -- a host-memory row, or a
zarr3 chunk under ``<nvme_path>/rank<r>/activations`` written behind the forward scan. The reverse
scan walks blocks L-1..0 and reads row l-1 .. l-depth back ahead of the block it is computing.

Contract: ``restore(l, keep(l, carries))`` returns carries with the same structure, shapes, dtypes
and bits as ``carries`` (contiguous, whatever the strides were), valid until ``forget(l)``. The
token ``keep`` returns is the row's layout (``RowLayout``: where each leaf of the carries lies in
the packed row), decided once as the row is packed and held by the caller (the scan's boundaries)
until its ``restore``.

The carries' shapes may change from step to step (batches padded to a few lengths): the rows are
sized for the largest carries yet, and a step with smaller ones packs into their start. A step
with larger ones allocates the rows afresh at its first ``keep`` (nothing is held in them between
steps); the staging buffers of the old size stay idle in the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import optree
import torch

from ..io.buffers import BufferPool
from ..layout.demand import SCANS, Buffers, Demand
from ..layout.units import BLOCKS, key
from ..observe.trace import WaitClock
from .protocol import Tier
from .transfers import Transfer, Write

LEAF_ALIGN = 64  # byte offset of every leaf in a packed row, so each view is aligned for its dtype
# row l: the input carries of block l (errors then name "blocks.l")
KEY = key(BLOCKS, "boundaries")


def demand(carry_bytes: int, n_layers: int, placement: str, depth: int) -> Demand:
    """What the boundary carries hold (see ``zinf_fn.layout.demand``), ``carry_bytes`` those of one
    boundary (all micro-batches), at ``placement`` (``Config.offload_activations``): kept where they
    are made, ``n_layers`` + 1 of them (the blocks' inputs and the head's); offloaded to NVMe
    (``OffloadedCheckpoints``), the rows staged for the write-behind (``depth``, the prefetch
    depth, + 1 in forward) or read back ahead (``depth``, the one restored and the one in use, in
    backward), and the head's input, kept. Offloaded to "cpu", the rows are the tier's: kept."""
    if placement != "nvme":
        return Demand("boundary carries", held=(n_layers + 1) * carry_bytes)
    buffers = (Buffers(carry_bytes, torch.uint8, depth + 2, phases=SCANS),)
    return Demand("boundary carries", buffers, held=carry_bytes)


class _Leaf(NamedTuple):
    micro: int
    index: int  # position among the micro-batch carry's leaves
    offset: int  # bytes into the row
    shape: tuple
    dtype: torch.dtype


class RowLayout(NamedTuple):
    """Where the carries of one block's micro-batches lie in their packed byte row: ``keep``'s
    token, which ``restore`` unpacks the row by."""

    treedefs: list  # one per micro-batch
    leaves: list  # the tensor leaves, in order
    others: list  # per micro-batch: the non-tensor leaves, by index
    nbytes: int


def row_layout(carries: list) -> RowLayout:
    """The packed row of ``carries`` (one per micro-batch): each tensor leaf at an offset aligned
    to ``LEAF_ALIGN`` bytes, in order; the non-tensor leaves kept by value."""
    treedefs, leaves, others, offset = [], [], [], 0
    for m, carry in enumerate(carries):
        flat, treedef = optree.tree_flatten(carry)
        treedefs.append(treedef)
        others.append({i: x for i, x in enumerate(flat) if not isinstance(x, torch.Tensor)})
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                leaves.append(_Leaf(m, i, offset, tuple(x.shape), x.dtype))
                offset += -(-x.numel() * x.element_size() // LEAF_ALIGN) * LEAF_ALIGN
    return RowLayout(treedefs, leaves, others, max(offset, LEAF_ALIGN))


class ReadWindow(Protocol):
    """What the checkpoints use of a read-ahead window (``overlap.window.Window``, handed in by the
    runtime)."""

    def take(self, j: int) -> Transfer: ...
    def advance(self, cursor: int) -> None: ...
    def close(self) -> None: ...


class RowWrites(Protocol):
    """What the checkpoints use of a write-behind (``overlap.stream.WriteBehind``, handed in by the
    runtime)."""

    def put(self, writes: list[Write]) -> None: ...
    def drain(self) -> None: ...
    def abandon(self) -> None: ...


class OffloadedCheckpoints:
    """``keep`` / ``restore`` / ``forget`` of the boundary carries, through a tier; see the module
    docstring.

    ``tier`` holds the rows (host memory or NVMe); ``writes`` writes them behind the forward scan;
    ``open_window(range(n), issue, drop, depth)`` makes the read-ahead of a reverse scan (rows
    n-1 .. 0); ``waits`` counts the compute thread's time blocked on them.

    Eight parameters, for a reason: the offload sits below the overlap, so the runtime hands it the
    stream primitives it uses (``writes``, ``open_window``) besides where the rows go (``tier``,
    ``pool``, ``device``), how many (``n_layers``), how far ahead (``depth``) and the wait clock.

    Its state, besides the buffers in flight: ``row_bytes``, the size the tier's rows are allocated
    at (the largest carries' yet: it only grows, as the tier's array does), and one backward pass's
    read-ahead (``_reads``, from the pass's first ``restore`` to the next forward's first ``keep``).
    How a row is packed is no state of it: each ``keep`` returns its row's layout.
    """

    def __init__(
        self,
        tier: Tier,
        n_layers: int,
        pool: BufferPool,
        device: torch.device,
        depth: int,
        writes: RowWrites,
        open_window: Callable[..., ReadWindow],
        waits: WaitClock | None = None,
    ):
        self.tier = tier
        self.n_layers = n_layers
        self.pool = pool
        self.device = torch.device(device)
        self.depth = depth
        self.writes = writes
        self._open_window = open_window
        self.waits = waits or WaitClock()
        self.row_bytes = 0  # the rows' size: the largest carries' yet
        # the read-ahead of the reverse scan; None in the forward one
        self._reads: ReadWindow | None = None
        # the layer the reverse scan restores first (position 0)
        self._first = 0
        self._held: dict[int, Transfer] = {}  # layer -> its restored row, in use

    # -- forward -----------------------------------------------------------------------------------
    def keep(self, layer: int, carries: list) -> RowLayout:
        """Pack block ``layer``'s input carries into its row; returns the row's layout, the token
        ``restore`` takes."""
        layout = row_layout(carries)
        self._grow(layout.nbytes)
        row = self.tier.view(KEY, layer)
        if row is not None:  # host memory: pack straight into the row
            _pack_(layout, carries, row)
            self.tier.count_view_io(written=row.numel())
        else:
            staged = self.pool.take(self.row_bytes, torch.uint8, self.tier.device)
            _pack_(layout, carries, staged)
            self.writes.put([Write(self.tier, KEY, layer, staged, pooled=True)])
        self._reads = None
        return layout

    # -- backward ----------------------------------------------------------------------------------
    def restore(self, layer: int, token: RowLayout) -> list:
        """The carries ``keep(layer, ...)`` packed as ``token`` (their row's layout) says, read back
        ahead of the reverse scan."""
        with self.waits.waiting(f"checkpoint {layer}"):
            if self._reads is None:  # first restore of this backward pass
                self.writes.drain()  # sync: every row is on its tier before it is read back
                self._first = layer
                self._reads = self._open_window(
                    range(layer + 1), self._issue, self._give_back, self.depth
                )
            position = self._first - layer
            read = self._reads.take(position)
            self._reads.advance(position + 1)
            if read.future is not None:
                read.future.result()  # sync: the checkpoint is back in memory
        buf, pooled = read.buf, read.pooled
        if buf.device != self.device:
            on_device = self.pool.take(buf.numel(), torch.uint8, self.device)
            on_device.copy_(buf)
            if pooled:
                self.pool.give(buf)
            buf, pooled = on_device, True
        self._held[layer] = Transfer(buf, None, pooled)  # restored: its read completed
        return _unpack(token, buf)

    def forget(self, layer: int) -> None:
        """Block ``layer``'s backward is done: its restored carries are no longer used."""
        held = self._held.pop(layer)
        if held.pooled:
            self.pool.give(held.buf)

    def abandon(self) -> None:
        """After a failed step: wait for the I/O in flight and give every buffer back."""
        if self._reads is not None:
            self._reads.close()
        for held in self._held.values():
            if held.pooled:
                self.pool.give(held.buf)
        self._held.clear()
        self._reads = None
        self.writes.abandon()

    def close(self) -> None:
        self.tier.close()

    # -- helpers
    # -------------------------------------------------------------------------------------
    def _grow(self, nbytes: int) -> None:
        """The rows allocated afresh at ``nbytes`` where they are smaller (or not allocated)."""
        if nbytes <= self.row_bytes:
            return
        self.writes.drain()  # sync: no write of the old rows in flight (none: a new step)
        if self.row_bytes:
            self.tier.drop(KEY)
        self.tier.allocate(KEY, self.n_layers, nbytes, torch.uint8)
        self.row_bytes = nbytes

    def _issue(self, position: int) -> Transfer:
        """Start reading back row ``first - position`` (the reverse scan's order)."""
        layer = self._first - position
        view = self.tier.view(KEY, layer)
        if view is not None:
            self.tier.count_view_io(read=view.numel())
            return Transfer(view, None, pooled=False)
        buf = self.pool.take(self.row_bytes, torch.uint8, self.tier.device)
        return Transfer(buf, self.tier.read_(KEY, layer, buf), pooled=True)

    def _give_back(self, read: Transfer) -> None:
        try:
            if read.future is not None:
                read.future.result()  # sync: the read is done before its buffer goes back
        finally:
            if read.pooled:
                self.pool.give(read.buf)


def _pack_(layout: RowLayout, carries: list, out: torch.Tensor) -> None:
    """Copy ``carries`` into the byte row ``out`` (consumed) where ``layout`` places them."""
    flats = [optree.tree_leaves(c) for c in carries]
    for leaf in layout.leaves:
        x = flats[leaf.micro][leaf.index]
        n = x.numel() * x.element_size()
        out[leaf.offset : leaf.offset + n].view(x.dtype).view(x.shape).copy_(x)


def _unpack(layout: RowLayout, buf: torch.Tensor) -> list:
    """The carries packed in the byte row ``buf`` as ``layout`` says: views of ``buf``."""
    per_micro = [dict(others) for others in layout.others]
    for leaf in layout.leaves:
        n = torch.Size(leaf.shape).numel() * leaf.dtype.itemsize
        per_micro[leaf.micro][leaf.index] = (
            buf[leaf.offset : leaf.offset + n].view(leaf.dtype).view(leaf.shape)
        )
    return [
        optree.tree_unflatten(treedef, [flat[i] for i in range(len(flat))])
        for treedef, flat in zip(layout.treedefs, per_micro, strict=True)
    ]
