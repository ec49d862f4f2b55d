"""Reading fine-tuning data: records ``(where, record)`` from plain text, JSONL, Parquet or Arrow
files.

Formats (``FORMATS``) and the record each gives:

    "text"             a plain text file (one document per file), or JSONL / Parquet rows with a
    text field "prompt-response"  JSONL / Parquet rows with a prompt and a response field
    "chat"             JSONL / Parquet rows with ``messages``: [{"role": ..., "content": ...}, ...]

``where`` names the file and line (JSONL) or row (Parquet/Arrow), so every later error can point at
it. Every bad record raises ``DataError`` naming where it is, what was expected and what came.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

FORMATS = ("text", "prompt-response", "chat")
ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A data file or record is not what its format expects (the message names the file and
    line)."""


class Where(NamedTuple):
    """Where a record came from: its file and line (JSONL, from 1) or row (Parquet/Arrow, from 0); a
    whole plain text file is line 0."""

    path: str
    line: int
    table: bool = False

    def __str__(self) -> str:
        return f"{self.path}: row {self.line}" if self.table else f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Fields:
    """The field names of a JSONL / Parquet record, per format."""

    text: str = "text"
    prompt: str = "prompt"
    response: str = "response"
    messages: str = "messages"


DEFAULT_FIELDS = Fields()


def read_records(
    path: str, fmt: str, fields: Fields = DEFAULT_FIELDS
) -> Iterator[tuple[Where, dict]]:
    """``(where, record)`` for every record of ``path`` (a ``.jsonl``/``.json`` file, ``.parquet``,
    ``.arrow``, or any other file as plain text), checked against ``fmt``; records are
    ``{"text"}``, ``{"prompt", "response"}`` or ``{"messages"}``."""
    if fmt not in FORMATS:
        raise DataError(f"format must be one of {FORMATS}, got {fmt!r}")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such data file")
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".json"):
        rows = _jsonl_rows(path)
    elif ext in (".parquet", ".arrow"):
        rows = _table_rows(path, ext)
    else:
        if fmt != "text":
            raise DataError(
                f"{path}: a plain text file holds format 'text', not {fmt!r}; give a .jsonl or "
                ".parquet "
                "file for prompt-response or chat data"
            )
        with open(path, encoding="utf-8") as f:
            yield Where(path, 0), {"text": f.read()}
        return
    for where, row in rows:
        yield where, check_record(where, row, fmt, fields)


def _jsonl_rows(path: str) -> Iterator[tuple[Where, dict]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = Where(path, n)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{where}: not a JSON object ({e.msg} at column {e.colno}): {line[:80]!r}"
                ) from None
            yield where, row


def _table_rows(path: str, ext: str) -> Iterator[tuple[Where, dict]]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path}: reading {ext} files needs the `datasets` package: pip install "
            "'zinf-fn[finetune]'"
        ) from None
    table = (
        datasets.Dataset.from_parquet(path)
        if ext == ".parquet"
        else datasets.Dataset.from_file(path)
    )
    for n, row in enumerate(table):
        yield Where(path, n, table=True), row


def check_record(where: Where, row, fmt: str, fields: Fields) -> dict:
    """The record of ``row`` for ``fmt``, or a ``DataError`` naming ``where`` and the field."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if fmt == "text":
        return {"text": _string(where, row, fields.text)}
    if fmt == "prompt-response":
        return {
            "prompt": _string(where, row, fields.prompt),
            "response": _string(where, row, fields.response),
        }
    return {"messages": _messages(where, row, fields.messages)}


def _string(where: Where, row: dict, name: str) -> str:
    if name not in row:
        raise DataError(f"{where}: missing field {name!r}; the record has {sorted(row)}")
    value = row[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _messages(where: Where, row: dict, name: str) -> list[dict]:
    if name not in row:
        raise DataError(f"{where}: missing field {name!r}; the record has {sorted(row)}")
    messages = row[name]
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: {name!r} must be a non-empty list of {{'role', 'content'}}, got "
            f"{messages!r:.80}"
        )
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"{where}: {name}[{i}] must be {{'role': one of {ROLES}, 'content': str}}, got "
                f"{m!r:.80}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f"{where}: a chat without an assistant turn has nothing to train on; roles are "
            f"{[m['role'] for m in messages]}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]
