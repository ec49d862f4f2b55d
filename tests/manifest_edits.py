"""A manifest edited: at one key path (what the untrusted-input tests write back to a checkpoint),
or in place in a checkpoint directory by a function."""

from __future__ import annotations

import copy
import json
import os

DELETE = object()  # an edit that removes the field


def edited(doc: dict, path: tuple, new) -> dict:
    """A copy of ``doc`` with the value at key ``path`` replaced by ``new`` (the whole document for
    an empty path), or removed where ``new`` is ``DELETE``; ``doc`` is left as it was.

    Only the objects and lists on ``path`` are copied (shallowly): the rest is shared with ``doc``,
    so the result is for reading and writing out, never for editing in place. The untrusted-input
    tests make thousands of edits of one manifest: a deep copy of each was most of their time."""
    if not path:
        return new
    out = copy.copy(doc)
    node = out
    for k in path[:-1]:
        node[k] = copy.copy(node[k])
        node = node[k]
    if new is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = new
    return out


def write_json(file: str, doc) -> None:
    """Writes ``doc`` as JSON to ``file``, over what it held (created where it is missing).

    The file is overwritten in place, then cut to the new length: opening it with ``"w"`` cuts it
    to zero first, which ext4 (``auto_da_alloc``) follows with a flush of the new blocks at close,
    ~1 ms a write, most of the time of the tests that write thousands of edits. ``json.dumps``
    encodes in C, ``json.dump`` in Python: the same text."""
    with open(os.open(file, os.O_WRONLY | os.O_CREAT, 0o644), "w") as f:
        f.write(json.dumps(doc))
        f.truncate()


def edit_manifest(path, edit) -> None:
    """Rewrites ``path``'s manifest.json after ``edit(manifest)`` changed it in place."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    edit(manifest)
    write_json(os.path.join(path, "manifest.json"), manifest)
