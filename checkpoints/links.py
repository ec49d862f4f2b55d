"""Frozen rows saved once: a later save of the same run hard-links the chunk files of wholly frozen
groups.

A group whose every leaf is frozen (``zf.Model.trainable``: ``StateView.frozen``) has its rows
written at init only, so every later save of the same run would write the same bytes into its arrays
again. Instead, each rank hard-links (``os.link``) the chunk files it would have written from the
run's previous checkpoint: no snapshot, no staging memory, no write. A hard link is a second name of
the same file, so deleting the first checkpoint (``keep=``, ``shutil.rmtree``) leaves the second one
whole; an edit of a chunk file in place would show in both (tools that replace files by a rename do
not).

The previous checkpoint is the engine's last committed save in this process, or the checkpoint its
state was restored from (for the groups read as saved, not converted). It is used only while it is
still there with the save id recorded, and only for a group each of whose array entries (name,
dtype, shape, chunk layout, description) and checksum setting are the new save's; a chunk file there
that is not a regular file of the right size, a failed link (another file system) or anything else
falls back to writing the row, the links made for it removed first (a fallback write truncates its
file, which must never be a link into the earlier checkpoint).
"""

from __future__ import annotations

import os
import stat
import weakref
from typing import NamedTuple

from .arrays import TORCH_DTYPES, chunk_file_bytes
from .manifest import MANIFEST, MAX_MANIFEST_BYTES
from .schema import load_json


class Source(NamedTuple):
    """A checkpoint whose arrays of ``groups`` hold exactly an engine's rows of those groups."""

    path: str
    manifest: dict
    groups: frozenset[str]


_sources: weakref.WeakKeyDictionary = (
    weakref.WeakKeyDictionary()
)  # engine (StateView.identity) -> Source


def remember(store, path: str, manifest: dict, groups) -> None:
    """``path`` (with ``manifest``) holds ``store``'s rows of ``groups`` as they are: later saves
    may link them."""
    _sources[store.identity] = Source(os.path.abspath(path), manifest, frozenset(groups))


def frozen_groups(store) -> list[str]:
    return [g for g in store.groups if store.is_frozen(g)]


def linkable(store, manifest: dict) -> tuple[str | None, frozenset[str]]:
    """(the checkpoint to link from, the groups a save writing ``manifest`` may link from it)."""
    source = _sources.get(store.identity)
    if (
        source is None
        or not _still_there(source)
        or source.manifest["checksums"] != manifest["checksums"]
    ):
        return None, frozenset()
    before = {e["name"]: e for e in source.manifest["arrays"]}
    groups = [
        g
        for g in source.groups
        if store.is_frozen(g)
        and all(before.get(e["name"]) == e for e in manifest["arrays"] if e["group"] == g)
    ]
    return (source.path if groups else None), frozenset(groups)


def _still_there(source: Source) -> bool:
    try:
        found = load_json(os.path.join(source.path, MANIFEST), MAX_MANIFEST_BYTES)
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and found.get("save_id") == source.manifest["save_id"]


def link_row(
    source: str, target: str, entries: list[dict], row: int, spans: dict, checksums: bool
) -> list[str]:
    """Hard-link this rank's chunk files of ``row`` of every array in ``entries`` (its elements
    ``spans[kind]``) from the checkpoint ``source`` into the save directory ``target``; returns the
    row directories made (to be made durable). OSError where any link fails, with none of this row's
    links left behind."""
    made, dirs = [], []
    try:
        for e in entries:
            lo, hi = spans[e["kind"]]
            if hi <= lo:
                continue
            cols = e["chunk_cols"]
            size = chunk_file_bytes(cols, TORCH_DTYPES[e["dtype"]].itemsize, checksums)
            src, dst = (os.path.join(root, e["name"], "c", str(row)) for root in (source, target))
            os.makedirs(dst, exist_ok=True)
            dirs.append(dst)
            for c in range(lo // cols, -(-hi // cols)):
                st = os.lstat(os.path.join(src, str(c)))
                if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                    raise OSError(f"{src}/{c} is not a chunk file of {size} bytes")
                os.link(os.path.join(src, str(c)), os.path.join(dst, str(c)), follow_symlinks=False)
                made.append(os.path.join(dst, str(c)))
    except OSError:
        for path in made:
            os.unlink(path)
        raise
    return dirs
