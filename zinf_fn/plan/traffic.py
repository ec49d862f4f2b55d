"""The NVMe bytes one step reads and writes, per phase, unit by unit as the engine moves them.

    forward    each unit's 16-bit param row on NVMe is read (prefetched)
    backward   each block's and the embedding's param row on NVMe is read again, unless its master is
               read ahead from NVMe for its update and lent to the fetch, which casts it instead
               (``overlap.fetch.Fetcher.start(derive=True)``; only rows of at most
               ``optim.readahead.LEND_PIECES`` optimizer pieces are lent; the head is not refetched, its
               backward runs right after its forward); optimizer rows on NVMe (master, moments) are read
               and written once; the 16-bit copy of each NVMe param row is written after its update
               (an fp32 param row *is* the master: no copy of its own).
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
from ..optim.pieces import piece_numel
from ..optim.readahead import LEND_PIECES
from ..store import HEAD, Store, unit_of_row


class Traffic(NamedTuple):
    """NVMe bytes of one step (this rank): read in forward, read in backward (and a clipped update), written."""

    read_forward: int = 0
    read_backward: int = 0
    written: int = 0


def nvme_traffic(store: Store, config: Config, n_layers: int) -> Traffic:
    """The NVMe bytes of one step of ``config`` over a layout build's ``store`` (see the module), row by row
    of every group (a tiled weight's tile rows are groups of their own)."""
    opt_kinds = store.opt_kinds()
    lends = config.clip_grad_norm is None and config.prefetch_depth > 0   # ``optim.readahead``
    largest_lent = LEND_PIECES * piece_numel(config.optimizer_piece_bytes)
    fwd = bwd = out = 0
    for group in store.groups.values():
        n = group.part.shard_numel
        param, opt = n * store.param_dtype.itemsize, n * 4 * len(opt_kinds)
        lent = lends and n <= largest_lent
        for row in range(group.rows):
            unit = unit_of_row(group.name, row, group.rows, n_layers)
            param_on_disk, opt_on_disk = _on_nvme(config, "params", unit), _on_nvme(config, "optimizer", unit)
            if param_on_disk:
                fwd += param
                out += 0 if store.param_is_master else param   # an fp32 param row is the master: written as opt
                if not group.name.startswith(HEAD) and not (lent and opt_on_disk):
                    bwd += param
            if opt_on_disk:
                bwd += opt
                out += opt
    return Traffic(fwd, bwd, out)


def _on_nvme(config: Config, kind: str, unit: int) -> bool:
    """Whether unit ``unit``'s rows of ``kind`` ("params" or "optimizer") live on NVMe under ``config``."""
    spill = spill_of(config, kind)
    if spill is not None and unit >= spill[0]:
        return spill[1] == "nvme"
    return getattr(config, f"offload_{kind}") == "nvme"
