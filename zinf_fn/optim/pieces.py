"""The pieces of a row the optimizer updates one at a time, and the update of one piece.

A unit's update runs over fixed element ranges of its shard, ``[k P, (k + 1) P)``, in every tier:
the NVMe tier streams them (``optim.readahead``), the memory tiers update them in place. Every tier
cutting the same pieces matters for the bits: torch's fused kernels compute a span's vectorised body
and its scalar tail with different rounding (FMA), so the result depends on where the calls split a
row, and storage moves must not change a bit. ``P`` is ``Config.optimizer_piece_bytes`` of fp32,
rounded up to a multiple of ``ALIGN_ELEMENTS`` so that every piece of every dtype's row starts on
the O_DIRECT alignment (a 16-bit copy's piece is half the bytes of its master's), and on a block of
int8 moments (``formats.BLOCK`` divides ``ALIGN_ELEMENTS``; so does every int8 group's shard,
``Store.shard_align``).

    plain loop a piece-wise update equals (the spans of one piece, each a call of the fused kernel):
        for lo, hi in pieces(n, P): for a, b, g in grad_spans(grad, lo, hi): opt.update(g,
        state[a:b], master[a:b], ...)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..io import odirect
from ..scan.grads import LeafGrads
from .compressed import AdamWHyper, Bf16Moments, Int8Moments, RemainderMaster, adamw_piece_
from .optimizers import DecaySpans, Optimizer, learning_rate

# elements of the narrowest stored dtype (16-bit) in one alignment
ALIGN_ELEMENTS = odirect.ALIGN // 2


def piece_numel(piece_bytes: int) -> int:
    """Elements of one piece: ``piece_bytes`` of fp32, rounded up to a multiple of
    ``ALIGN_ELEMENTS``."""
    return odirect.align_up(max(1, piece_bytes // 4), ALIGN_ELEMENTS)


def pieces(numel: int, size: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: the pieces of a ``numel``-element row, ``size`` elements each but the
    last."""
    return [(lo, min(lo + size, numel)) for lo in range(0, numel, size)] or [(0, 0)]


def grad_spans(grad: torch.Tensor | LeafGrads, lo: int, hi: int) -> list[tuple[int, torch.Tensor]]:
    """The gradient of elements ``[lo, hi)`` of the row: ``[(offset from lo, flat gradient), ...]``.

    ``grad`` is the row's flat gradient, the piece's own (``hi - lo`` elements), or a ``LeafGrads``
    (one span per leaf that overlaps the piece, cut at its edges)."""
    if isinstance(grad, LeafGrads):
        out = []
        for offset, g in grad.spans():
            a, b = max(offset, lo), min(offset + g.numel(), hi)
            if a < b:
                out.append((a - lo, g[a - offset : b - offset]))
        return out
    return [(0, grad if grad.numel() == hi - lo else grad[lo:hi])]


class Compressed(NamedTuple):
    """A piece of compressed moments: where it sits, for the rounding and the blocks (its first
    element's index in the unit's padded flat row: this rank's shard offset + the piece's; the
    unit's seed, its index), and their format ("bf16" or "int8")."""

    element_offset: int
    unit_seed: int
    moments: str = "bf16"


# a piece's state rows (``Store.rows_of`` order), named
MOMENTS = {"bf16": Bf16Moments, "int8": Int8Moments}


def update_piece_(
    opt: Optimizer,
    spans: list,
    master: torch.Tensor | RemainderMaster,
    state: tuple,
    step: int,
    decay: DecaySpans | None,
    lo: int,
    compressed: Compressed | None = None,
) -> None:
    """``opt.update`` on each gradient span of one piece: ``master`` and ``state`` are the piece's
    elements (views or buffers, updated in place); ``decay`` is the shard's ``DecaySpans`` (None:
    decay everything) and ``lo`` where the piece starts in the shard. ``compressed``: the moments
    are bf16 (m, v) or int8 (m codes, m scales, v codes, v scales: ``state`` holds the piece's
    blocks), updated by ``optim.compressed.adamw_piece_`` over the whole piece at once (its gradient
    gathered from the spans, zero where no span covers it); only they take a ``RemainderMaster``
    (its two halves, updated in the same pass: ``optim.masters.piece_master``)."""
    if compressed is not None:
        return _compressed_piece_(opt, spans, master, state, step, decay, lo, compressed)
    for offset, g in spans:
        a, b = offset, offset + g.numel()
        views = (master[a:b], *(s[a:b] for s in state))
        # the span's part of the decayed spans
        cut = None if decay is None else decay.slice(lo + a, lo + b)
        new_master, new_state = opt.update(g, tuple(views[1:]), views[0], step, cut)
        for view, out in zip(views, (new_master, *new_state), strict=True):
            # an optimizer that returned new tensors: keep them
            if out.data_ptr() != view.data_ptr():
                view.copy_(out)


def _compressed_piece_(
    opt: Optimizer,
    spans: list,
    master: torch.Tensor | RemainderMaster,
    state: tuple,
    step: int,
    decay: DecaySpans | None,
    lo: int,
    where: Compressed,
) -> None:
    """``adamw_piece_`` on the piece's compressed moments ``state``, its gradient one tensor of the
    piece."""
    # the piece's size and device
    like = master.param if isinstance(master, RemainderMaster) else master
    n = like.numel()
    if len(spans) == 1 and spans[0][0] == 0 and spans[0][1].numel() == n:
        grad = spans[0][1]
    else:
        grad, cursor = torch.empty(n, dtype=torch.float32, device=like.device), 0
        # in order (``grad_spans``): the gaps between them, and the padding, are zeros
        for offset, g in spans:
            grad[cursor:offset].zero_()
            grad[offset : offset + g.numel()] = g
            cursor = offset + g.numel()
        grad[cursor:].zero_()
    h = opt.hyperparams
    hyper = AdamWHyper(h["b1"], h["b2"], h["eps"], h["weight_decay"])
    moments = MOMENTS[where.moments](*state)
    adamw_piece_(
        grad.contiguous(),
        master,
        moments,
        hyper,
        step,
        learning_rate(opt.lr, step),
        where.element_offset,
        where.unit_seed,
        decay=None if decay is None else decay.slice(lo, lo + n),
    )
