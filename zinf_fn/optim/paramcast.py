"""The 16-bit copy of an updated master: cast into the param tier's row, or into a buffer to write.

Every update ends by making the stored parameter copy (``param_dtype``) agree with the master it
just changed, piece by piece. Where the param tier has a memory row, the cast goes straight into it
(on a side stream where the row is on another device than the master); where it has none (NVMe), the
cast goes into a pool buffer that the update hands to the write-behind with its other rows.

    plain loop this equals:   param_row[lo : lo + len(master)] = master.to(param_dtype)

(rounded ties away where the store says so: ``Config.param_rounding``, ``optim.masters.cast16_``).
With a remainder master the update makes the bf16 piece itself (``optim.masters.split_master_``):
``writes16`` puts it.
"""

from __future__ import annotations

import torch

from ..io.buffers import BufferPool
from ..layout.units import Unit, key
from ..offload.transfers import Write
from ..overlap import copies
from ..overlap.copies import SideCopies
from ..store import Store
from .masters import cast16_


class ParamCast:
    """Casts masters into the param tier's rows for ``store``; ``device`` is the compute device
    (CUDA: the copies to a device row run on a side stream of it)."""

    def __init__(self, store: Store, pool: BufferPool, device: torch.device):
        self.store, self.pool = store, pool
        self._h2d = SideCopies(device)

    def ready(self):
        """The event after which compute is done with the device rows queued so far (CUDA; None on
        CPU): an update casts into a unit's device row only once the compute that may still read it
        completed."""
        return self._h2d.after_compute()

    def writes(self, unit: Unit, master: torch.Tensor, lo: int = 0, ready=None) -> list[Write]:
        """Cast ``master`` (elements ``[lo, lo + len)`` of ``unit``'s row) into its param row:
        ``[]`` where the row was written in place (or the param row is the master row), else the one
        write of a staging buffer to issue. Call before the master's buffer goes to the write-behind
        (which gives it back to the pool once written), so nothing reads a buffer after it was given
        back."""
        staged = self.cast_(unit, master, lo, ready)
        if staged is None:
            return []
        return [Write(self.store.param_tier, key(unit.group, "param"), unit.row, staged, True, lo)]

    def writes_many(
        self, units: list[Unit], masters: list[torch.Tensor], ready=None
    ) -> list[Write]:
        """``writes`` of each unit's whole ``master``: one ``torch._foreach_copy_`` casts them all
        where every param row is a memory row on its master's device, apart from it, and cast by
        torch's rounding (as ``cast16_`` casts it); else ``writes`` of each."""
        tier = self.store.param_tier
        views = [tier.view(key(u.group, "param"), u.row) for u in units]
        if self.store.row_kinds.ties_away or any(
            v is None or v.device != m.device or v.data_ptr() == m.data_ptr()
            for v, m in zip(views, masters, strict=True)
        ):
            return [
                w for u, m in zip(units, masters, strict=True) for w in self.writes(u, m, 0, ready)
            ]
        views = [v[: m.numel()] for v, m in zip(views, masters, strict=True)]
        torch._foreach_copy_(views, masters)  # casts to param_dtype in place, one call for the run
        tier.count_view_io(written=sum(v.numel() * v.element_size() for v in views))
        return []

    def cast_(
        self, unit: Unit, master: torch.Tensor, lo: int = 0, ready=None
    ) -> torch.Tensor | None:
        """Cast ``master`` into the param tier's row in place (memory tiers), or into a staging
        buffer to write; None where nothing is left to write.

        A memory row on another device (CUDA params, host master) is filled straight from the master
        on the side stream once ``ready`` (the compute that may still read the row) completed, and
        waited for here: not through a staging buffer, and not queued behind the next layer's
        compute.
        """
        tier = self.store.param_tier
        view = tier.view(key(unit.group, "param"), unit.row)
        if view is not None:
            view = view[lo : lo + master.numel()]
            if view.device != master.device:
                src = self._rounded(master)
                # sync: the 16-bit copy is on the device
                copies.wait(self._h2d.copy_(view, src, ready))
            # an fp32 param row may be the master row itself
            elif view.data_ptr() != master.data_ptr():
                cast16_(
                    view, master, self.store.row_kinds.ties_away
                )  # casts to param_dtype in place
            tier.count_view_io(written=view.numel() * view.element_size())
            return None
        if (
            self.store.row_kinds.param_is_master
        ):  # NVMe: the param row is the master row written beside it
            return None
        staged = self.pool.take(master.numel(), self.store.row_kinds.param_dtype, master.device)
        cast16_(staged, master, self.store.row_kinds.ties_away)
        return staged

    def writes16(self, unit: Unit, copy16: torch.Tensor, lo: int = 0, ready=None) -> list[Write]:
        """Put ``copy16`` (a pool buffer of ``param_dtype``: elements ``[lo, lo + len)`` of
        ``unit``'s param row, consumed) into the row: copied into a memory row (and given back), or
        the one write that takes it."""
        tier = self.store.param_tier
        if tier.view(key(unit.group, "param"), unit.row) is None:
            return [Write(tier, key(unit.group, "param"), unit.row, copy16, True, lo)]
        self.cast_(unit, copy16, lo, ready)
        self.pool.give(copy16)
        return []

    def _rounded(self, master: torch.Tensor) -> torch.Tensor:
        """``master`` as the 16-bit copy on its own device (where a side stream copies it on)."""
        if master.dtype == self.store.row_kinds.param_dtype or not self.store.row_kinds.ties_away:
            return master  # torch's cast (nearest even) runs in the copy itself
        out = torch.empty(
            master.numel(), dtype=self.store.row_kinds.param_dtype, device=master.device
        )
        cast16_(out, master, self.store.row_kinds.ties_away)
        return out
