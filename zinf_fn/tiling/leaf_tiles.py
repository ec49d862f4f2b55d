"""A tiled leaf's tiles during a step: fetched on the op's demand, released after use, and their
per-tile gradients accumulated over micro-batches and sent to the updater (``TileGrads``), one by
one or as a run of small tiles' shards.

``LeafTiles`` is the runtime's (``tiling.step_tiles.StepTiles``) record of one tiled leaf of the
unit being computed; ``reuses_fetched`` is the one rule for writing a tile's gradient into the
buffer its fetch filled."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ..formats.nf4_linear import CodedMatrix, lent
from ..overlap.fetch import Layer
from .layout import TiledLeaf, TileUnit

if TYPE_CHECKING:
    from .step_tiles import StepTiles


def reuses_fetched(micro_batches: int, grad_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a tile's gradient is written into the buffer its fetch filled, where that is a pool
    buffer of the gradient's size (``LeafTiles.grad_out``): one micro-batch, an fp32 gradient, not
    on CUDA, where a device buffer goes back through the fetcher (after an event: compute may still
    read it), not the updater. The one rule: the gradients' demand asks it too
    (``zinf_fn.planner.memory.demands``)."""
    return micro_batches == 1 and grad_dtype == torch.float32 and device.type != "cuda"


class TileGrads(Protocol):
    """Where a step's tile gradients go (the runtime's ``zinf_fn.step_io.GradientsOut``):
    ``tile_buffer``, a flat fp32 buffer for a tile's gradient (the caller fills all of it);
    ``emit_grad``, one tile's, owned by the callee from then on; ``scatter``, a tile of a run's
    shard, and ``submit``, a run's shards as one update (``overlap.tile_runs.update_run``);
    ``throttle``: sync, few enough tile updates queued."""

    def tile_buffer(self, unit: TileUnit) -> torch.Tensor: ...
    def emit_grad(self, unit: TileUnit, flat: torch.Tensor) -> None: ...
    def scatter(self, unit: TileUnit, flat: torch.Tensor) -> torch.Tensor: ...
    def submit(self, units: list, shards: list) -> None: ...
    def throttle(self) -> None: ...


class LeafTiles:
    """One tiled leaf of the unit being computed: its fetched tiles and per-tile gradient
    accumulation."""

    def __init__(
        self,
        leaf: TiledLeaf,
        index: int,
        step: StepTiles,
        units: list[TileUnit],
        entry: int,
        grads: bool,
    ):
        """``entry``: the plan index of the unit fetch whose tiles these are."""
        self.leaf, self.index, self.step, self.units, self.entry = (
            leaf,
            index,
            step,
            units,
            entry,
        )
        self.grads, self.used = grads, False
        # tile fetches of this unit: a backward unit's recompute shows in their number
        self.fetches = 0
        # routings its op told (``StepTiles.will_use``): a backward unit's recompute ran the op
        self.told = 0
        self.held: dict[int, list[Layer]] = {}
        self.count = [0] * leaf.n_tiles
        self.acc: dict[int, torch.Tensor] = {}
        self.out: dict[int, torch.Tensor] = {}  # tile -> the flat gradient buffer lent by grad_out
        # tiles sent as one update
        self.run = step.engine.update_run(leaf) if grads and step.out else 1
        # shards of the run being made, not submitted yet
        self.sent: list[tuple[TileUnit, torch.Tensor]] = []
        # a training step's forward unit: its tiles may be kept into the backward (``tiling.keep``)
        self.keeps = step.train and step.plan[entry].phase == "forward"
        # how its tiles' codes are read where their policy lends them to the op (``LENT``)
        self.codes = step.fetcher.store.row_kinds.policy(leaf.group).codes_lent

    def fetch(self, t: int) -> torch.Tensor | CodedMatrix:
        """Tile t of the unit fetched (``StepTiles.fetch_tile``), until ``release(t)``: its values
        of ``leaf.shapes[t]``, or where its policy lends its codes, the weight they hold as stored
        (``formats.nf4_linear.CodedMatrix``, never decoded)."""
        # the leaf's first use in this unit's applies: the order the plan should follow
        if not self.used:
            self.used = True
            self.step.used[self.leaf.stage].append(self.index)
        layer = self.step.fetch_tile(self.units[t], self.entry)
        if self.keeps:
            self.step.kept.claim(self.step.plan[self.entry].unit, layer)
        self.fetches += 1
        self.held.setdefault(t, []).append(layer)
        if self.codes is not None:
            return lent(self.codes, layer.flat)
        return layer.flat[: self.leaf.numel(t)].view(self.leaf.shapes[t])

    def release(self, t: int) -> None:
        self.step.kept.release(self.held[t].pop())

    def grad_out(self, t: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Tile t's flat fp32 gradient buffer (padding zeroed) shaped as the tile, for the op to
        write its gradient into: ``emit_grad`` then sends that buffer as it is, with no copy. Called
        after the op's last read of fetched tile t, so that tile's own buffer becomes its gradient
        where it can (``_reuse``): no buffer beside it. None where a copy is needed anyway (several
        micro-batches accumulate in fp32; a gradient of another dtype)."""
        if not self.grads or self.step.n_micro != 1 or dtype != torch.float32:
            return None
        flat = (
            self._reuse(t)
            if reuses_fetched(self.step.n_micro, dtype, self.step.fetcher.device)
            else None
        )
        n = self.leaf.numel(t)
        if flat is None:
            flat = self.step.out.tile_buffer(self.units[t])
        if n < flat.numel():  # a smaller tile of an uneven split, or shard padding
            flat[n:].zero_()
        self.out[t] = flat
        return flat[:n].view(self.leaf.shapes[t])

    def _reuse(self, t: int) -> torch.Tensor | None:
        """The buffer of fetched tile t, taken over for its gradient (its release then gives nothing
        back), or None: not a pool buffer of the gradient's size and dtype, or on CUDA, where a
        device buffer goes back through the fetcher (after an event: compute may still read it), not
        through the updater."""
        layers = self.held.get(t)
        if not layers:
            return None
        layer, flat = layers[-1], layers[-1].flat
        size = self.step.fetcher.store.group_of(self.units[t]).part.padded_numel
        if not layer.owned or layer.along or flat.dtype != torch.float32 or flat.numel() != size:
            return None
        layers[-1] = layer._replace(owned=False)
        return flat

    def emit_grad(self, t: int, grad: torch.Tensor) -> None:
        """Accumulate tile t's gradient of one micro-batch; the last one sends it to the updater."""
        unit, k = self.units[t], self.step.n_micro
        if not self.grads:
            raise RuntimeError(
                f"{unit.label}: a gradient was emitted while the unit was fetched for forward only"
            )
        self.count[t] += 1
        if self.count[t] > k:
            raise ValueError(
                f"{unit.label}: tile {t} of {self.leaf.path!r} got {self.count[t]} gradients in "
                "one step, expected "
                f"{k} (one per micro-batch). A tiled weight may be used once per apply; declare a "
                "second "
                "tiled weight for a second use."
            )
        if k == 1:
            self._send(t, grad)
        elif t not in self.acc:
            self.acc[t] = grad.detach().reshape(-1).to(torch.float32, copy=True)
        else:
            self.acc[t].add_(grad.reshape(-1))
            if self.count[t] == k:
                self._send(t, self.acc.pop(t))

    def flush(self) -> None:
        """Send every tile gradient not sent yet (zeros for a tile no micro-batch used), and the
        last run's."""
        for t in range(self.leaf.n_tiles):
            if self.count[t] < self.step.n_micro:
                self.count[t] = self.step.n_micro
                acc = self.acc.pop(t, None)
                self._send(t, acc if acc is not None else torch.zeros(self.leaf.numel(t)))
        self._submit()

    def _send(self, t: int, grad: torch.Tensor) -> None:
        unit, n = self.units[t], self.leaf.numel(t)
        flat = self.out.pop(t, None)
        # not written into the lent buffer: copy
        if flat is None or grad.data_ptr() != flat.data_ptr():
            if flat is not None:
                self.step.fetcher.pool.give(flat)
            flat = self.step.out.tile_buffer(unit)
            flat[:n].copy_(grad.reshape(-1))
            if n < flat.numel():  # a smaller tile of an uneven split, or shard padding
                flat[n:].zero_()
        if self.run == 1:
            self.step.out.emit_grad(unit, flat)
            self.step.out.throttle()
            return
        self.sent.append((unit, self.step.out.scatter(unit, flat)))
        if len(self.sent) == self.run:
            self._submit()

    def _submit(self) -> None:
        """The run's shards, made so far, queued as one update; then at most ``TILE_BACKLOG``
        updates unfinished."""
        if self.sent:
            units, shards = zip(*self.sent, strict=True)
            self.sent.clear()
            self.step.out.submit(list(units), list(shards))
            self.step.out.throttle()

    def close(self) -> None:
        for layers in self.held.values():
            while layers:
                self.step.kept.release(layers.pop())
        # never emitted (a failed backward)
        for flat in [*self.out.values(), *(shard for _, shard in self.sent)]:
            self.step.fetcher.pool.give(flat)
        self.out.clear()
        self.sent.clear()
