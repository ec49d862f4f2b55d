"""A manifest edited: at one key path (what the untrusted-input tests write back to a checkpoint),
or in place in a checkpoint directory by a function."""

from __future__ import annotations

import copy
import json
import os

DELETE = object()  # an edit that removes the field


def edited(doc: dict, path: tuple, new) -> dict:
    """A deep copy of ``doc`` with the value at key ``path`` replaced by ``new`` (the whole document
    for an empty path), or removed where ``new`` is ``DELETE``."""
    out = copy.deepcopy(doc)
    if not path:
        return new
    node = out
    for k in path[:-1]:
        node = node[k]
    if new is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = new
    return out


def edit_manifest(path, edit) -> None:
    """Rewrites ``path``'s manifest.json after ``edit(manifest)`` changed it in place."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)
