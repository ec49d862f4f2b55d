"""zinf_data: the model's tokenizer, chat / prompt-response / text records, loss masks, the token
cache, packed and padded batches, and the errors on bad input. The tokenizer is trained here
(``zinf_data.tiny``), nothing is downloaded; token ids are compared with transformers' own calls
exactly."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import zinf_data as zd
from zinf_data import cache as cache_module
from zinf_data.tiny import chat_examples, corpus_of, tiny_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    tiny_tokenizer(d, corpus_of(chat_examples(200)) * 3)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return zd.load_tokenizer(tok_dir, vocab_size=512)


def _jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    return str(path)


def _tokenized(tmp_path, name: str, rows: list, fmt: str, tok, tok_dir):
    """``rows`` written to ``tmp_path / name`` as JSON lines, tokenized as ``fmt`` into the cache
    ``tmp_path / "c"``."""
    return zd.tokenized(
        [_jsonl(tmp_path / name, rows)], fmt, tok, tok_dir, str(tmp_path / "c"), progress=False
    )


def _examples(data: zd.Tokenized):
    return [
        (data.tokens[s:e].tolist(), data.mask[s:e].tolist())
        for s, e in zip(data.starts[:-1], data.starts[1:], strict=True)
    ]


def test_chat_equals_transformers_apply_chat_template(tmp_path, tok, tok_dir):
    rows = chat_examples(30, seed=1)
    data = _tokenized(tmp_path, "c.jsonl", rows, "chat", tok, tok_dir)
    for row, (ids, mask) in zip(rows, _examples(data), strict=True):
        want = tok.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids == want["input_ids"] and mask == want["assistant_masks"]
        trained = [
            t for t, m in zip(ids, mask, strict=True) if m
        ]  # the assistant's content and EOS, nothing else
        answer = next(m["content"] for m in row["messages"] if m["role"] == "assistant")
        assert trained == tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ids[0] == tok.bos_token_id and mask[0] == 0


def test_prompt_response_and_text_masks(tmp_path, tok, tok_dir):
    rows = [{"prompt": "What colour is the sky?", "response": "The sky is blue."}]
    data = _tokenized(tmp_path, "p.jsonl", rows, "prompt-response", tok, tok_dir)
    ((ids, mask),) = _examples(data)
    prompt = tok(rows[0]["prompt"])["input_ids"]  # BOS as the tokenizer's config adds it
    response = tok(rows[0]["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == prompt + response and mask == [0] * len(prompt) + [1] * len(response)
    text = tmp_path / "doc.txt"
    text.write_text("The plum is red.")
    data = zd.tokenized([str(text)], "text", tok, tok_dir, str(tmp_path / "c"), progress=False)
    ((ids, mask),) = _examples(data)
    assert ids == tok("The plum is red.")["input_ids"] + [tok.eos_token_id] and all(mask)
    on_prompt = zd.tokenized(
        [str(tmp_path / "p.jsonl")],
        "prompt-response",
        tok,
        tok_dir,
        str(tmp_path / "c"),
        train_on_prompt=True,
        progress=False,
    )
    assert (
        _examples(on_prompt)[0][1] == [1] * len(ids := _examples(on_prompt)[0][0]) and len(ids) > 0
    )


def test_batch_targets_token_by_token(tmp_path, tok, tok_dir):
    rows = chat_examples(12, seed=2)
    data = _tokenized(tmp_path, "c.jsonl", rows, "chat", tok, tok_dir)
    for pack in (False, True):
        batches = zd.Batches(data, zd.spans(data, 48), 48, 2, pack, tok.pad_token_id, shuffle=False)
        b = batches.batch(0)
        seg = b.get("segments", torch.zeros_like(b["inputs"]))
        ids, mask = _examples(data)[0]
        n = len(ids) - 1
        assert b["inputs"][0, :n].tolist() == ids[:-1]
        assert b["targets"][0, :n].tolist() == [
            t if m else -100 for t, m in zip(ids[1:], mask[1:], strict=True)
        ]
        if not pack:
            assert (b["targets"][0, n:] == -100).all() and (
                b["inputs"][0, n:] == tok.pad_token_id
            ).all()
        else:
            assert (seg[0, :n] == 0).all() and seg[
                0, n
            ] == 1  # the next example starts a new segment
            assert b["inputs"].shape == (2, 48)


def test_batches_are_a_function_of_their_index(tmp_path, tok, tok_dir):
    data = _tokenized(tmp_path, "c.jsonl", chat_examples(40), "chat", tok, tok_dir)
    one = zd.Batches(data, zd.spans(data, 64), 64, 4, True, tok.pad_token_id, seed=5)
    two = zd.Batches(data, zd.spans(data, 64), 64, 4, True, tok.pad_token_id, seed=5)
    later = [two.batch(i) for i in (7, 3, 12)]  # any order, another instance: the same batches
    for i, b in zip((7, 3, 12), later, strict=True):
        assert all(torch.equal(b[k], one.batch(i)[k]) for k in b)
    assert not torch.equal(
        one.batch(0)["inputs"], one.batch(one.per_epoch(0))["inputs"]
    )  # epochs reshuffle


def test_cache_reused_and_rebuilt(tmp_path, tok, tok_dir, monkeypatch):
    path = _jsonl(tmp_path / "c.jsonl", chat_examples(10))
    cache = str(tmp_path / "cache")
    first = zd.tokenized([path], "chat", tok, tok_dir, cache, progress=False)

    def refuse(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(cache_module, "encode", refuse)
    again = zd.tokenized([path], "chat", tok, tok_dir, cache, progress=False)
    assert again.path == first.path and np.array_equal(again.tokens, first.tokens)
    monkeypatch.undo()
    _jsonl(path, chat_examples(11))  # the data changed
    changed = zd.tokenized([path], "chat", tok, tok_dir, cache, progress=False)
    assert changed.path != first.path and len(changed) == 11
    other_tok = str(tmp_path / "tok2")  # the tokenizer changed (its chat template)
    tok.save_pretrained(other_tok)
    with open(os.path.join(other_tok, "chat_template.jinja"), "a") as f:
        f.write("\n")
    rebuilt = zd.tokenized(
        [path], "chat", zd.load_tokenizer(other_tok), other_tok, cache, progress=False
    )
    assert rebuilt.path not in (first.path, changed.path)
    assert sorted(os.listdir(cache)) == sorted(
        os.path.basename(p) for p in (first.path, changed.path, rebuilt.path)
    )


@pytest.mark.parametrize(
    "line, fmt, match",
    [
        (
            '{"messages": [{"role": "user", "content": "hi"}',
            "chat",
            r"bad\.jsonl:2: not a JSON object",
        ),
        ('{"prompt": "hi"}', "prompt-response", r"bad\.jsonl:2: missing field 'response'"),
        (
            '{"messages": [{"role": "user", "content": "hi"}]}',
            "chat",
            r"bad\.jsonl:2: a chat without an assistant",
        ),
        (
            '{"messages": [{"role": "robot", "content": "hi"}]}',
            "chat",
            r"bad\.jsonl:2: messages\[0\] must be",
        ),
        ('{"text": 3}', "text", r"bad\.jsonl:2: field 'text' must be a string"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, tok, tok_dir, line, fmt, match):
    good = {
        "chat": chat_examples(1)[0],
        "prompt-response": {"prompt": "a", "response": "b"},
        "text": {"text": "a"},
    }
    path = _jsonl(tmp_path / "bad.jsonl", [good[fmt], line])
    cache = str(tmp_path / "cache")
    with pytest.raises(zd.DataError, match=match):
        zd.tokenized([path], fmt, tok, tok_dir, cache, progress=False)
    assert os.listdir(cache) == []  # nothing half-written


def test_too_long_refused_or_truncated(tmp_path, tok, tok_dir):
    rows = chat_examples(4)
    rows[2]["messages"][-1]["content"] = "The sky is blue. " * 20
    data = _tokenized(tmp_path, "c.jsonl", rows, "chat", tok, tok_dir)
    with pytest.raises(
        zd.DataError, match=r"c\.jsonl:3: an example of \d+ tokens, longer than .* --truncate"
    ):
        zd.spans(data, 32)
    spans = zd.spans(data, 32, too_long="truncate")
    assert (spans[:, 1] - spans[:, 0]).max() == 33 and len(spans) == 4
    split = zd.spans(data, 32, too_long="split")
    assert len(split) > 4 and (split[:, 1] - split[:, 0]).max() <= 33


def test_tokenizer_must_fit_the_model(tok_dir, tmp_path):
    with pytest.raises(
        zd.DataError, match=r"tokenizer has \d+ ids but the model's vocab_size is 64"
    ):
        zd.load_tokenizer(tok_dir, vocab_size=64)
    with pytest.raises(zd.DataError, match="no tokenizer.json"):
        zd.load_tokenizer(str(tmp_path))


def test_parquet_and_arrow_rows(tmp_path, tok, tok_dir):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "p one", "response": "r one"}, {"prompt": "p two", "response": "r two"}]
    path = str(tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).to_parquet(path)
    data = zd.tokenized(
        [path], "prompt-response", tok, tok_dir, str(tmp_path / "c"), progress=False
    )
    jsonl = _tokenized(tmp_path, "d.jsonl", rows, "prompt-response", tok, tok_dir)
    assert _examples(data) == _examples(jsonl) and str(data.where(1)) == f"{path}: row 1"
    datasets.Dataset.from_list(rows).save_to_disk(
        str(tmp_path / "saved")
    )  # an Arrow file, as datasets writes it
    arrow = next(str(p) for p in (tmp_path / "saved").iterdir() if p.suffix == ".arrow")
    assert _examples(
        zd.tokenized([arrow], "prompt-response", tok, tok_dir, str(tmp_path / "c"), progress=False)
    ) == _examples(jsonl)
