"""The NVMe bytes one step reads and writes, per phase, unit by unit as the engine moves them.

    forward    each unit's 16-bit param row on NVMe is read (prefetched)
    backward   each block's and the embedding's param row on NVMe is read again, unless its master is
               read ahead from NVMe for its update: then the fetch casts that master instead
               (``overlap.fetch.Fetcher.start(derive=True)``; the head is not refetched, its backward
               runs right after its forward); optimizer rows on NVMe (master, moments) are read and
               written once; the 16-bit copy of each NVMe param row is written after its update.
    clipping   with ``clip_grad_norm`` the gradients are stashed in their tier and the update is a
               second pass: no master is lent (every NVMe param row is read twice), and NVMe grad rows
               are written in backward and read by the second pass.

Only the units whose rows are on NVMe count: a spilled placement (``Config.spill_*``) moves the bytes
of its spilled units alone. The engine's counters (``bytes_read.nvme`` / ``bytes_written.nvme`` of
``zf.train_step``'s metrics) are the sum of these.
"""

from __future__ import annotations

from typing import NamedTuple

from ..config import Config, spill_of
from ..memory import unit_bytes
from ..store import Store


class Traffic(NamedTuple):
    """NVMe bytes of one step (this rank): read in forward, read in backward (and a clipped update), written."""

    read_forward: int = 0
    read_backward: int = 0
    written: int = 0


def nvme_traffic(store: Store, config: Config, n_layers: int) -> Traffic:
    """The NVMe bytes of one step of ``config`` over a layout build's ``store`` (see the module)."""
    n_units = n_layers + 2
    head = n_units - 1
    param = unit_bytes(store, n_layers, ["param"])
    opt_kinds = store.opt_kinds(False)
    opt = unit_bytes(store, n_layers, opt_kinds)
    grad = unit_bytes(store, n_layers, ["grad"]) if store.has_grad_arrays else [0] * n_units
    clipping = config.clip_grad_norm is not None
    lends = not clipping and config.prefetch_depth > 0   # ``optim.readahead``: masters lent to the fetch
    fwd = bwd = out = 0
    for u in range(n_units):
        param_on_disk, opt_on_disk = _on_nvme(config, "params", u), _on_nvme(config, "optimizer", u)
        if param_on_disk:
            fwd += param[u]
            out += param[u]
            if u != head and not (lends and opt_on_disk):
                bwd += param[u]
        if opt_on_disk:
            bwd += opt[u] + grad[u]
            out += opt[u] + grad[u]
    return Traffic(fwd, bwd, out)


def _on_nvme(config: Config, kind: str, unit: int) -> bool:
    """Whether unit ``unit``'s rows of ``kind`` ("params" or "optimizer") live on NVMe under ``config``."""
    spill = spill_of(config, kind)
    if spill is not None and unit >= spill[0]:
        return spill[1] == "nvme"
    return getattr(config, f"offload_{kind}") == "nvme"
