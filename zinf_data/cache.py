"""The tokenized data as memory-mapped token files, built once, verified on every open and reused
while nothing changed.

A cache entry is a directory ``CACHE/<key>/`` of

    tokens.bin   every example's token ids back to back, uint16 (vocabularies up to 65536) or
                 uint32
    mask.bin     uint8, parallel to tokens: 1 where the token is a training target
    index.npy    int64 (N, 3): per example its start in tokens.bin, its file (an index into meta's
                 ``files``) and its line (JSONL, from 1) or row (Parquet/Arrow, from 0)
    meta.json    the format version, the key's inputs, the files, the token dtype, the vocabulary
                 size, the counts, and each of the three files' length and crc32c

``key`` is a sha256 over the data files' contents, the tokenizer files
(``tokenize.tokenizer_hash``), the format, the field names and ``train_on_prompt``: a second run
with the same inputs reads the entry, a change to any of them builds a new one. An entry is written
under a temporary name ``<key>.tmp-<pid>`` and renamed into place when complete, so a failed or
interrupted build leaves nothing that a later run would read; a later run removes the temporary
builds of processes that no longer run.

Opening an entry checks it (``cache_check``): a damaged or incomplete one (a flipped byte, a cut
file, an edited index or meta.json, meta.json deleted) is rebuilt from the data files, said once on
the ``zinf_data`` logger; ``verify=False`` (``--no-verify``, for huge caches) skips the checksums
and the id scan, keeping the checks of the lengths and the index.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from .cache_check import (
    RECORDED,
    CacheDamage,
    check_files,
    check_meta,
    file_record,
    load_index,
    read_meta,
    token_dtype,
)
from .formats import DEFAULT_FIELDS, DataError, Fields, Where, read_records
from .tokenizer import encode, tokenizer_hash

VERSION = 2  # 2: meta.json records the vocabulary and each file's length and crc32c
CHUNK = 4096  # records encoded per call of the tokenizer (its threads work on a batch)
log = logging.getLogger("zinf_data")


class Tokenized(NamedTuple):
    """A cache entry, memory-mapped: ``tokens`` / ``mask`` (n_tokens,), ``starts`` (N + 1,) with the
    end last, ``origin`` (N, 2) file index and line, ``files`` the data files."""

    tokens: np.ndarray
    mask: np.ndarray
    starts: np.ndarray
    origin: np.ndarray
    files: list[str]
    path: str

    def where(self, i: int) -> Where:
        path = self.files[int(self.origin[i, 0])]
        return Where(path, int(self.origin[i, 1]), path.endswith((".parquet", ".arrow")))

    def __len__(self) -> int:
        return len(self.starts) - 1


def cache_key(
    files: list[str], fmt: str, tok_dir: str, fields: Fields, train_on_prompt: bool
) -> str:
    h = hashlib.sha256(
        json.dumps(
            [VERSION, fmt, asdict(fields), train_on_prompt, tokenizer_hash(tok_dir)]
        ).encode()
    )
    for path in files:
        h.update(os.path.abspath(path).encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:32]


def tokenized(
    files: list[str],
    fmt: str,
    tok,
    tok_dir: str,
    cache_dir: str,
    fields: Fields = DEFAULT_FIELDS,
    train_on_prompt: bool = False,
    progress: bool = True,
    verify: bool = True,
) -> Tokenized:
    """The cache entry of ``files`` tokenized by ``tok`` (loaded from ``tok_dir``): opened and
    checked if present (``verify``: with its checksums), else built; a damaged entry is rebuilt
    (said once on the ``zinf_data`` logger). DataError for data that cannot be read, or an entry
    damaged as it is built."""
    for path in files:
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such data file")
    path = os.path.join(cache_dir, cache_key(files, fmt, tok_dir, fields, train_on_prompt))
    expected = {
        "version": VERSION,
        "format": fmt,
        "files": [os.path.abspath(p) for p in files],
        "train_on_prompt": train_on_prompt,
        "vocab_size": len(tok),
        "dtype": token_dtype(len(tok)),
    }
    remove_stale_builds(path)
    damaged = None  # the damaged entry found, by its inode: install replaces that one only
    if os.path.lexists(path):
        try:
            return open_entry(path, expected, verify)
        except CacheDamage as e:
            log.warning("token cache: %s; rebuilding the entry from the data files", e)
            damaged = _inode(path)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    _remove(tmp)
    try:
        _build(tmp, files, fmt, tok, fields, train_on_prompt, progress, expected)
        install(tmp, path, damaged)
    finally:
        _remove(tmp)
    return open_entry(path, expected, verify)


def open_entry(path: str, expected: dict, verify: bool = True) -> Tokenized:
    """The entry at ``path``, memory-mapped once it passed ``cache_check``'s checks against the
    key's inputs ``expected``; CacheDamage naming the file and what is wrong."""
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise CacheDamage(f"{path}/meta.json: missing (an incomplete entry)")
    meta = read_meta(path)
    check_meta(path, meta, expected)
    check_files(path, meta, verify)
    index = load_index(path, meta)
    n_tokens = meta["n_tokens"]
    tokens = np.memmap(
        os.path.join(path, "tokens.bin"), dtype=meta["dtype"], mode="r", shape=(n_tokens,)
    )
    mask = np.memmap(os.path.join(path, "mask.bin"), dtype=np.uint8, mode="r", shape=(n_tokens,))
    starts = np.append(index[:, 0], n_tokens)
    return Tokenized(tokens, mask, starts, index[:, 1:], meta["files"], path)


def install(tmp: str, path: str, damaged: int | None = None) -> None:
    """Rename the complete build ``tmp`` to ``path``, the damaged entry there (``damaged``: its
    inode, as found before the build) moved aside and removed first. An entry another process
    installed while this one built (the ranks of one run, each tokenizing the same files) is kept
    as it is, and ``tmp`` left to the caller to remove: replacing it would pull its files from
    under that process's reads."""
    found = _inode(path)
    if found is not None and found != damaged:
        return  # another process's entry, complete: renamed whole
    if found is not None:
        aside = f"{path}.old-{os.getpid()}"
        _remove(aside)
        try:
            os.rename(path, aside)
        except FileNotFoundError:  # another process moved it first
            pass
        _remove(aside)
    try:
        os.rename(tmp, path)  # the entry appears whole or not at all
    except OSError:
        if not os.path.isfile(os.path.join(path, "meta.json")):  # not another process's entry
            raise


def _inode(path: str) -> int | None:
    """The inode of ``path`` (None: nothing there now)."""
    try:
        return os.lstat(path).st_ino
    except FileNotFoundError:
        return None


def remove_stale_builds(path: str) -> None:
    """Remove ``<path>.tmp-<pid>`` and ``<path>.old-<pid>`` left by processes that no longer run."""
    for stale in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        pid = stale.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid() or not _running(int(pid)):
            _remove(stale)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or a name no process has: left alone
    return True


def _remove(path: str) -> None:
    """Remove the directory or file at ``path``, if any."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _build(
    tmp: str,
    files: list[str],
    fmt: str,
    tok,
    fields: Fields,
    train_on_prompt: bool,
    progress: bool,
    expected: dict,
) -> None:
    """Tokenize ``files`` into the entry directory ``tmp``; its meta.json holds ``expected`` and
    what was written."""
    os.makedirs(tmp)
    dtype = np.dtype(expected["dtype"])
    index: list[tuple[int, int, int]] = []
    with (
        open(os.path.join(tmp, "tokens.bin"), "wb") as ft,
        open(os.path.join(tmp, "mask.bin"), "wb") as fm,
        ThreadPoolExecutor(1, thread_name_prefix="zinf-tokenize") as worker,
    ):
        bar = tqdm(unit="rec", desc="tokenizing", disable=not progress)
        # the chunk being encoded on the worker while the next one is read and parsed here
        pending = None
        for k, path in enumerate(files):
            for chunk in _chunks(read_records(path, fmt, fields)):
                wheres, records = zip(*chunk, strict=True)
                encoding = worker.submit(
                    encode, list(records), list(wheres), fmt, tok, train_on_prompt
                )
                if pending is not None:
                    _write_chunk(ft, fm, index, dtype, *pending)
                    bar.update(len(pending[1]))
                pending = (k, wheres, encoding)
        if pending is not None:
            _write_chunk(ft, fm, index, dtype, *pending)
        bar.close()
    if not index:
        raise DataError(f"{', '.join(files)}: no records")
    n = int(os.path.getsize(os.path.join(tmp, "mask.bin")))
    np.save(os.path.join(tmp, "index.npy"), np.asarray(index, dtype=np.int64).reshape(-1, 3))
    sums = {name: file_record(os.path.join(tmp, name)) for name in RECORDED}
    meta = {**expected, "n_tokens": n, "n_examples": len(index), "checksums": sums}
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def _write_chunk(ft, fm, index: list, dtype, k: int, wheres: tuple, encoding: Future) -> None:
    """Append one encoded chunk (file ``k``'s records at ``wheres``) to the token and mask files and
    the index."""
    # sync: the worker encoded the chunk (its DataError re-raised here)
    encoded = encoding.result()
    n = ft.tell() // np.dtype(dtype).itemsize
    for where, (ids, _) in zip(wheres, encoded, strict=True):
        index.append((n, k, where.line))
        n += len(ids)
    _flat(encoded, 0, dtype).tofile(ft)  # one write per chunk
    _flat(encoded, 1, np.uint8).tofile(fm)


def _flat(encoded: list[tuple], j: int, dtype) -> np.ndarray:
    """Item ``j`` (ids or mask) of every encoded record, back to back."""
    return np.concatenate([np.asarray(e[j], dtype=dtype) for e in encoded])


def _chunks(records):
    chunk = []
    for item in records:
        chunk.append(item)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
