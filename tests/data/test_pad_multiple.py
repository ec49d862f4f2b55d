"""``Batches(pad_to_multiple_of=m)``: a batch's rows padded to its longest row rounded up to a
multiple of m (at most seq_len) hold the same tokens, targets and segments as the rows padded to
seq_len, cut where only padding follows; the lengths stay few."""

from __future__ import annotations

import json

import pytest
import torch

import zinf_data as zd
from zinf_data.tiny import chat_examples, corpus_of, tiny_tokenizer

SEQ_LEN, MULTIPLE = 48, 8


def batches_of(tmp_path, pack: bool, multiple: int) -> zd.Batches:
    """Chat examples of a tiny tokenizer, in batches of 4 rows of at most ``SEQ_LEN`` pairs."""
    tiny_tokenizer(str(tmp_path / "tok"), corpus_of(chat_examples(200)) * 3)
    tok = zd.load_tokenizer(str(tmp_path / "tok"), vocab_size=512)
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in chat_examples(40, seed=4)))
    data = zd.tokenized(
        [str(path)], "chat", tok, str(tmp_path / "tok"), str(tmp_path / "cache"), progress=False
    )
    spans = zd.spans(data, SEQ_LEN, "truncate")
    return zd.Batches(data, spans, SEQ_LEN, 4, pack, tok.pad_token_id, pad_to_multiple_of=multiple)


@pytest.mark.parametrize("pack", [False, True])
def test_rows_cut_to_a_multiple_of_the_longest(tmp_path, pack):
    full = batches_of(tmp_path, pack, 0)
    cut = batches_of(tmp_path, pack, MULTIPLE)
    lengths = set()
    for i in range(full.per_epoch(0)):
        a, b = full.batch(i), cut.batch(i)
        t = b["inputs"].shape[1]
        lengths.add(t)
        assert t % MULTIPLE == 0 or t == SEQ_LEN
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k][:, :t], b[k])
        # past t only padding; within the last multiple, some row still has a token
        assert (a["targets"][:, t:] == zd.IGNORE).all()
        assert (a["inputs"][:, t:] == full.pad_id).all()
        assert (a["inputs"][:, t - MULTIPLE : t] != full.pad_id).any()
    assert 1 < len(lengths) <= SEQ_LEN // MULTIPLE
    if not pack:  # one example per row: the row's pairs decide T
        assert min(lengths) < SEQ_LEN


def test_every_row_is_cut_too(tmp_path):
    full = batches_of(tmp_path, False, 0)
    cut = batches_of(tmp_path, False, MULTIPLE)
    for a, b in zip(full.every_row(), cut.every_row(), strict=True):
        t = b["inputs"].shape[1]
        assert all(torch.equal(a[k][:, :t], b[k]) for k in a)
        assert (a["targets"][:, t:] == zd.IGNORE).all()


def test_a_negative_multiple_is_refused(tmp_path):
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        batches_of(tmp_path, False, -1)
