"""Training batches from tokenized examples: packed or padded, in a seeded order that any batch
index reproduces (so a resumed run sees exactly the batches it would have seen).

An example of n tokens gives n - 1 (input, target) pairs: ``inputs = ids[:-1]``, ``targets =
ids[1:]``, a target set to -100 where its token's mask is 0 (prompt, system turn, template markup)
and on padding. Each row is ``seq_len`` pairs (or fewer, below):

    pack=False  one example per row, padded at the end (causal attention never sees the padding)
    pack=True   several examples per row, with ``segments`` (B, T) naming each position's example
                (the padding a segment of its own): ``layers.llama`` and ``layers.gpt`` attend
                within a segment only, positions restarting at each, so a packed example computes
                what it would alone

A batch is (B, T): T is seq_len, or with ``pad_to_multiple_of=m`` its longest row rounded up to
a multiple of m (at most seq_len; transformers' ``DataCollatorWithPadding`` has the same option),
so a batch of short examples costs what they do while the shapes stay few (seq_len / m at most;
the engine takes batches of several lengths). Examples longer than seq_len + 1 tokens are refused
(``DataError`` naming the file and line) unless ``too_long="truncate"`` (keep the first seq_len +
1) or ``"split"`` (windows overlapping by one token: plain text documents).
"""

from __future__ import annotations

import numpy as np
import torch

from .cache import Tokenized
from .formats import DataError

IGNORE = -100
TOO_LONG = ("refuse", "truncate", "split")


def spans(data: Tokenized, seq_len: int, too_long: str = "refuse") -> np.ndarray:
    """(N', 2) int64 ``[start, end)`` token spans of the examples to train on, at most seq_len + 1
    each."""
    if too_long not in TOO_LONG:
        raise ValueError(f"too_long must be one of {TOO_LONG}, got {too_long!r}")
    starts, ends = data.starts[:-1], data.starts[1:]
    lengths, limit = ends - starts, seq_len + 1
    long = np.nonzero(lengths > limit)[0]
    if len(long) and too_long == "refuse":
        i = int(long[0])
        raise DataError(
            f"{data.where(i)}: an example of {lengths[i]} tokens, longer than the model's seq_len "
            "+ 1 = "
            f"{limit} ({len(long)} such examples); pass --truncate (keep the first "
            f"{limit} tokens) or "
            "a larger --seq-len"
        )
    if too_long == "truncate":
        out = np.stack([starts, np.minimum(ends, starts + limit)], axis=1)
    elif too_long == "split":
        out = np.asarray(
            [
                (s, min(s + limit, e))
                for s0, e in zip(starts, ends, strict=True)
                for s in range(int(s0), int(e) - 1, seq_len)
            ],
            dtype=np.int64,
        ).reshape(-1, 2)
    else:
        out = np.stack([starts, ends], axis=1)
    return out[out[:, 1] - out[:, 0] >= 2]  # an example of one token has no target


def held_out(spans_: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) spans: a seeded ``fraction`` of the examples (at least one) held out."""
    if not 0 < fraction < 1:
        raise ValueError(f"held-out fraction must be in (0, 1), got {fraction}")
    order = np.random.default_rng([seed, 7]).permutation(len(spans_))
    n_val = max(1, int(round(fraction * len(spans_))))
    return spans_[np.sort(order[n_val:])], spans_[np.sort(order[:n_val])]


class Batches:
    """Batch ``i`` of a run over ``spans`` of ``data``: a function of (seed, i) only.

    Epoch e visits the examples in the permutation ``default_rng([seed, e])`` (``shuffle=False``: in
    order), fills rows from it and cuts them into batches of ``batch_size`` rows; a last partial
    batch of an epoch is dropped, so batch i is the same whichever batch a run started from.
    ``what`` names the data in errors (e.g. "held-out data").
    """

    def __init__(
        self,
        data: Tokenized,
        spans_: np.ndarray,
        seq_len: int,
        batch_size: int,
        pack: bool,
        pad_id: int,
        seed: int = 0,
        shuffle: bool = True,
        what: str = "the data",
        pad_to_multiple_of: int = 0,
    ):
        """``pad_to_multiple_of``: 0 pads every row to ``seq_len``; m > 0 pads a batch's rows to its
        longest row rounded up to a multiple of m (at most ``seq_len``)."""
        if pad_to_multiple_of < 0:
            raise ValueError(f"pad_to_multiple_of must be >= 0, got {pad_to_multiple_of}")
        self.data, self.spans, self.seq_len, self.batch_size = data, spans_, seq_len, batch_size
        self.pack, self.pad_id, self.seed, self.shuffle = pack, pad_id, seed, shuffle
        self.multiple = pad_to_multiple_of
        self._epochs: list[list[list[int]]] = []
        if len(self.rows(0)) < batch_size:
            raise DataError(
                f"{what}: {len(spans_)} examples make {len(self.rows(0))} rows of {seq_len} "
                "tokens, fewer "
                f"than one batch of {batch_size}; use a smaller --batch-size or more "
                "data"
            )

    def rows(self, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s rows, each a list of span indices (one unless packing)."""
        while len(self._epochs) <= epoch:
            e = len(self._epochs)
            order = (
                np.random.default_rng([self.seed, e]).permutation(len(self.spans))
                if self.shuffle
                else np.arange(len(self.spans))
            )
            self._epochs.append(self._fill(order))
        return self._epochs[epoch]

    def _fill(self, order: np.ndarray) -> list[list[int]]:
        if not self.pack:
            return [[int(i)] for i in order]
        rows, row, used = [], [], 0
        for i in order:
            n = int(self.spans[i, 1] - self.spans[i, 0]) - 1  # its (input, target) pairs
            if row and used + n > self.seq_len:
                rows.append(row)
                row, used = [], 0
            row.append(int(i))
            used += n
        return rows + ([row] if row else [])

    def per_epoch(self, epoch: int) -> int:
        return len(self.rows(epoch)) // self.batch_size

    def batch(self, i: int) -> dict:
        """Batch ``i``: ``{"inputs", "targets"}`` (B, T) int64 (``length``), plus ``"segments"``
        when packing."""
        epoch = 0
        while i >= self.per_epoch(epoch):
            i -= self.per_epoch(epoch)
            epoch += 1
        return self._stacked(self.rows(epoch)[i * self.batch_size : (i + 1) * self.batch_size])

    def every_row(self):
        """Every row of epoch 0 in batches of ``batch_size`` rows, the last one filled up with rows
        of padding (no targets): a held-out loss over these scores every example."""
        rows = self.rows(0)
        for i in range(0, len(rows), self.batch_size):
            chunk = rows[i : i + self.batch_size]
            yield self._stacked(chunk + [[]] * (self.batch_size - len(chunk)))

    def length(self, rows: list[list[int]]) -> int:
        """T of a batch of ``rows``: ``seq_len``, or its longest row's (input, target) pairs
        rounded up to a multiple of ``pad_to_multiple_of``, at most ``seq_len``."""
        if not self.multiple:
            return self.seq_len
        pairs = self.spans[:, 1] - self.spans[:, 0] - 1
        longest = max((int(pairs[row].sum()) for row in rows if row), default=1)
        return min(-(-longest // self.multiple) * self.multiple, self.seq_len)

    def _stacked(self, rows: list[list[int]]) -> dict:
        t = self.length(rows)
        built = [self._row(r) for r in rows]
        names = ("inputs", "targets", "segments") if self.pack else ("inputs", "targets")
        # (B, seq_len) -> (B, T): past T every row is padding
        return {
            k: torch.from_numpy(np.stack([b[j][:t] for b in built])) for j, k in enumerate(names)
        }

    def _row(self, row: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t = self.seq_len
        inputs, targets = np.full(t, self.pad_id, np.int64), np.full(t, IGNORE, np.int64)
        segments, at = np.full(t, len(row), np.int64), 0  # the padding: a segment of its own
        for k, i in enumerate(row):
            s, e = self.spans[i]
            ids, mask = self.data.tokens[s:e].astype(np.int64), self.data.mask[s:e]
            n = len(ids) - 1
            inputs[at : at + n] = ids[:-1]
            targets[at : at + n] = np.where(mask[1:] != 0, ids[1:], IGNORE)
            segments[at : at + n] = k
            at += n
        return inputs, targets, segments

    def from_(self, start: int):
        """Batches ``start``, ``start + 1``, ... without end (epochs follow one another)."""
        i = start
        while True:
            yield self.batch(i)
            i += 1
