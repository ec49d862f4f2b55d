"""A small schema language for JSON read from untrusted files: each check names the field path it
failed.

    SCHEMA = Obj({"step": Int(0), "name": Str(pattern=r"[a-z/]+"), "shape": List(Int(0),
    max_len=2)}) check(SCHEMA, value, "manifest.json")   # SchemaError: manifest.json:
    arrays[3].shape[1]: ...

A schema is a value (``Int``, ``Float``, ``Str``, ``Bool``, ``Null``, ``Const``, ``List``, ``Obj``,
``Map``, ``AnyOf``, ``Validated``, ``Json``) whose ``check(value, field)`` raises
``SchemaError(field, expected, got)``. Every ``Obj`` is closed: a key it does not list is refused,
since a field this code does not know means the file was edited or written by another program. Every
``Int`` is an int64 at most (tighter where given), a ``List(unique=...)`` (one naming groups, leaves
or arrays) names none twice, JSON booleans are never ints, and ``Float`` takes ints but refuses NaN
and infinities. The schema is plain data: a test walks it to derive its wrong values
(tests/checkpoints/test_checkpoints_schema.py). ``load_json`` reads a bounded file without following
a symlink and refuses non-finite numbers, repeated keys, absurd nesting and over-long integers as
malformed JSON.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

REPR_CHARS = 80  # a refused value is shown up to this many characters


class _Missing:
    def __repr__(self) -> str:
        return "nothing (the field is missing)"


MISSING = _Missing()  # what came, for a field that is absent


class SchemaError(ValueError):
    """``field``: the path of the value that failed (``arrays[3].chunk_cols``)."""

    def __init__(self, field: str, expected: str, got: Any):
        self.field, self.expected, self.got = field, expected, got
        super().__init__(f"{field}: expected {expected}, got {short_repr(got)}")


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= REPR_CHARS else f"{text[: REPR_CHARS - 3]}..."


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Int:
    """An int in [lo, hi], an int64 whatever the bounds given."""

    def __init__(self, lo: int = INT64_MIN, hi: int = INT64_MAX):
        self.lo, self.hi = max(lo, INT64_MIN), min(hi, INT64_MAX)

    def check(self, value, field: str) -> None:
        if not is_int(value) or not self.lo <= value <= self.hi:
            raise SchemaError(field, self.describe(), value)

    def describe(self) -> str:
        if self.hi == INT64_MAX and self.lo in (0, 1):
            return f"{'a positive int' if self.lo else 'an int >= 0'} (an int64)"
        return f"an int in [{self.lo}, {self.hi}]"


class Float:
    """A finite JSON number (ints too) in [lo, hi]."""

    def __init__(self, lo: float | None = None, hi: float | None = None):
        self.lo, self.hi = lo, hi

    def check(self, value, field: str) -> None:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if (
            not ok
            or (self.lo is not None and value < self.lo)
            or (self.hi is not None and value > self.hi)
        ):
            bounds = (
                f" in [{self.lo}, {self.hi}]" if self.lo is not None or self.hi is not None else ""
            )
            raise SchemaError(field, f"a finite number{bounds}", value)


class Str:
    """A string of at most ``max_len`` characters, fully matching ``pattern`` (described to the user
    as ``what``) or one of ``choices``."""

    def __init__(
        self, pattern: str | None = None, choices=None, max_len: int = 4096, what: str | None = None
    ):
        self.pattern = re.compile(pattern) if pattern else None
        self.what = what or (f"a string matching {pattern!r}" if pattern else None)
        self.choices, self.max_len = (tuple(choices) if choices is not None else None), max_len

    def check(self, value, field: str) -> None:
        if not isinstance(value, str) or len(value) > self.max_len:
            raise SchemaError(field, f"a string of at most {self.max_len} characters", value)
        if self.choices is not None and value not in self.choices:
            raise SchemaError(field, f"one of {list(self.choices)}", value)
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise SchemaError(field, self.what, value)


class Bool:
    def check(self, value, field: str) -> None:
        if not isinstance(value, bool):
            raise SchemaError(field, "true or false", value)


class Null:
    def check(self, value, field: str) -> None:
        if value is not None:
            raise SchemaError(field, "null", value)


class Const:
    """Exactly ``value`` (of its JSON type: ``1`` is not ``1.0`` or ``true``): the one value this
    version writes and reads for a field of a stored format."""

    def __init__(self, value):
        self.value = value

    def check(self, value, field: str) -> None:
        if json.dumps(value, sort_keys=True) != json.dumps(self.value, sort_keys=True):
            raise SchemaError(field, f"{self.value!r} (the one value this version reads)", value)


class List:
    """A list of ``min_len`` to ``max_len`` items of ``item``; ``unique``: no item twice (a list
    that names groups), or, as a key's name, no two items with the same value there (a list of
    objects that each name a leaf or an array)."""

    def __init__(self, item, min_len: int = 0, max_len: int = 1 << 20, unique: bool | str = False):
        self.item = item
        self.min_len = min_len
        self.max_len = max_len
        self.unique = unique

    def check(self, value, field: str) -> None:
        if not isinstance(value, list) or not self.min_len <= len(value) <= self.max_len:
            raise SchemaError(field, f"a list of {self.min_len} to {self.max_len} items", value)
        for i, item in enumerate(value):
            self.item.check(item, f"{field}[{i}]")
        if self.unique:
            self._check_unique(value, field)

    def _check_unique(self, value: list, field: str) -> None:
        by = self.unique if isinstance(self.unique, str) else None
        seen = set()
        for i, item in enumerate(value):
            key = json.dumps(item if by is None else item[by], sort_keys=True)
            if key in seen:
                named = "each is named once" if by is None else f"each {by} is named once"
                raise SchemaError(
                    join(f"{field}[{i}]", by) if by else f"{field}[{i}]",
                    f"an item not listed before ({named})",
                    item,
                )
            seen.add(key)


class Obj:
    """A JSON object with exactly the keys of ``required`` and any of ``optional``."""

    def __init__(self, required: dict, optional: dict | None = None):
        self.required, self.optional = required, optional or {}

    def check(self, value, field: str) -> None:
        if not isinstance(value, dict):
            raise SchemaError(field, f"an object with keys {sorted(self.required)}", value)
        for name, schema in self.required.items():
            if name not in value:
                raise SchemaError(join(field, name), "a value (the field is required)", MISSING)
            schema.check(value[name], join(field, name))
        for name in value:
            if name in self.optional:
                self.optional[name].check(value[name], join(field, name))
            elif name not in self.required:
                raise SchemaError(
                    join(field, name),
                    f"no such field (known: {sorted(self.required)})",
                    value[name],
                )


class Map:
    """A JSON object whose keys match ``key`` and whose values all match ``value``."""

    def __init__(self, key: Str, value, max_len: int = 1 << 16):
        self.key, self.value, self.max_len = key, value, max_len

    def check(self, value, field: str) -> None:
        if not isinstance(value, dict) or len(value) > self.max_len:
            raise SchemaError(field, f"an object of at most {self.max_len} entries", value)
        for name, item in value.items():
            self.key.check(name, f"{field} key {name!r}")
            self.value.check(item, join(field, name))


class AnyOf:
    def __init__(self, *options):
        self.options = options

    def check(self, value, field: str) -> None:
        errors = []
        for option in self.options:
            try:
                option.check(value, field)
                return
            except SchemaError as e:
                errors.append(e.expected)
        raise SchemaError(field, " or ".join(errors), value)


class Validated:
    """``inner``, then ``validate(value, field)``: a rule written once elsewhere (the engine's own
    checks of what it takes, say), which raises ``SchemaError`` naming the field it refuses."""

    def __init__(self, inner, validate):
        self.inner = inner
        self.validate = validate

    def check(self, value, field: str) -> None:
        self.inner.check(value, field)
        self.validate(value, field)


class Json:
    """Any JSON value (already bounded by ``load_json``)."""

    def check(self, value, field: str) -> None:
        return None


def join(field: str, name: str) -> str:
    return f"{field}.{name}" if field else name


def check(schema, value, where: str = "") -> None:
    """Raise ``SchemaError`` naming the first field of ``value`` that ``schema`` refuses."""
    schema.check(value, where)


def _refuse_constant(name: str):
    raise ValueError(f"the non-finite number {name} is not JSON")


def _refuse_duplicates(pairs: list) -> dict:
    """A JSON object whose keys are each given once (a repeated key would silently win)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {short_repr(key)} is given twice in one object")
        out[key] = value
    return out


def load_json(path: str, max_bytes: int):
    """The JSON value in the file ``path``: read with ``O_NOFOLLOW`` (a symlink is refused), at most
    ``max_bytes`` long. Raises OSError for a file that cannot be opened, ValueError for one that is
    too long, not UTF-8, or not JSON (including NaN, Infinity, integers of over 4300 digits, a key
    given twice in one object and nesting deep enough to exhaust the parser)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise ValueError(f"the file is over {max_bytes} bytes long")
    try:
        return json.loads(
            raw.decode("utf-8"),
            parse_constant=_refuse_constant,
            object_pairs_hook=_refuse_duplicates,
        )
    except RecursionError:
        raise ValueError("nested too deeply to be parsed") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 ({e})") from None
