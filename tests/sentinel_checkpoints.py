"""A trained checkpoint with a sentinel copy beside it, and the outcome of restoring an edited copy:
what the untrusted-input tests (test_checkpoints_untrusted_*.py) share.

The sentinel copy has every chunk byte 0x5A; the edits point names, paths and links at it, so a
restore that read outside would hold 0x5A5A words (no saved state does: the check is made on the
reference too). "Bitwise the saved states" is the only success: an edit may be accepted only where
the field does not matter to what is restored (a timestamp, a learning rate).
"""

from __future__ import annotations

import os
import shutil

import torch
from ckpt_workers import config, local_rows, model, optimizer, train
from engine_helpers import batches

import checkpoints
import zinf_fn as zf

SENTINEL_BYTE = 0x5A


def save_with_sentinel_copy(root) -> tuple:
    """(root, good checkpoint, the same saved with checksums, its rows, the sentinel copy) for a
    2-step trained state, all under the directory ``root``; a test module's fixture ``saved``."""
    state = train(zf.init(model(), optimizer(), config()), batches(2))[0]
    good = checkpoints.save(root / "good", state)
    crc = checkpoints.save(root / "crc", state, checksums=True)
    outside = str(root / "outside")
    shutil.copytree(good, outside)
    for dirpath, _, files in os.walk(outside):
        if os.path.basename(os.path.dirname(dirpath)) == "c":  # <array>/c/<row>/<chunk>: the data
            for name in files:
                p = os.path.join(dirpath, name)
                with open(p, "r+b") as f:
                    f.write(bytes([SENTINEL_BYTE]) * os.path.getsize(p))
    rows = local_rows(state)
    assert not any(_has_sentinel(t) for t in rows.values())
    return root, good, crc, rows, outside


def _has_sentinel(t: torch.Tensor) -> bool:
    words = (
        t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
    )  # uint8 rows: 4 bytes a word
    return bool((words == (0x5A5A if t.element_size() == 2 else 0x5A5A5A5A)).any())


def restore_as_saved(path: str):
    """The checkpoint at ``path``, restored with the model, optimizer and config of its save."""
    return checkpoints.restore(path, model(), optimizer(), config())


def outcome(path: str, rows: dict, restore=restore_as_saved) -> str:
    """ "refused" (CheckpointError) or "same" (bitwise the saved rows); anything else fails the
    test."""
    try:
        state = restore(path)
    except checkpoints.CheckpointError as e:
        return f"refused: {e}"
    got = local_rows(state)
    assert not any(_has_sentinel(t) for t in got.values()), (
        "bytes from outside the checkpoint were restored"
    )
    assert got.keys() == rows.keys() and all(torch.equal(got[k], rows[k]) for k in rows), (
        "restored other bytes"
    )
    return "same"
