"""The pieces of a row the optimizer updates one at a time, and the update of one piece.

A unit's update runs over fixed element ranges of its shard, ``[k P, (k + 1) P)``, in every tier:
the NVMe tier streams them (``optim.readahead``), the memory tiers update them in place. Every tier
cutting the same pieces matters for the bits: torch's fused kernels compute a span's vectorised body
and its scalar tail with different rounding (FMA), so the result depends on where the calls split a
row, and storage moves must not change a bit. ``P`` is ``Config.optimizer_piece_bytes`` of fp32,
rounded up to a multiple of ``ALIGN_ELEMENTS`` so that every piece of every dtype's row starts on
the O_DIRECT alignment (a 16-bit copy's piece is half the bytes of its master's), and on a block of
int8 moments (``formats.BLOCK`` divides ``ALIGN_ELEMENTS``; so does every int8 group's shard,
``RowKinds.shard_align``).

    plain loop a piece-wise update equals (the spans of one piece, each a call of the fused kernel):
        for lo, hi in pieces(n, P): for a, b, g in grad_spans(grad, lo, hi): opt.update(g,
        state[a:b], master[a:b], ...)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..io import odirect
from ..scan.grads import LeafGrads
from . import formats
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


# a piece's state rows (``RowKinds.rows_of`` order), named
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
    """``adamw_piece_`` on the piece's compressed moments ``state``, run by run of its gradient
    (``_grad_runs``: a long span read where it lies, no copy; the runs start and end on blocks, so
    the bits are the whole piece's)."""
    # the piece's size and device
    like = master.param if isinstance(master, RemainderMaster) else master
    n = like.numel()
    h = opt.hyperparams
    hyper = AdamWHyper(h["b1"], h["b2"], h["eps"], h["weight_decay"])
    lr = learning_rate(opt.lr, step)
    for a, b, grad in _grad_runs(spans, n, like.device):
        adamw_piece_(
            grad.contiguous(),
            _master_run(master, a, b),
            _moments_run(where.moments, state, a, b),
            hyper,
            step,
            lr,
            where.element_offset + a,
            where.unit_seed,
            decay=None if decay is None else decay.slice(lo + a, lo + b),
        )


# the shortest span of a gradient the update reads where it lies (elements): a kernel call costs
# tens of microseconds, so shorter spans are gathered with their neighbours into one buffer
DIRECT_NUMEL = 1 << 16


def _grad_runs(spans: list, n: int, device) -> list[tuple[int, int, torch.Tensor]]:
    """``[(a, b, the gradient of elements [a, b)), ...]`` covering the piece's ``[0, n)`` in order:
    the whole blocks (``formats.BLOCK``) of a span of at least ``DIRECT_NUMEL`` elements (or of the
    whole piece) as a view of it, the elements between gathered (``_gathered``)."""
    direct = []
    for offset, g in spans:
        end = offset + g.numel()
        if offset == 0 and end == n:  # the piece's whole gradient
            direct.append((0, n, g))
            continue
        a = -(-offset // formats.BLOCK) * formats.BLOCK
        b = end // formats.BLOCK * formats.BLOCK
        if b - a >= DIRECT_NUMEL:
            direct.append((a, b, g[a - offset : b - offset]))
    runs, cursor = [], 0
    for a, b, g in [*direct, (n, n, None)]:
        if cursor < a:
            runs.append((cursor, a, _gathered(spans, cursor, a, device)))
        if g is not None:
            runs.append((a, b, g))
        cursor = b
    return runs


def _gathered(spans: list, lo: int, hi: int, device) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a piece's gradient in one new buffer: the parts of the ``spans``
    (in order, disjoint) that fall in it, zeros between them and where none covers it."""
    out, cursor = torch.empty(hi - lo, dtype=torch.float32, device=device), lo
    for offset, g in spans:
        a, b = max(offset, lo), min(offset + g.numel(), hi)
        if a < b:
            out[cursor - lo : a - lo].zero_()
            out[a - lo : b - lo] = g[a - offset : b - offset]
            cursor = b
    out[cursor - lo :].zero_()
    return out


def _master_run(master: torch.Tensor | RemainderMaster, a: int, b: int):
    """Elements ``[a, b)`` of a piece's master (of its two halves, for a remainder master)."""
    if isinstance(master, RemainderMaster):
        return RemainderMaster(master.param[a:b], master.remainder[a:b])
    return master[a:b]


def _moments_run(moments: str, state: tuple, a: int, b: int):
    """Elements ``[a, b)`` of a piece's compressed moments ``state`` (int8: ``a`` and ``b`` on
    blocks, whose scales are the blocks' ``[a // BLOCK, b // BLOCK)``)."""
    if moments == "int8":
        blocks = slice(a // formats.BLOCK, b // formats.BLOCK)
        return Int8Moments(state[0][a:b], state[1][blocks], state[2][a:b], state[3][blocks])
    return MOMENTS[moments](*(s[a:b] for s in state))
