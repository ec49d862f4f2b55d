"""``Batches.every_row``: a held-out pass over every example. Its batches hold each row of epoch 0
once, in order, as ``batch`` builds them, the last filled up with rows of padding that have no
targets; their target tokens are every example's (``batch`` alone drops the last partial batch)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import zinf_data as zd
from zinf_data.tiny import chat_examples, corpus_of, tiny_tokenizer


@pytest.mark.parametrize("pack", [False, True])
def test_every_row_scores_every_example_once(tmp_path, pack):
    tiny_tokenizer(str(tmp_path / "tok"), corpus_of(chat_examples(200)) * 3)
    tok = zd.load_tokenizer(str(tmp_path / "tok"), vocab_size=512)
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in chat_examples(23, seed=4)))
    data = zd.tokenized(
        [str(path)], "chat", tok, str(tmp_path / "tok"), str(tmp_path / "cache"), progress=False
    )
    spans = zd.spans(data, 48)
    batches = zd.Batches(data, spans, 48, 4, pack, tok.pad_token_id, shuffle=False)
    every = list(batches.every_row())
    rows = len(batches.rows(0))
    assert len(every) == -(-rows // 4) and rows % 4  # a partial last batch, which batch() drops
    for i in range(batches.per_epoch(0)):  # the full batches are batch(i)'s
        assert all(torch.equal(every[i][k], batches.batch(i)[k]) for k in every[i])
    padding = 4 * len(every) - rows
    assert (every[-1]["targets"][4 - padding :] == zd.IGNORE).all()
    # every example's target tokens: its mask after the first token, as _row builds them
    want = sum(int(np.count_nonzero(data.mask[s + 1 : e])) for s, e in spans)
    assert sum(int((b["targets"] != zd.IGNORE).sum()) for b in every) == want
