"""How a restore fills a group's rows from a checkpoint in another format: slot by slot.

Each group's rows hold slots (``zinf_fn.state.RowFormat.slot_of``): the master (the "master" row, or
the "param" and "remainder" rows), the 16-bit copy of an fp32 master ("param"), and each optimizer
leaf ("opt.<i>", with the rows its format adds). A slot stored alike in the checkpoint and the state
(the same kinds, dtypes and sizes, and for the 16-bit copy the same rounding rule) is read straight
into the state's rows; any other is read in the checkpoint's format, decoded to fp32 and encoded
into the state's,
by the engine's one codec (``RowFormat.decode`` / ``encode``)::

    remainder -> fp32 master    join (exact)          fp32 -> remainder    split (exact; the copy
    ties away) bf16 -> fp32 moments        the upcast (exact)    fp32 -> bf16         the engine's
    stochastic rounding,
                                                                           keyed as the last
                                                                           update's write
    int8 -> fp32                dequantize            fp32 -> int8         quantize (blocks of 256)
    16-bit copy                 read as saved where its dtype and rounding agree, else cast from the
                                checkpoint's master as the state's engine casts it (ties away or to
                                even)

The stochastic rounding of a converted bf16 moment is keyed by (unit index, saved step - 1, element
index): the rounding the engine's write at the update that produced the saved value would have
drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from zinf_fn.state import RowFormat, StoredRows, Where


class Slot(NamedTuple):
    """How one slot of a group's rows is filled: ``sources`` are the checkpoint's kinds read (each
    into a row of its own dtype); ``convert(rows, where, keep)`` makes the state's rows ``targets``
    of them: the sources decoded, cut to ``keep`` (the state's shard of the elements read) and
    encoded (None: each source kind is its own target, read straight into it)."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    convert: Callable[[dict[str, torch.Tensor], Where, slice], dict[str, torch.Tensor]] | None
    source_format: RowFormat  # what the sources' padding holds, and how they decode


def restore_plan(
    saved: StoredRows, state: StoredRows, group: str, param_is_master: bool = False
) -> list[Slot]:
    """The slots of ``group``'s rows in the order a restore fills them (``saved``: the rows the
    checkpoint stores, ``state``: the rows of the state being filled). ``param_is_master``: the
    state's param row is its master row (fp32 params in memory, a group that trains:
    ``StateView.shares_master``), which fills it."""
    src_fmt, dst_fmt = saved.row_format(group), state.row_format(group)
    src, dst = _slots(saved, group, src_fmt), _slots(state, group, dst_fmt)
    plan = []
    for name, kinds in dst.items():
        if name == "param" and param_is_master:
            continue
        targets = tuple(k for k, _ in kinds)
        if src.get(name) == kinds and (name != "param" or _same_copy(src_fmt, dst_fmt)):
            plan.append(Slot(targets, targets, None, src_fmt))
            continue
        origin = name if name.startswith("opt.") else "master" if "master" in src else "param"
        sources = tuple(k for k, _ in src[origin])
        plan.append(Slot(sources, targets, _converter(name, src_fmt, dst_fmt), src_fmt))
    return plan


def _slots(
    rows: StoredRows, group: str, fmt: RowFormat
) -> dict[str, list[tuple[str, torch.dtype]]]:
    """slot -> [(kind, dtype), ...] of ``group``'s rows, in the rows' order. Their sizes are not
    compared: a checkpoint's rows are logical (the unit's real elements), read into whatever shard
    the state cuts."""
    out: dict[str, list] = {}
    for kind in rows.kinds(group):
        out.setdefault(fmt.slot_of(kind), []).append((kind, rows.dtype(kind, group)))
    return out


def _same_copy(src: RowFormat, dst: RowFormat) -> bool:
    """Whether a saved 16-bit copy is the one the state's engine would cast: the same rounding, or a
    group whose param row is its only row (nothing to cast it from)."""
    return src.ties_away == dst.ties_away or "none" in (src.master, dst.master)


def _converter(slot: str, src: RowFormat, dst: RowFormat):
    """rows of the checkpoint's slot -> the state's rows of ``slot``: decode in ``src``, encode in
    ``dst`` (the 16-bit copy from the master)."""
    origin = "master" if slot == "param" else slot

    def convert(
        rows: dict[str, torch.Tensor], where: Where, keep: slice
    ) -> dict[str, torch.Tensor]:
        return dst.encode(slot, src.decode(origin, rows)[keep], where)

    return convert
