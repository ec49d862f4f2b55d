"""A lookup table as an ``init``/``apply`` pair over ``{"w"}``; ``"w"`` is
``nn.Embedding.weight``.

A vocabulary table may be tiled over its rows (``tiles`` > 1: a ``tiling.RowTiles``, each tile a
fetch unit of the engine), and then ``apply`` fetches only the tiles holding the batch's ids
(``tiling.embedding``). ``table`` is the one way a (V, D) vocabulary matrix is drawn, for the
embedding and for an LM head alike.
"""

from __future__ import annotations

from functools import partial

import torch

from zinf_fn import tiling


def init(
    gen: torch.Generator,
    n: int,
    d: int,
    std: float = 0.02,
    tiles: int = 1,
    tile_seeds: bool = False,
) -> dict:
    """Return ``{"w": (n, d) ~ N(0, std)}`` in fp32 (``table``)."""
    return {"w": table(gen, n, d, std, tiles, tile_seeds)}


def table(
    gen: torch.Generator,
    n: int,
    d: int,
    std: float = 0.02,
    tiles: int = 1,
    tile_seeds: bool = False,
) -> torch.Tensor | tiling.RowTiles:
    """An (n, d) matrix ~ N(0, std) in fp32 on ``gen``'s device, whole or as ``tiles`` row tiles.

    Drawn from ``gen`` at once (``tiles`` > 1: then cut, ``tiling.tile``), or with ``tile_seeds``
    tile by tile, each from a generator seeded from ``gen`` (one draw of ``tiles`` seeds): a
    ``RowTiles`` of ``tiling.Deferred`` tiles that ``zf.init`` makes one at a time, never the whole
    table (its values then depend on ``tiles``; ``tiling.untile`` joins them).
    """
    if n <= 0 or d <= 0:
        raise ValueError(f"embedding.table: expected positive n and d, got n={n}, d={d}")
    if not isinstance(tiles, int) or not 1 <= tiles <= n:
        raise ValueError(f"embedding.table: tiles must be an int in [1, {n}], got {tiles!r}")
    if tile_seeds:
        seeds = torch.randint(0, 2**62, (tiles,), generator=gen, device=gen.device)
        rows = tiling.tile_sizes(n, tiles)
        return tiling.RowTiles(
            tuple(
                tiling.Deferred((rows[t], d), partial(_seeded_tile, seeds, t, rows[t], d, std))
                for t in range(tiles)
            )
        )
    # scaled in place: a 152k vocabulary's table is 1.2 GB, not held twice
    w = torch.randn(n, d, generator=gen, device=gen.device, dtype=torch.float32).mul_(std)
    return w if tiles == 1 else tiling.tile(w, tiles, axis=0)


def _seeded_tile(seeds: torch.Tensor, t: int, rows: int, d: int, std: float) -> torch.Tensor:
    """Tile ``t`` (rows, d) ~ N(0, std) in fp32, from a generator seeded with ``seeds[t]`` (read
    only here, so a table's shapes can be learnt on fake tensors)."""
    gen = torch.Generator(device=seeds.device).manual_seed(int(seeds[t]))
    return torch.randn(rows, d, generator=gen, device=seeds.device).mul_(std)


def apply(params: dict, idx: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """Rows of ``w`` at integer indices: ``(...,) -> (..., d)`` in ``w``'s dtype; equals
    ``nn.Embedding`` (a tiled ``w``: only the tiles holding some index are read)."""
    return tiling.embedding(idx, params["w"], padding_idx)
