"""The tiled vocabulary head: cross-entropy of ``h @ W.T`` with W in row tiles over the vocabulary,
its logits one ``(N, V_t)`` tile at a time (the log-sum-exp accumulated online, tile by tile).

In forward a tile is taken a chunk of rows at a time on the CPU (``CHUNK_BYTES``, ``_Chunks``): the
chunk's logits, its step of the online log-sum-exp and, for a frozen W, its share of the pull-back
below are made while the chunk is in cache, so W crosses memory once. A tile of another dtype than
h's (a frozen 16-bit head lent as stored, ``layout.policy.GroupPolicy.lent_as``) is cast a chunk at
a time into one reused buffer: the values the fetcher's cast would make, no tile of h's dtype.

What it reads of W, per call:

- W trains (a tile's gradient is wanted): every tile in forward (the log-sum-exp), and every tile
  again in backward, in reverse, where ``p = exp(h W_t^T - lse)`` gives ``dW_t = (p - onehot)^T h``
  and ``dh += (p - onehot) W_t``.
- W frozen (no tile takes a gradient) and h differentiated: every tile once, in forward. The
  softmax's pull-back to h is summed there, as the online log-sum-exp goes: with a row's running max
  m and sum s, ``A = sum_t exp(z_t - m) W_t`` (rescaled by ``exp(m_old - m_new)`` when m grows)
  and the target's row ``W[y]``, so that at the end ``sum_t p_t W_t = A / s`` and::

      d loss / d h = coef * (A / s - W[y]),   coef = valid / n  ("mean"; valid for "sum")

  known in forward but for the loss's own gradient, which the backward multiplies in: it fetches no
  tile (the tile plan plans none either, ``tiling.plan.backward_reads``).

At rows whose products run on one thread (CPU, at most ``ONE_THREAD_ROWS``) the forward keeps two
online log-sum-exps (``_Lane``), each taking half of every tile's chunks, one on the side thread
(``two_at_once.both``), merged at the end (``_merged``: each lane's sum and pull-back rescaled to
the larger running max and added): two cores for the 30B step's frozen 151,936-row head at 32
tokens, and the same bits whether the side thread or the compute thread computes the second lane.

Numerics: dh is the same sum of the same fp32 products ``p_v W_v`` as ``F.cross_entropy``'s
backward, in another order (a running sum rescaled once per tile, then one division by s, where the
untiled op divides each p_v first): a reassociation of fp32 sums, within the few-ulp bound the
tiled ops' tests check (``tests/tiling/test_tiling.py``). The loss is the same online log-sum-exp
(its rescaling once per chunk, the logits' dot products blocked by BLAS as the chunk's shape says;
at one thread's rows two lanes' merged once more): within a few ulps of ``F.cross_entropy``'s, as
before (``tests/tiling/test_head_chunks.py``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import two_at_once
from .ops import _as_tiles, _backward_tiles, _row_tile_back, _Tiles, _weight_grads

# the bytes of a tile's chunk in h's dtype (``_Chunks``): small enough to stay in cache between
# the two products over it (a core's 2 MiB L2 and the shared L3 here), large enough that BLAS's
# per-call cost stays small; 4 MiB measured best of 1-8 MiB (``benchmarks/head.py``'s chunk_ms)
CHUNK_BYTES = 4 << 20
# h of at most this many rows: a CPU forward's chunks run on one thread. Their products are then
# (R, D) x (D, N) with N small, each a fraction of a millisecond: a second thread's share of one
# is smaller than what waiting for it costs where any other thread wants a core (the engine's
# fetches and reads beside the head, another process), and the other core stays theirs
ONE_THREAD_ROWS = 64


class _Pulled(NamedTuple):
    """A frozen head's pull-back to h, summed in forward: ``A`` (N, D) fp32, the softmax's
    unnormalised rows times W so far (relative to the running max), and ``W[y]`` (N, D), each
    target's row of W (zero where the target is ignored)."""

    a: torch.Tensor
    w_target: torch.Tensor

    @staticmethod
    def zeros(h2: torch.Tensor) -> _Pulled:
        return _Pulled(h2.new_zeros(h2.shape, dtype=torch.float32), h2.new_zeros(h2.shape))

    def add_(self, scale: torch.Tensor, e: torch.Tensor, w: torch.Tensor, found) -> None:
        """Rows ``w`` (R, D) in: ``A = A * scale + e @ w`` (``e`` (N, R) fp32: exp(z - m_new),
        ``scale`` (N,): exp(m_old - m_new)); the targets ``found`` in it (rows, columns) take their
        rows of ``w``."""
        self.a.mul_(scale[:, None])
        if w.dtype == self.a.dtype:
            self.a.addmm_(e, w)
        else:  # 16-bit rows (16-bit compute): their product is summed into the fp32 A
            self.a.add_(torch.mm(e.to(w.dtype), w))
        rows, cols = found
        self.w_target[rows] = w[cols]

    def grad(self, s: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """``coef * (A / s - W[y])`` (N, D) fp32: d loss / d h for a loss gradient of one."""
        return (self.a / s[:, None] - self.w_target.float()) * coef[:, None]


class _Online:
    """The online log-sum-exp over the logits' chunks as they come: each row's running max ``m``
    and sum ``s`` of exp(z - m), its target's logit, and where ``eager`` the pull-back
    (``_Pulled``)."""

    def __init__(self, h2: torch.Tensor, tgt: torch.Tensor, eager: bool):
        n = h2.shape[0]
        self.tgt = tgt
        # (D, N): the logits are made as ``w @ h^T``, the chunk's rows the product's long side,
        # which BLAS computes at its speed where ``h @ w^T`` (N small) packs the chunk each time
        self.h_t = h2.T.contiguous()
        self.m = torch.full((n,), float("-inf"), device=h2.device)  # running max, fp32
        self.s = torch.zeros(n, device=h2.device)  # running sum of exp(z - m)
        self.target_logit = torch.zeros(n, device=h2.device)
        self.pulled = _Pulled.zeros(h2) if eager else None

    def add_(self, w: torch.Tensor, off: int) -> None:
        """The rows ``w`` (R, D) of W from vocabulary row ``off`` in: their logits ``h @ w.T``,
        the only ones that exist at once."""
        z = (w @ self.h_t).float().T  # (N, R), a view of the (R, N) product
        m_new = torch.maximum(self.m, z.max(dim=1).values)
        scale = torch.exp(self.m - m_new)  # (N,)
        e = torch.exp(z - m_new[:, None])  # (N, R)
        self.s = self.s * scale + e.sum(dim=1)
        self.m = m_new
        found = _targets_in(self.tgt, off, w.shape[0])
        self.target_logit[found[0]] = z[found]
        if self.pulled is not None:
            self.pulled.add_(scale, e, w, found)

    def lse(self) -> torch.Tensor:
        """(N,) each row's log-sum-exp over the rows added."""
        return self.m + torch.log(self.s)


class _Chunks:
    """A tile's rows in chunks that stay in cache (on the CPU, ``CHUNK_BYTES``), in h's dtype: a
    tile stored in another (a frozen 16-bit tile lent as stored, ``GroupPolicy.lent_as``) is cast a
    chunk at a time into one reused buffer, so both products over a chunk (its logits, its
    pull-back) read it from cache and no tile of h's dtype is made. Elsewhere (a GPU) a chunk is
    the whole tile."""

    def __init__(self, h2: torch.Tensor, most_rows: int):
        d, size = h2.shape[1], h2.element_size()
        on_cpu = h2.device.type == "cpu"
        self.rows = max(1, CHUNK_BYTES // (d * size)) if on_cpu else most_rows
        self.dtype = h2.dtype
        self._buf: torch.Tensor | None = None
        self._shape = (min(self.rows, most_rows), d)
        self._device = h2.device

    def of(self, w: torch.Tensor):
        """(first row, rows (R, D) in h's dtype) for each chunk of tile ``w`` (V_t, D), in order;
        a cast chunk is valid until the next is yielded."""
        for start in range(0, w.shape[0], self.rows):
            part = w[start : start + self.rows]
            yield start, part if part.dtype == self.dtype else self._cast(part)

    def _cast(self, part: torch.Tensor) -> torch.Tensor:
        if self._buf is None:
            self._buf = torch.empty(self._shape, dtype=self.dtype, device=self._device)
        out = self._buf[: part.shape[0]]
        out.copy_(part)
        return out


class _Lane:
    """One online log-sum-exp (``_Online``) and the chunks it reads a tile's rows in (``_Chunks``,
    its own cast buffer): a forward on one thread keeps two, each taking half of every tile's
    chunks, one of them on the side thread (``two_at_once``), merged at the end (``_merged``)."""

    def __init__(self, h2: torch.Tensor, tgt: torch.Tensor, eager: bool, most_rows: int, one: bool):
        self.online = _Online(h2, tgt, eager)
        self.chunks = _Chunks(h2, most_rows)
        self.one = one  # the products on one thread (``_one_thread``)

    def add_(self, w: torch.Tensor, off: int, r0: int, r1: int) -> None:
        """Rows r0..r1 of tile ``w`` (W's rows from ``off``) in, a chunk at a time; torch's
        products on one thread where ``one``: the calling thread's own setting
        (``two_at_once.torch_on_one_thread``; torch's count is per thread), so a lane on the side
        thread sets its own and the compute thread's count, which ``two_at_once`` reads, stays."""
        with two_at_once.torch_on_one_thread(self.one):
            for start, part in self.chunks.of(w[r0:r1]):  # (R, D), in h's dtype
                self.online.add_(part, off + r0 + start)


def _add_tile(lanes: list[_Lane], w: torch.Tensor, off: int) -> None:
    """Tile ``w`` (W's rows from ``off``) into ``lanes``: whole into one, else its first half of
    chunks into the first and the rest into the second, at once (``two_at_once.both``)."""
    if len(lanes) == 1:
        lanes[0].add_(w, off, 0, w.shape[0])
        return
    rows = lanes[0].chunks.rows
    chunks = -(-w.shape[0] // rows)
    cut = min(w.shape[0], (chunks + 1) // 2 * rows)  # after ceil(chunks / 2) chunks
    two_at_once.both(
        functools.partial(lanes[0].add_, w, off, 0, cut),
        functools.partial(lanes[1].add_, w, off, cut, w.shape[0]),
    )


def _merged(lanes: list[_Lane]) -> _Online:
    """The lanes' online log-sum-exps as one: the first's, with each other's sum and pull-back
    rescaled to the larger running max and added (a target's logit and row are in one lane only,
    zero in the others)."""
    out = lanes[0].online
    for lane in lanes[1:]:
        other = lane.online
        m = torch.maximum(out.m, other.m)
        mine, theirs = torch.exp(out.m - m), torch.exp(other.m - m)  # (N,)
        out.s = out.s * mine + other.s * theirs
        out.m = m
        out.target_logit = out.target_logit + other.target_logit
        if out.pulled is not None:
            a = out.pulled.a * mine[:, None] + other.pulled.a * theirs[:, None]
            out.pulled = _Pulled(a, out.pulled.w_target + other.pulled.w_target)
    return out


def _one_thread(h2: torch.Tensor) -> bool:
    """Whether the forward's products run on one thread (and in two lanes, ``_Lane``, whatever
    the threads torch has: the same bits on any): ``h2`` (N, D) on the CPU with at most
    ``ONE_THREAD_ROWS`` rows."""
    return h2.device.type == "cpu" and h2.shape[0] <= ONE_THREAD_ROWS


class _TiledCrossEntropy(torch.autograd.Function):
    """Mean (or summed) cross-entropy of ``h @ W.T`` with W in row tiles (module docstring).

    Returns (loss, lse, pulled), the last two non-differentiable: ``lse`` (N,), saved, so a backward
    over the tiles makes one pass (p = exp(z - lse) per tile, never the whole (N, V) softmax);
    ``pulled`` (N, D), where ``eager`` (a frozen W, h differentiated), d loss / d h for a loss
    gradient of one, made in forward, so the backward fetches no tile; else an empty tensor.
    """

    @staticmethod
    def forward(h, targets, ignore_index: int, summed: bool, eager: bool, tiles: _Tiles, *weights):
        h2, tgt = h.reshape(-1, h.shape[-1]), targets.reshape(-1)  # (N, D), (N,)
        most = max(shape[0] for shape in tiles.shapes)
        one = _one_thread(h2)
        lanes = [_Lane(h2, tgt, eager, most, one) for _ in range(2 if one else 1)]
        for t, off in enumerate(tiles.offsets()):
            _add_tile(lanes, tiles.get(weights, t), off)
            tiles.drop(t)
        online = _merged(lanes)
        lse = online.lse()  # (N,)
        valid = tgt != ignore_index
        total = ((lse - online.target_logit) * valid).sum()
        coef = valid.float() if summed else valid / valid.sum()  # (N,): d loss / d (lse - z_y)
        pulled = online.pulled
        grad = pulled.grad(online.s, coef) if pulled is not None else h2.new_empty(0)
        return (total if summed else total / valid.sum()), lse, grad

    @staticmethod
    def setup_context(ctx, inputs, output):
        h, targets, ignore_index, summed, eager, tiles, *weights = inputs
        ctx.mark_non_differentiable(output[1], output[2])
        ctx.tiles, ctx.ignore_index, ctx.summed, ctx.eager = tiles, ignore_index, summed, eager
        ctx.weight_inputs = tuple(weights)
        kept = output[2] if eager else output[1]  # the pull-back made, or the lse to make it
        ctx.save_for_backward(h, targets, kept, *(weights if tiles.source is None else ()))

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse, _grad_pulled):
        if ctx.eager:
            return _eager_backward(ctx, grad_loss)
        tiles, weights, offs, grads, wanted = _backward_tiles(ctx, 6)
        h, targets, lse = ctx.saved_tensors[:3]
        h2, tgt = h.reshape(-1, h.shape[-1]), targets.reshape(-1)  # (N, D), (N,)
        valid = tgt != ctx.ignore_index
        # (N,): d loss / d (lse_n - z_n,target)
        coef = (grad_loss if ctx.summed else grad_loss / valid.sum()) * valid
        want_h = ctx.needs_input_grad[0]
        dh = torch.zeros_like(h2) if want_h else None
        for t in reversed(range(tiles.n_tiles)):
            w = tiles.get(weights, t)  # (V_t, D)
            # (N, V_t): softmax restricted to the tile
            p = torch.exp((h2 @ w.T).float() - lse[:, None])
            rows, cols = _targets_in(tgt, offs[t], w.shape[0])
            p[rows, cols] -= 1.0
            p = (p * coef[:, None]).to(h2.dtype)  # (N, V_t): d loss / d logits
            _row_tile_back(tiles, grads, t, p, w, h2, dh, wanted[t])
            tiles.drop(t)
        d_h = dh.reshape(h.shape) if want_h else None
        return (d_h, None, None, None, None, None, *_weight_grads(tiles, ctx.weight_inputs, grads))


def _eager_backward(ctx, grad_loss: torch.Tensor) -> tuple:
    """The backward of a frozen head: the loss's gradient times the pull-back made in forward; no
    tile is fetched, no tile gradient made."""
    h, _targets, pulled = ctx.saved_tensors[:3]
    d_h = (pulled * grad_loss).to(h.dtype).reshape(h.shape) if ctx.needs_input_grad[0] else None
    tiles: _Tiles = ctx.tiles
    weights = ctx.weight_inputs
    grads = [None] * len(weights)  # a frozen W's tiles: none
    return (d_h, None, None, None, None, None, *_weight_grads(tiles, weights, grads))


def _targets_in(tgt: torch.Tensor, off: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices, column indices within the tile) of the targets that fall in [off, off + n)."""
    rows = ((tgt >= off) & (tgt < off + n)).nonzero(as_tuple=True)[0]
    return rows, tgt[rows] - off


def _pulls_back_in_forward(h: torch.Tensor, weights: tuple) -> bool:
    """Whether the pull-back to h is made in forward: gradients are recorded, h takes one, and no
    weight input does (a frozen source's anchor, or tiles that require none)."""
    wanted = torch.is_grad_enabled() and h.requires_grad
    return wanted and not any(w.requires_grad for w in weights)


def linear_cross_entropy(
    h: torch.Tensor, w, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """``F.cross_entropy((h @ W.T).float(), targets)``, mean over targets != ``ignore_index``; a 0-d
    fp32 tensor. ``reduction="sum"``: their sum (what a ``zf.TokenLoss`` head returns).

    ``h`` is ``(..., D)``, ``targets`` the matching ``(...)`` integer ids, ``W`` is ``(V, D)``. With
    ``W`` as a ``RowTiles`` or a row-tiled ``TileSource`` the logits exist one ``(N, V/T)`` tile at
    a time in forward and in backward (the log-sum-exp is accumulated online); a frozen ``W`` is
    read once, in forward (module docstring). A plain tensor runs the untiled op.
    """
    if h.shape[:-1] != targets.shape:
        raise ValueError(
            f"linear_cross_entropy: h is {tuple(h.shape)}, targets {tuple(targets.shape)}; "
            "expected h = (..., D) and targets = (...)"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}"
        )
    if isinstance(w, torch.Tensor):
        logits = F.linear(h, w).float()  # (..., V)
        return F.cross_entropy(
            logits.reshape(-1, w.shape[0]),
            targets.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
        )
    tiles, weights = _as_tiles(w)
    if tiles.axis != 0:
        raise ValueError(
            "linear_cross_entropy: the vocabulary weight must be tiled over rows (RowTiles, axis "
            "0), got tiles over axis 1"
        )
    eager = _pulls_back_in_forward(h, weights)
    loss, _lse, _pulled = _TiledCrossEntropy.apply(
        h, targets, ignore_index, reduction == "sum", eager, tiles, *weights
    )
    return loss
