"""Checkpoint test drivers, module-level so spawned / forked processes can run them.

Every run trains the small test GPT (``engine_helpers.CFG``) with AdamW on ``batches(...)``; rank r
of a world of W trains on rows ``chunk(W)[r]`` of each batch, so every world size is the same
training.
"""

from __future__ import annotations

import dataclasses
import os

import optree
import torch
from engine_helpers import CFG, batches

import checkpoints
import zinf_fn as zf
from checkpoints.rows import kind_range
from layers import gpt
from zinf_fn.state import view

LR = 3e-3


def optimizer():
    return zf.adamw(lr=LR, b1=0.9, b2=0.95, weight_decay=0.1)


def config(placement: str = "none", nvme_path: str | None = None, **kw) -> zf.Config:
    return zf.Config(
        offload_params=placement, offload_optimizer=placement, nvme_path=nvme_path, **kw
    )


def model(cfg=CFG):
    return gpt.model(cfg)


def rank_batch(batch: dict, rank: int, world: int) -> dict:
    return {k: v.chunk(world)[rank] for k, v in batch.items()}


def train(state, data, rank: int = 0, world: int = 1):
    """Train on ``data`` (a list of full batches); returns (state, losses)."""
    losses = []
    for batch in data:
        state, metrics = zf.train_step(state, rank_batch(batch, rank, world))
        losses.append(metrics["loss"])
    return state, losses


def placed(tmp_path, placement: str, **kw) -> zf.Config:
    """``config(placement, **kw)``, on NVMe in a fresh directory under ``tmp_path``."""
    if placement != "nvme":
        return config(placement, **kw)
    path = tmp_path / f"nvme{len(os.listdir(tmp_path))}"
    path.mkdir()
    return config(placement, nvme_path=str(path), **kw)


def assert_rows_equal(a: dict, b: dict):
    """Two dicts of rows hold the same keys and every row bit for bit."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"rows differ: {bad}"


def local_rows(state) -> dict[str, torch.Tensor]:
    """Copies of every row of every saved state kind on this rank: ``"<group>/<kind>/<row>" ->
    shard``."""
    store = view(state)
    out = {}
    for gname, group in store.groups.items():
        for kind in store.kinds(group=gname):
            for row in range(group.rows):
                n, dtype = store.row_numel(kind, gname), store.dtype(kind, gname)
                buf = torch.empty(n, dtype=dtype, device=store.device(kind))
                store.read_(kind, gname, row, buf).result()
                out[f"{gname}/{kind}/{row}"] = buf.cpu().clone()
    return out


def full_params(state, kind: str = "master") -> list[torch.Tensor]:
    """The gathered parameter leaves (collective), flattened in tree order."""
    return [x.clone() for x in optree.tree_leaves(zf.gather_params(state, kind))]


def equal_lists(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def portable(tree):
    """Tensors -> numpy arrays (bf16 upcast to fp32, which is exact), to send results between
    processes: torch's own tensor pickling hands file descriptors over, which dies with the process
    that sent them."""
    return optree.tree_map(
        lambda x: (
            (x.float() if x.dtype == torch.bfloat16 else x).numpy()
            if isinstance(x, torch.Tensor)
            else x
        ),
        tree,
    )


def tensors(tree):
    """The inverse of ``portable`` (bf16 values come back as their exact fp32 upcast)."""
    import numpy as np

    return optree.tree_map(lambda x: torch.from_numpy(x) if isinstance(x, np.ndarray) else x, tree)


# -- spawned in a fresh process
# ----------------------------------------------------------------------------
def resume_worker(rank, world, path, first, last):
    """Restore ``path`` in this (fresh) process and train on batches[first:last]."""
    state = checkpoints.restore(
        path, model(), optimizer(), config("cpu", param_dtype=torch.float32)
    )
    assert state.step == first, (state.step, first)
    state, losses = train(state, batches(last)[first:last], rank, world)
    return portable((losses, local_rows(state)))


def write_worker(rank, world, path, placement, steps, more):
    """Train ``steps`` steps, save to ``path``, train ``more``; returns what rank 0 saw."""
    state = zf.init(model(), optimizer(), config(placement))
    data = batches(steps + more)
    state, losses = train(state, data[:steps], rank, world)
    saved = {"master": full_params(state), "param": full_params(state, "param")}
    checkpoints.save(path, state)
    state, more_losses = train(state, data[steps:], rank, world)
    return portable({"losses": losses + more_losses, "saved": saved}) if rank == 0 else None


def restore_worker(rank, world, path, placement, first, last, partition="allgather", save_to=None):
    """Restore ``path`` at this world size, placement and partition mode, gather its params, (save
    it again to ``save_to``), train batches[first:last]."""
    state = checkpoints.restore(path, model(), optimizer(), config(placement, partition=partition))
    restored = {"master": full_params(state), "param": full_params(state, "param")}
    if save_to is not None:
        checkpoints.save(save_to, state)
    state, losses = train(state, batches(last)[first:last], rank, world)
    return (
        portable({"restored": restored, "losses": losses, "step": state.step})
        if rank == 0
        else None
    )


def write_then_restore_worker(rank, world, dst, steps, more, src, placement, broadcast_to=None):
    """One launch: a fresh run writes ``dst`` (as write_worker), then ``src`` is restored (as
    restore_worker); with ``broadcast_to``, ``src`` is restored once more in "broadcast" partition
    mode and saved from there to ``broadcast_to``."""
    written = write_worker(rank, world, dst, "cpu", steps, more)
    restored = restore_worker(rank, world, src, placement, steps, steps + more)
    if broadcast_to is None:
        return (written, restored) if rank == 0 else None
    broadcast = restore_worker(
        rank, world, src, "cpu", steps, steps + more, "broadcast", broadcast_to
    )
    return (written, restored, broadcast) if rank == 0 else None


# -- forked and killed
# ------------------------------------------------------------------------------------- The
# file-system calls a save makes (any thread): a kill lands just before one of them. A save of the
# test GPT makes ~110 of them up to its commit (the rename) and ~140 more deleting the oldest
# checkpoint (keep=2).
FS_CALLS = ("open", "pwrite", "fsync", "rename", "replace", "mkdir", "unlink", "remove", "rmdir")


def die_at_fs_call(n: int) -> None:
    """SIGKILL this process just before its ``n``-th file-system call from now (``FS_CALLS``, any
    thread): a kill at a chosen point of a save's progress rather than after a delay, so no timing
    decides it."""
    import itertools
    import signal

    count = itertools.count(1)  # next() is atomic under the GIL: each call gets its own number

    def counted(real):
        def call(*args, **kwargs):
            if next(count) == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return call

    for name in FS_CALLS:
        setattr(os, name, counted(getattr(os, name)))


def save_until_killed(root: str, n_batches: int, kill_at: int, max_saves: int = 16):
    """Resume from the newest checkpoint under ``root``, then alternate one step and one save until
    the ``kill_at``-th file-system call of the saves kills the process (returning after
    ``max_saves`` saves means the kill point was never reached)."""
    torch.set_num_threads(1)
    path = checkpoints.latest(root)
    state = checkpoints.restore(
        path, model(), optimizer(), config("cpu", param_dtype=torch.float32)
    )
    data = batches(n_batches)
    die_at_fs_call(kill_at)  # after the restore: only the saves' calls count
    for _ in range(max_saves):
        state, _ = train(state, [data[state.step % n_batches]])
        checkpoints.save(f"{root}/step_{state.step:06d}", state, keep=2)


def tree_digest(root) -> dict:
    """(size, mtime_ns, bytes) of every file under root: 'nothing changed' is this staying equal."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[p] = (os.path.getsize(p), os.stat(p).st_mtime_ns, fh.read())
    return out


def gathered_rows(state) -> list[torch.Tensor]:
    """Every row of every state kind of every unit and tile, gathered over ranks (collective): fp32
    on the CPU, a remainder master joined ("master"), compressed moments upcast."""
    v = view(state)
    kinds = ["master", *(f"opt.{i}" for i in range(v.n_opt_leaves))]
    return [v.gather_row(kind, r.unit) for r in v.all_rows() for kind in kinds]


def unit_rows(state) -> dict[tuple[str, str], torch.Tensor]:
    """(unit or tile name, kind) -> its row gathered over ranks (collective), padding cut: "master"
    (a remainder master joined) and every optimizer row as stored (int8 codes as uint8, their
    "opt.<i>.absmax" scales)."""
    v = view(state)
    return {
        (r.unit.name, k): v.gather_row(k, r.unit)
        for r in v.all_rows()
        for k in ["master", *(k for k in v.kinds(group=r.group) if k.startswith("opt."))]
    }


TILED = dataclasses.replace(CFG, mlp_tiles=3, head_tiles=2)  # tile groups of their own, int8 too


def not_embed(path: str, numel: int) -> bool:
    """The int8 tests' compression predicate: every group int8 (the small ones too) but the
    embedding."""
    return not path.startswith("embed")


def int8_opt(moments: str = "int8"):
    return zf.adamw(lr=LR, b1=0.9, b2=0.95, weight_decay=0.1, moments=moments, compress=not_embed)


def int8_worker(rank, world, path, steps, more):
    """A remainder + int8 run of the tiled GPT at this world size: ``steps`` steps, a save to
    ``path``, ``more`` steps; ``path`` restored (same world) trains the same ``more`` steps; and
    restored with fp32 moments (dequantized: a rank's fp32 shard starts inside an int8 block); and
    in "broadcast" mode, saved from there to ``path + "_broadcast"``. Rank 0's results
    (``unit_rows``)."""
    cfg = config("cpu", master="remainder")
    data = batches(steps + more)
    state, losses = train(zf.init(model(TILED), int8_opt(), cfg), data[:steps], rank, world)
    saved = unit_rows(state)
    v = view(state)
    mine = {(g, k): kind_range(v, v.stored_as(), g, k) for g in v.groups for k in v.kinds(group=g)}
    spans = v.comm.all_gather_object(
        mine
    )  # sync: every rank's; what each writes of every array (rows.py)
    checkpoints.save(path, state)
    state, later = train(state, data[steps:], rank, world)
    back, resumed = train(
        checkpoints.restore(path, model(TILED), int8_opt(), cfg), data[steps:], rank, world
    )
    fp32 = checkpoints.restore(path, model(TILED), int8_opt("fp32"), cfg)
    broadcast = checkpoints.restore(
        path, model(TILED), int8_opt(), config("cpu", master="remainder", partition="broadcast")
    )
    checkpoints.save(path + "_broadcast", broadcast)
    out = {
        "losses": losses + later,
        "saved": saved,
        "final": unit_rows(state),
        "resumed_losses": resumed,
        "resumed_final": unit_rows(back),
        "as_fp32": unit_rows(fp32),
        "spans": spans,
        "broadcast": unit_rows(broadcast),
    }
    return portable(out) if rank == 0 else None


def compressed_worker(rank, world, path, steps, more):
    """A remainder + bf16-moments run at this world size: ``steps`` steps, a save to ``path``,
    ``more`` steps; then ``path`` restored (same world) and trained on the same ``more`` steps. Rank
    0's results."""

    def opt():
        return zf.adamw(lr=LR, b1=0.9, b2=0.95, weight_decay=0.1, moments="bf16")

    cfg = config("cpu", master="remainder")
    data = batches(steps + more)
    state, losses = train(zf.init(model(), opt(), cfg), data[:steps], rank, world)
    saved = gathered_rows(state)
    checkpoints.save(path, state)
    state, later = train(state, data[steps:], rank, world)
    final = gathered_rows(state)
    back, resumed = train(checkpoints.restore(path, model(), opt(), cfg), data[steps:], rank, world)
    out = {
        "losses": losses + later,
        "saved": saved,
        "final": final,
        "resumed_losses": resumed,
        "resumed_final": gathered_rows(back),
    }
    return portable(out) if rank == 0 else None
