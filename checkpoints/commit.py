"""Crash safety: a save fills a hidden sibling directory and becomes visible by one atomic rename.

    runs/step_00000100            a complete checkpoint (a directory with a manifest.json)
    runs/.step_00000100.tmp-<id>  a save in progress, or one killed mid-way: never read, never
    listed

A checkpoint is complete iff its (non-hidden) directory has a valid manifest; the manifest is the
last file written into the temporary directory, and every file and directory is fsynced before the
rename, so a crash at any moment leaves either the previous state of ``path`` or the new complete
checkpoint. Retention (``keep=``) runs only after the new checkpoint is committed, and deletes by
first renaming a checkpoint out of sight, so a crash during deletion never leaves a half-deleted
checkpoint visible.
"""

from __future__ import annotations

import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor

from zinf_fn.io.sync import fsync_all, fsync_path, libc_function, syncfs

from .manifest import CheckpointError, read_manifest


def temp_dir(path: str, save_id: str) -> str:
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.tmp-{save_id}")


def new_save_id() -> str:
    return uuid.uuid4().hex[:12]


def fsync_tree(
    root: str, skip_chunk_dirs: bool = False, pool: ThreadPoolExecutor | None = None
) -> None:
    """fsync every file and directory under ``root`` (``zinf_fn.io.sync.fsync_all``: in parallel on
    ``pool``, or on threads of its own).

    ``skip_chunk_dirs``: leave out the directories of chunk files (``<array>/c/<row>``) and their
    files: tensorstore (``file_io_sync``) fsyncs each chunk file, and its directory after the rename
    that creates it; the O_DIRECT path syncs them in ``ChunkIO.sync``.
    """
    paths = []
    for dirpath, _, names in os.walk(root):
        if skip_chunk_dirs and os.path.basename(os.path.dirname(dirpath)) == "c":
            continue
        paths += [dirpath, *(os.path.join(dirpath, n) for n in names)]
    fsync_all(paths, pool)


def sync_tree(
    root: str, skip_chunk_dirs: bool = False, pool: ThreadPoolExecutor | None = None
) -> None:
    """Everything under ``root`` durable: ``syncfs`` where the OS has it, else ``fsync_tree``."""
    if not syncfs(root):
        fsync_tree(root, skip_chunk_dirs, pool)


def is_complete(path: str) -> bool:
    try:
        read_manifest(path)
        return True
    except CheckpointError:
        return False


def check_target(path: str, overwrite: bool) -> None:
    """Refuse to save over an existing complete checkpoint (unless ``overwrite``) or over anything
    else."""
    if not os.path.lexists(path):
        return
    if is_complete(path):
        if not overwrite:
            raise FileExistsError(
                f"{path!r} already holds a complete checkpoint; pass overwrite=True to replace "
                "it, or save to a new path (e.g. one per step)"
            )
        return
    raise FileExistsError(
        f"{path!r} exists and is not a complete checkpoint; refusing to replace it "
        "(remove it yourself if it is garbage)"
    )


def commit_(tmp: str, path: str) -> None:
    """Make the fully written ``tmp`` visible as ``path`` atomically (replacing an old checkpoint
    there)."""
    fsync_path(tmp)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.lexists(path):
        if not _exchange(tmp, path):  # no renameat2: move the old one aside first (two renames)
            aside = temp_dir(path, new_save_id()).replace(".tmp-", ".old-")
            os.rename(path, aside)
            os.rename(tmp, path)
            tmp = aside
        fsync_path(
            parent
        )  # sync: the new checkpoint is durable under its name before the old is removed
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, path)
    fsync_path(parent)  # sync: the rename itself is durable


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where the OS has no such
    call."""
    fn = libc_function("renameat2")
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    return False


def checkpoints_in(root: str) -> list[tuple[int, int, str]]:
    """(step, mtime_ns, path) of every complete checkpoint directly under ``root``, oldest first.

    Only real directories count: a symlink is never listed, so ``latest`` never leads out of
    ``root`` and retention never renames or deletes anything a link points at."""
    if not os.path.isdir(root):
        return []
    found = []
    for entry in os.scandir(root):
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            manifest = read_manifest(entry.path)
        except CheckpointError:
            continue
        mtime = os.stat(
            os.path.join(entry.path, "manifest.json"), follow_symlinks=False
        ).st_mtime_ns
        found.append((manifest["step"], mtime, entry.path))
    return sorted(found)


def latest(root: str) -> str | None:
    """The path of the newest complete checkpoint under ``root`` (highest step, then newest), or
    None."""
    found = checkpoints_in(root)
    return found[-1][2] if found else None


def prune(root: str, keep: int, protect: str) -> list[str]:
    """Delete all but the ``keep`` newest complete checkpoints under ``root`` (never
    ``protect``)."""
    if keep < 1:
        raise ValueError(
            f"keep must be >= 1 (the checkpoint just saved is always kept), got {keep}"
        )
    found = [p for _, _, p in checkpoints_in(root)]
    doomed = [
        p
        for p in found[: max(0, len(found) - keep)]
        if os.path.abspath(p) != os.path.abspath(protect)
    ]
    for path in doomed:
        hidden = temp_dir(path, new_save_id()).replace(".tmp-", ".deleting-")
        os.rename(path, hidden)  # out of sight first: a crash mid-delete leaves only hidden garbage
        shutil.rmtree(hidden, ignore_errors=True)
    if doomed:
        fsync_path(root)
    return doomed


def remove_stale(path: str) -> None:
    """Remove temporary directories left by earlier, killed saves to the same ``path``."""
    parent, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(parent):
        return
    for entry in os.scandir(parent):
        ours = entry.name.startswith(f".{name}.") and any(
            t in entry.name for t in (".tmp-", ".old-", ".deleting-")
        )
        if ours and entry.is_dir(follow_symlinks=False):  # never a symlink: only what a save left
            shutil.rmtree(entry.path, ignore_errors=True)
