"""What opening a token cache entry checks: its files are on a disk, so they are untrusted input.

An entry's ``meta.json`` records, besides the key's inputs, each data file's length in bytes and
its crc32c (``RECORDED``), the token dtype and the vocabulary size. ``cache.open_entry`` holds the
entry to it:

    meta.json    a JSON object with exactly the fields a build writes, each of its type and range,
                 and the key's inputs (format, data files, train_on_prompt, vocabulary, dtype)
    every file   a regular file of the recorded length (``n_tokens`` ids, ``n_tokens`` mask bytes)
    index.npy    int64 (n_examples, 3): starts from 0, strictly increasing, below ``n_tokens``
                 (every example at least one token), file indices within the data files, lines >= 0
    verify=True  (the default) every file's crc32c as recorded, every id below the vocabulary and
                 every mask byte 0 or 1: a flipped byte, a swapped start or a mask set to ones are
                 caught only here

A failed check raises ``CacheDamage`` (a ``DataError``) naming the file and what is wrong, which
``cache.tokenized`` answers by rebuilding the entry from the data. The checksum reads each file
once, in ``SCAN_BYTES`` pieces; the id and mask checks use the same pieces.
"""

from __future__ import annotations

import json
import os
import stat

import crc32c
import numpy as np

from .formats import DataError

RECORDED = (
    "tokens.bin",
    "mask.bin",
    "index.npy",
)  # the files whose length and crc32c meta.json holds
TOKEN_DTYPES = ("uint16", "uint32")
INT64_MAX = (1 << 63) - 1
SCAN_BYTES = 8 << 20  # a checksum reads this much of a file at a time
MAX_META_BYTES = 1 << 24
ORIGIN_FILE, ORIGIN_LINE = 0, 1  # columns of Tokenized.origin


class CacheDamage(DataError):
    """A cache entry's file is not what its build wrote (the message names the file and what)."""


def token_dtype(vocab_size: int) -> str:
    """The dtype of the ids of a vocabulary of ``vocab_size`` (uint16 up to 65536 ids)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def file_record(path: str) -> dict:
    """``{"bytes", "crc32c"}`` of the file at ``path``, as meta.json records it."""
    crc, _ = scan(path, None)
    return {"bytes": os.path.getsize(path), "crc32c": crc}


def scan(path: str, dtype: str | None) -> tuple[int, int]:
    """(crc32c, largest value) of the file at ``path`` read in pieces, the values read as ``dtype``
    (None: no values, largest 0)."""
    crc, top = 0, 0
    item = np.dtype(dtype).itemsize if dtype else 1
    with open(path, "rb") as f:
        while piece := f.read(SCAN_BYTES - SCAN_BYTES % item):
            crc = crc32c.crc32c(piece, crc)
            if dtype and len(piece) >= item:
                top = max(top, int(np.frombuffer(piece, dtype, len(piece) // item).max()))
    return crc, top


def read_meta(path: str) -> dict:
    """The JSON object of ``<path>/meta.json``; CacheDamage for one that cannot be read."""
    file = os.path.join(path, "meta.json")
    try:
        with open(file, "rb") as f:
            raw = f.read(MAX_META_BYTES + 1)
        if len(raw) > MAX_META_BYTES:
            raise ValueError(f"over {MAX_META_BYTES} bytes")
        meta = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (OSError, ValueError, RecursionError) as e:
        raise CacheDamage(f"{file}: not a readable JSON file ({e})") from None
    if not isinstance(meta, dict):
        raise CacheDamage(f"{file}: expected a JSON object, got {type(meta).__name__}")
    return meta


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def check_meta(path: str, meta: dict, expected: dict) -> None:
    """CacheDamage naming the first field of ``meta`` that is not what a build with the inputs
    ``expected`` (the fields fixed by the key) writes: every field present, no other, bounded."""
    file = os.path.join(path, "meta.json")
    fields = {*expected, "n_tokens", "n_examples", "checksums"}
    unknown, missing = sorted(set(meta) - fields), sorted(fields - set(meta))
    if unknown or missing:
        raise CacheDamage(
            f"{file}: expected the fields {sorted(fields)}; missing {missing}, unknown {unknown}"
        )
    for name, want in expected.items():
        if type(meta[name]) is not type(want) or meta[name] != want:
            raise CacheDamage(
                f"{file}: field {name!r} is {meta[name]!r:.80}, a build of this data writes "
                f"{want!r:.80}"
            )
    for name in ("n_tokens", "n_examples"):
        _check_int(file, name, meta[name], 1, INT64_MAX)
    sums = meta["checksums"]
    if not isinstance(sums, dict) or sorted(sums) != sorted(RECORDED):
        raise CacheDamage(
            f"{file}: field 'checksums' must name exactly {list(RECORDED)}, got {sums!r:.80}"
        )
    for name in RECORDED:
        record = sums[name]
        if not isinstance(record, dict) or sorted(record) != ["bytes", "crc32c"]:
            raise CacheDamage(
                f"{file}: checksums.{name} must be {{'bytes', 'crc32c'}}, got {record!r:.80}"
            )
        _check_int(file, f"checksums.{name}.bytes", record["bytes"], 0, INT64_MAX)
        _check_int(file, f"checksums.{name}.crc32c", record["crc32c"], 0, (1 << 32) - 1)


def _check_int(file: str, field: str, value, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CacheDamage(
            f"{file}: field {field!r} must be an int in [{lo}, {hi}], got {value!r:.80}"
        )


def check_files(path: str, meta: dict, verify: bool) -> None:
    """CacheDamage unless every recorded file is a regular file of its recorded length, the token
    and mask files hold ``n_tokens`` elements, and (``verify``) each file's crc32c is the recorded
    one, every id is below the vocabulary and every mask byte is 0 or 1."""
    sizes = {
        "tokens.bin": meta["n_tokens"] * np.dtype(meta["dtype"]).itemsize,
        "mask.bin": meta["n_tokens"],
    }
    for name in RECORDED:
        file = os.path.join(path, name)
        record = meta["checksums"][name]
        try:
            st = os.lstat(file)
        except FileNotFoundError:
            raise CacheDamage(f"{file}: missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise CacheDamage(f"{file}: not a regular file (a symlink or a directory)")
        want = sizes.get(name, record["bytes"])
        if st.st_size != record["bytes"] or st.st_size != want:
            raise CacheDamage(
                f"{file}: {st.st_size} bytes, meta.json records {record['bytes']} (its n_tokens "
                f"{meta['n_tokens']} makes {want})"
            )
        if verify:
            _verify_file(file, name, record, meta)


def _verify_file(file: str, name: str, record: dict, meta: dict) -> None:
    dtype = {"tokens.bin": meta["dtype"], "mask.bin": "uint8"}.get(name)
    crc, top = scan(file, dtype)
    if crc != record["crc32c"]:
        raise CacheDamage(
            f"{file}: crc32c {crc:#010x}, meta.json records {record['crc32c']:#010x}: the file "
            "(or its record) changed after the build"
        )
    limit = meta["vocab_size"] if name == "tokens.bin" else 2
    if dtype is not None and top >= limit:
        what = (
            f"id {top}, outside the vocabulary of {limit}"
            if limit > 2
            else f"mask byte {top}, not 0 or 1"
        )
        raise CacheDamage(f"{file}: holds {what}")


def load_index(path: str, meta: dict) -> np.ndarray:
    """``index.npy`` as int64 (n_examples, 3), checked to describe examples of the token file (see
    the module's docstring); CacheDamage naming what is wrong."""
    file = os.path.join(path, "index.npy")
    try:
        index = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise CacheDamage(f"{file}: not a numpy array file ({e})") from None
    n = meta["n_examples"]
    if index.dtype != np.int64 or index.shape != (n, 3):
        raise CacheDamage(
            f"{file}: expected int64 of shape ({n}, 3) (meta.json's n_examples), got "
            f"{index.dtype} of shape {index.shape}"
        )
    starts = np.append(index[:, 0], meta["n_tokens"])
    if starts[0] != 0 or not bool(np.all(starts[1:] > starts[:-1])):  # no subtraction: no overflow
        raise CacheDamage(
            f"{file}: example starts must run from 0, strictly increasing, below n_tokens "
            f"{meta['n_tokens']} (each example at least one token)"
        )
    origin = index[:, 1:]
    if (
        origin[:, ORIGIN_FILE].min() < 0
        or origin[:, ORIGIN_FILE].max() >= len(meta["files"])
        or origin[:, ORIGIN_LINE].min() < 0
    ):
        raise CacheDamage(
            f"{file}: an example's file index is outside the {len(meta['files'])} data files or "
            "its line is negative"
        )
    return index
