"""TileSources over in-memory tiles for the tiled ops' tests: they log every fetch, release, hint
and emitted gradient (``RecordingSource``), and lend a gradient buffer per tile as the engine's
handle does (``LendingSource``)."""

from __future__ import annotations

import torch


class RecordingSource:
    """A TileSource over in-memory tiles that logs every fetch, release and emitted gradient."""

    def __init__(self, tiled):
        self.tiles, self.axis, self.n_tiles = tiled.tiles, tiled.axis, len(tiled.tiles)
        self.anchor = torch.zeros(0, requires_grad=True)
        self.log, self.live, self.peak_live, self.grads = [], 0, 0, {}

    def tile_shape(self, t):
        return tuple(self.tiles[t].shape)

    def fetch(self, t):
        self.live += 1
        self.peak_live = max(self.peak_live, self.live)
        self.log.append(("fetch", t))
        return self.tiles[t].clone()

    def release(self, t):
        self.live -= 1
        self.log.append(("release", t))

    def grad_out(self, t, dtype):
        return None  # the op's own tensor; the engine's handle lends its flat gradient buffer

    def emit_grad(self, t, grad):
        self.log.append(("grad", t))
        self.grads[t] = grad.clone()

    def will_use(self, tiles, others=()):
        self.log.append(("will_use", tuple(tiles)))
        for other in others:
            other.log.append(("will_use", tuple(tiles)))
        return tuple(tiles)


class LendingSource(RecordingSource):
    """A source that lends a gradient buffer per tile, as the engine's handle does
    (``TileSource.grad_out``)."""

    def grad_out(self, t, dtype):
        self.log.append(("grad_out", t))
        self.lent = getattr(self, "lent", {})
        self.lent[t] = torch.full(self.tile_shape(t), float("nan"), dtype=dtype)
        return self.lent[t]

    def emit_grad(self, t, grad):
        lent = self.lent[t].data_ptr()
        assert grad.data_ptr() == lent, "the op wrote tile t's gradient into the lent buffer"
        super().emit_grad(t, grad)
