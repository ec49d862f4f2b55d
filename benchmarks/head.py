"""A frozen vocabulary head's step alone: ``tiling.linear_cross_entropy`` over Qwen3-30B-A3B's head.

The head is 151,936 x 2048, stored bf16 in 32 row tiles, frozen (a LoRA run's): its forward makes
the logits, the online log-sum-exp and the pull-back to h (``tiling.cross_entropy``), its backward
fetches no tile. 32 rows of h (fp32), forward then backward. Each round times, in turn:

- ``before``: the op as it ran before, each tile cast to an fp32 tile (a reused buffer, as the
  fetcher's pool buffer), its logits ``h @ W_t^T`` and its pull-back ``e @ W_t`` over the whole
  tile (``_before``, a copy of that loop);
- ``cast_whole``: the same fp32 tiles, the op's products over the whole tile (``CHUNK_BYTES`` past
  a tile);
- ``cast_chunked``: the same fp32 tiles, both products a cache-sized chunk at a time;
- ``lent_chunked``: each bf16 tile lent as stored (``layout.policy.GroupPolicy.cast``), the op
  casting a chunk at a time into one reused buffer: no fp32 tile is made.

Then ``lent_chunked`` again at a few chunk sizes (``chunk_ms``). The rounds alternate the variants,
and the best round counts (a shared machine's load inflates a round, never shortens it). Last
line: JSON with each variant's milliseconds, the speedup (``before / lent_chunked``) and the ratio
of ``lent_chunked`` to the products' arithmetic alone (``matmul``: the op's two products over one
chunk of fp32 rows in cache, as many times as the vocabulary has chunks).

    python benchmarks/head.py --quick
    python benchmarks/head.py --threads 1   # one core's cost
"""

from __future__ import annotations

import argparse
import contextlib
import json
from functools import partial

import torch
from nf4_linear import time_best  # benchmarks/, a script's dir, is on sys.path

from zinf_fn import tiling
from zinf_fn.tiling import cross_entropy

VOCAB, D, TILES, ROWS = 151_936, 2048, 32, 32
CHUNKS_KB = (1024, 2048, 4096, 8192, 16384)


class _Source:
    """A frozen row-tiled head over bf16 tiles in memory, each fetched cast to fp32 into one reused
    buffer (``cast``) or lent as stored."""

    axis = 0

    def __init__(self, tiles: tuple[torch.Tensor, ...], cast: bool):
        self.tiles, self.n_tiles = tiles, len(tiles)
        self.anchor = torch.zeros(0)  # takes no gradient: a frozen head
        self.buf = torch.empty(tiles[0].shape) if cast else None

    def tile_shape(self, t: int) -> tuple[int, ...]:
        return tuple(self.tiles[t].shape)

    def fetch(self, t: int) -> torch.Tensor:
        if self.buf is None:
            return self.tiles[t]
        out = self.buf[: self.tiles[t].shape[0]]
        return out.copy_(self.tiles[t])

    def release(self, t: int) -> None:
        pass

    def grad_out(self, t: int, dtype: torch.dtype) -> None:
        return None

    def emit_grad(self, t: int, grad: torch.Tensor) -> None:
        raise AssertionError("a frozen head emits no tile gradient")

    def will_use(self, tiles: tuple[int, ...], others: tuple = ()) -> tuple[int, ...]:
        return tiles


@contextlib.contextmanager
def chunk_bytes(n: int):
    """``cross_entropy.CHUNK_BYTES`` set to ``n`` within."""
    kept = cross_entropy.CHUNK_BYTES
    cross_entropy.CHUNK_BYTES = n
    try:
        yield
    finally:
        cross_entropy.CHUNK_BYTES = kept


def _step(src: _Source, h: torch.Tensor, targets: torch.Tensor, chunk: int) -> int:
    """One forward and backward of the head over ``src``: one pass (``time_best`` counts it)."""
    with chunk_bytes(chunk):
        ht = h.clone().requires_grad_(True)
        tiling.linear_cross_entropy(ht, src, targets).backward()
    return 1


def _matmul(rows: torch.Tensor, h: torch.Tensor) -> int:
    """The op's two products (the logits, the pull-back) over the whole vocabulary's count of rows,
    over the same fp32 ``rows`` (in cache) each time: the arithmetic alone."""
    h_t, a = h.T.contiguous(), torch.zeros(h.shape)
    e = torch.rand(h.shape[0], rows.shape[0])
    for _ in range(VOCAB // rows.shape[0]):
        rows @ h_t
        a.addmm_(e, rows)
    return 1


def _before(src: _Source, h: torch.Tensor) -> int:
    """The frozen head's forward as it ran before (the loss's log-sum-exp and the pull-back A over
    whole fp32 tiles, ``h @ W_t^T``, then A / s); its backward multiplies a made dh, nothing to
    time. One pass (``time_best`` counts it)."""
    m = torch.full((h.shape[0],), float("-inf"))
    s, a = torch.zeros(h.shape[0]), torch.zeros(h.shape)
    for t in range(src.n_tiles):
        w = src.fetch(t)
        z = h @ w.T
        m_new = torch.maximum(m, z.max(dim=1).values)
        scale = torch.exp(m - m_new)
        e = torch.exp(z - m_new[:, None])
        s = s * scale + e.sum(dim=1)
        m = m_new
        a.mul_(scale[:, None]).addmm_(e, w)
    a.div_(s[:, None])
    return 1


def _variants(tiles, h, targets) -> dict:
    """Each variant a function of no arguments (module docstring)."""
    whole = 1 << 40
    cast, lent = _Source(tiles, cast=True), _Source(tiles, cast=False)
    chunk = cross_entropy.CHUNK_BYTES
    out = {
        "before": partial(_before, cast, h),
        "cast_whole": partial(_step, cast, h, targets, whole),
        "cast_chunked": partial(_step, cast, h, targets, chunk),
        "lent_chunked": partial(_step, lent, h, targets, chunk),
        "matmul": partial(_matmul, tiles[0][: chunk // (D * 4)].float(), h),
    }
    for kb in CHUNKS_KB:
        out[f"lent_{kb}k"] = partial(_step, lent, h, targets, kb << 10)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(VOCAB, D, generator=gen).mul_(0.02).to(torch.bfloat16)
    tiles = tuple(t.clone() for t in torch.tensor_split(w, TILES))
    del w
    h = torch.randn(ROWS, D, generator=gen)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    ms = time_best(_variants(tiles, h, targets), 2 if args.quick else args.rounds)
    out: dict = {"threads": torch.get_num_threads(), "chunk_bytes": cross_entropy.CHUNK_BYTES}
    out["ms"] = {k: v for k, v in ms.items() if not k.startswith("lent_") or k == "lent_chunked"}
    out["chunk_ms"] = {k: v for k, v in ms.items() if k.startswith("lent_") and k[5].isdigit()}
    out["speedup"] = round(ms["before"] / ms["lent_chunked"], 2)
    out["over_matmul"] = round(ms["lent_chunked"] / ms["matmul"], 2)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
