"""What an op may be handed in place of a weight's tensor: the engine's ``TileSource`` (a tiled
weight whose tiles it fetches one at a time) and a ``LentWeight`` (a weight in the form it is stored
in, computed from as it is), and the checks that tell them apart (``is_source``, ``is_lent``).
``tiling.ops``, ``tiling.experts`` and the engine's handles take and make them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class LentWeight(Protocol):
    """A weight lent in the form it is stored in (``stored``), which the op computes from instead
    of a tensor of its values: ``linear(x, b)`` is ``F.linear(x, W, b)`` and ``grad_input(g)`` is
    ``g @ W``, W its matrix ``(d_out, d_in)`` (``matrix``: a tile ``(1, d_out, d_in)``'s last two
    dims); ``on(stored)`` is the same weight over other bytes (equal ones: the refetched layer's);
    ``one_thread(rows)`` whether its products of ``rows`` rows run on one thread, ``linear_rows(x,
    r0, r1)`` columns r0..r1 of ``linear(x)`` alone and ``grad_input_columns(g, c0, c1)`` columns
    c0..c1 of ``grad_input(g)`` (c0, c1 multiples of ``column_block``), None where it cannot.
    What a frozen expert's tile and a frozen linear of a block (``zf.Model.takes_lent``) stored as
    NF4 codes are fetched as (``formats.nf4_linear.CodedMatrix``: the products read its codes,
    never a decoded weight); ``tiling.experts`` and ``linear`` (``tiling.lent``) take one."""

    shape: tuple[int, ...]
    stored: torch.Tensor
    column_block: int

    @property
    def matrix(self) -> tuple[int, int]: ...
    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor: ...
    def grad_input(self, g: torch.Tensor) -> torch.Tensor: ...
    def on(self, stored: torch.Tensor) -> LentWeight: ...
    def one_thread(self, rows: int) -> bool: ...
    def linear_rows(self, x: torch.Tensor, r0: int, r1: int) -> torch.Tensor | None: ...
    def grad_input_columns(self, g: torch.Tensor, c0: int, c1: int) -> torch.Tensor | None: ...


@runtime_checkable
class TileSource(Protocol):
    """A tiled weight whose tiles live elsewhere; what the engine puts in place of a tiled node.

    ``anchor`` is a zero-size tensor that is a differentiated input of the caller: passing it into
    the op keeps the op on the autograd tape even when its activation input needs no gradient; the
    anchor of a frozen weight requires none (``zinf_fn.formats.frozen``), and the op computes and
    emits no tile gradient then. ``grad_out(t, dtype)``: a buffer of ``tile_shape(t)`` that the op
    may write tile t's gradient of ``dtype`` into before handing it to ``emit_grad`` (which then
    takes it without a copy), or None. The op asks for it only after its last read of the fetched
    tile t, whose memory it may be.

    ``will_use(tiles, others)``: an op that fetches only some tiles (``tiling.experts``: the
    experts that received tokens) says which, before the first: for each t of the tiles it
    returns, tile t of this source, then tile t of each of ``others`` (sources of the same
    apply). It returns
    ``tiles``, or where several data-parallel ranks fetch every tile together (each fetch a
    collective), the union of every rank's ``tiles`` in increasing order (on one rank the engine's
    sources return ``tiles`` in the order to compute them: ``tiling.routed.predicted_first``;
    the op computes them in the order returned): every rank then fetches
    those, a rank without tokens for one computing it on no rows. It is itself a collective there:
    every rank calls it at the same point of the same apply. The source may prefetch what it names.
    """

    axis: int
    n_tiles: int
    anchor: torch.Tensor

    def tile_shape(self, t: int) -> tuple[int, ...]: ...
    def fetch(self, t: int) -> torch.Tensor | LentWeight: ...
    def release(self, t: int) -> None: ...
    def grad_out(self, t: int, dtype: torch.dtype) -> torch.Tensor | None: ...
    def emit_grad(self, t: int, grad: torch.Tensor) -> None: ...
    def will_use(self, tiles: tuple[int, ...], others: tuple = ()) -> tuple[int, ...]: ...


def is_source(w) -> bool:
    """Whether ``w`` is a ``TileSource``: not a tensor, with the protocol's ``will_use`` (a tiles
    node has none). Duck-typed: ``isinstance`` against a runtime-checkable protocol costs ~25 us a
    call on Python 3.11, and the ops ask it of every expert they compute."""
    return not isinstance(w, torch.Tensor) and hasattr(w, "will_use")


def is_lent(w) -> bool:
    """Whether ``w`` is a ``LentWeight`` (not a tensor, with its ``grad_input``; duck-typed as
    ``is_source``)."""
    return not isinstance(w, torch.Tensor) and hasattr(w, "grad_input")
