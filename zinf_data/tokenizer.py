"""The model's own tokenizer, and records turned into token ids with a mask of the tokens to train
on.

``load_tokenizer(hf_dir)`` is transformers' fast tokenizer of ``tokenizer.json`` /
``tokenizer_config.json`` (BOS/EOS as its config adds them). ``encode(records, fmt, tokenizer)``
returns per record ``(ids, mask)``, ``mask[j] = 1`` where token j is a training target:

    text             every token; EOS appended (the model learns where a document ends)
    prompt-response  the response and an appended EOS (the prompt, with its BOS, is masked)
    chat             the tokens inside the chat template's ``{% generation %}`` markers (the
                     assistant's content and end-of-turn, as
                     ``apply_chat_template(return_assistant_tokens_mask=True)`` marks them); system
                     and user turns and the template's markup are masked

``train_on_prompt=True`` trains on every token instead. Records are encoded in batches: the fast
tokenizer runs a batch on its own threads.
"""

from __future__ import annotations

import hashlib
import os

from .formats import DataError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


def load_tokenizer(hf_dir: str, vocab_size: int | None = None):
    """The fast tokenizer of ``hf_dir`` (local files only); ``vocab_size``: the model's, which must
    hold every id the tokenizer can produce."""
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        raise DataError(
            f"{hf_dir}: no tokenizer.json; expected the model's fast tokenizer files "
            f"{TOKENIZER_FILES[:2]}"
        )
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"{hf_dir}: expected a fast tokenizer (tokenizer.json), got {type(tok).__name__}"
        )
    if vocab_size is not None and len(tok) > vocab_size:
        raise DataError(
            f"{hf_dir}: the tokenizer has {len(tok)} ids but the model's vocab_size is "
            f"{vocab_size}; "
            "expected a tokenizer whose ids all fit the model's embedding (wrong "
            "tokenizer directory?)"
        )
    return tok


def tokenizer_hash(hf_dir: str) -> str:
    """sha256 over the tokenizer files present in ``hf_dir`` (what the token cache is keyed by)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def encode(
    records: list[dict], wheres: list, fmt: str, tok, train_on_prompt: bool = False
) -> list[tuple]:
    """``(ids, mask)`` lists for each record (see the module docstring); ``wheres`` name them in
    errors."""
    if fmt == "chat":
        out = _chat(records, wheres, tok)
    elif fmt == "prompt-response":
        prompts = _ids(tok, [r["prompt"] for r in records], True)
        responses = _ids(tok, [r["response"] for r in records], False)
        eos = _eos(tok)
        out = [
            (p + r + eos, [0] * len(p) + [1] * (len(r) + len(eos)))
            for p, r in zip(prompts, responses, strict=True)
        ]
    else:
        eos = _eos(tok)
        texts = [
            ids if ids[-1:] == eos else ids + eos
            for ids in _ids(tok, [r["text"] for r in records], True)
        ]
        out = [(ids, [1] * len(ids)) for ids in texts]
    if train_on_prompt:
        out = [(ids, [1] * len(ids)) for ids, _ in out]
    return out


def _ids(tok, texts: list[str], special: bool) -> list[list[int]]:
    """``tok(texts, add_special_tokens=special)["input_ids"]``, through the Rust tokenizer's batch
    call on its threads without the offsets and attention masks transformers would build (the same
    ids)."""
    backend = tok.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=special)]


def _eos(tok) -> list[int]:
    """``[eos]``, or ``[]`` for a tokenizer without one."""
    return [] if tok.eos_token_id is None else [tok.eos_token_id]


def _chat(records: list[dict], wheres: list, tok) -> list[tuple]:
    if not tok.chat_template:
        raise DataError(
            f"{wheres[0]}: chat data needs the tokenizer's chat template; tokenizer_config.json "
            "(or "
            "chat_template.jinja) has none: add one, or use --format prompt-response"
        )
    out = tok.apply_chat_template(
        [r["messages"] for r in records],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    pairs = list(zip(out["input_ids"], out["assistant_masks"], strict=True))
    for where, (_, mask) in zip(wheres, pairs, strict=True):
        if not any(mask):
            raise DataError(
                f"{where}: the chat template marked no assistant token; expected a template with "
                "{% generation %} ... {% endgeneration %} around the assistant's "
                "content"
            )
    return [(list(ids), list(mask)) for ids, mask in pairs]
