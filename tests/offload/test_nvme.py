"""The NVMe tier: bitwise round trips, NVMe-placed training == in-RAM training, bad paths, failed
writes.

Every comparison here is bitwise: moving a state to disk and back must not change a bit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from engine_helpers import run_engine
from nvme_helpers import all_states, bits, head_row_written

import zinf_fn as zf
from zinf_fn.io import files as direct_io
from zinf_fn.offload.nvme import NvmeTier
from zinf_fn.planner import fit
from zinf_fn.state import view


def test_buffer_pool_hands_out_page_aligned_host_buffers():
    from zinf_fn.io.buffers import PAGE, BufferPool

    pool = BufferPool()
    for numel, dtype in [(1, torch.float32), (12345, torch.bfloat16), (1 << 20, torch.float32)]:
        assert pool.take(numel, dtype, torch.device("cpu")).data_ptr() % PAGE == 0


# -- training on NVMe is the same training
# --------------------------------------------------------------


@pytest.fixture(scope="module")
def in_ram():
    """The in-RAM (placement "none") runs, one per param dtype, shared by the depth cases."""
    cache = {}

    def get(dtype):
        if dtype not in cache:
            losses, final, _, state = run_engine(
                zf.Config(param_dtype=dtype, prefetch_depth=0, update_workers=0)
            )
            cache[dtype] = (losses, final, all_states(state))
        return cache[dtype]

    return get


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvme_training_bitwise_equals_in_ram(tmp_path, in_ram, depth, dtype):
    ref_losses, ref_final, ref_states = in_ram(dtype)
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        param_dtype=dtype,
        prefetch_depth=depth,
    )
    losses, final, _, state = run_engine(config)
    assert losses == ref_losses
    states = all_states(state)
    assert sorted(states) == sorted(
        ref_states
    )  # param, master, opt.0 (m), opt.1 (v) of every group
    for name, rows in states.items():
        assert torch.equal(bits(rows), bits(ref_states[name])), name
    assert all(torch.equal(a, b) for a, b in zip(_leaves(final), _leaves(ref_final), strict=True))


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree)


# -- bad input
# ------------------------------------------------------------------------------------------


def _init(path, **kw):
    from engine_helpers import CFG

    from layers import gpt

    config = zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(path), **kw)
    return zf.init(gpt.model(CFG), zf.adamw(), config)


def test_missing_nvme_path_is_rejected_at_init(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist.*mkdir -p"):
        _init(tmp_path / "nope")


def test_file_instead_of_directory_is_rejected_at_init(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        _init(tmp_path / "a_file")


def test_unwritable_nvme_path_is_rejected_at_init(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    with _read_only(target):
        with pytest.raises(ValueError, match=r"cannot write under .*ro/rank0/params"):
            _init(target)


@contextlib.contextmanager
def _read_only(path):
    """A directory nobody may write to: a read-only tmpfs when root (root ignores mode bits), else
    0o555."""
    if os.geteuid() == 0:
        with _mounted(path, "ro,size=1m"):
            yield
        return
    path.chmod(0o555)
    try:
        yield
    finally:
        path.chmod(0o755)


@contextlib.contextmanager
def _mounted(path, options):
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip(f"cannot mount a tmpfs at {path} (needs root and mount(8))")
    try:
        yield
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)  # never leave a mount behind


# -- failed writes
# ----------------------------------------------------------------------------------------


def _fill(directory, leave: int = 0) -> None:
    """Write a filler file until the file system is full, then free ``leave`` bytes of it."""
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
        if leave:
            os.ftruncate(fd, os.fstat(fd).st_size - leave)
    finally:
        os.close(fd)


def test_enospc_on_a_full_tmpfs_names_layer_and_state_and_keeps_old_rows(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with _mounted(mnt, "size=4m"):
        tier = NvmeTier(mnt, "rank0/optimizer")
        tier.allocate("blocks/master", 4, 64 << 10, torch.float32)
        old = [torch.randn(64 << 10) for _ in range(4)]
        for r in range(3):
            tier.write_("blocks/master", r, old[r]).result()
        _fill(mnt)
        with pytest.raises(OSError, match=r"layer blocks\.3 state 'master'.*No space left") as info:
            tier.write_("blocks/master", 3, old[3]).result()  # a new row needs space: refused whole
        assert info.value.errno == errno.ENOSPC
        new = torch.randn(64 << 10)
        tier.write_("blocks/master", 1, new).result()  # a written row is overwritten in place
        out = torch.empty(64 << 10)
        for r, want in enumerate([old[0], new, old[2], torch.zeros(64 << 10)]):
            tier.read_("blocks/master", r, out).result()
            assert torch.equal(out, want)
        assert (
            os.listdir(mnt / "rank0/optimizer/blocks/master/c/3") == []
        )  # no partial or temp file
        tier.close()


def test_enospc_during_training_raises_and_leaves_the_state_readable(tmp_path):
    """After init every state row is allocated; the first new row of a step (a checkpoint) hits
    ENOSPC.

    8 KiB are left free: room for the checkpoint array's metadata, none for its 16 KiB rows.
    """
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with _mounted(mnt, "size=16m"):
        from engine_helpers import batches

        state = _init(mnt, param_dtype=torch.float32, offload_activations="nvme")
        before = all_states(state)
        _fill(mnt, leave=8 << 10)
        with pytest.raises(
            OSError, match=r"writing layer blocks\.0 state 'boundaries'.*No space left"
        ):
            zf.train_step(state, batches(1)[0])
        os.unlink(mnt / "filler")
        after = all_states(state)
        for name, rows in before.items():  # the failed step changed no state row
            assert torch.equal(bits(after[name]), bits(rows)), name
        view(state).close()  # the failed step consumed the state: close its engine through the view


def test_enospc_during_init_names_layer_and_state_and_keeps_written_rows(tmp_path, monkeypatch):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # zf.init checks the free space first (tests/planner/test_planner.py); here the disk fills up
    # during init anyway (another writer), so the check sees room to spare
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fit.shutil, "disk_usage", lambda path: usage._replace(free=1 << 40))
    reference = all_states(_init(tmp_path / "ref" if (tmp_path / "ref").mkdir() is None else None))
    with _mounted(mnt, "size=256k"):
        with pytest.raises(OSError, match=r"writing layer (embed|blocks\.\d|head) state") as info:
            _init(mnt)
        assert info.value.errno == errno.ENOSPC
        tier = NvmeTier(mnt, "rank0/optimizer")  # the rows written before the failure
        tier.allocate("embed/master", 1, reference["opt:embed/master"].shape[1], torch.float32)
        out = torch.empty(reference["opt:embed/master"].shape[1])
        tier.read_("embed/master", 0, out).result()
        assert torch.equal(out, reference["opt:embed/master"][0])
        tier.close()


def test_injected_write_error_names_layer_and_state(tmp_path, monkeypatch):
    """The same contract without root: an OSError injected into the write syscall."""
    tier, good = head_row_written(tmp_path)

    def no_space(fd, mem, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io, "_pwrite_full", no_space)
    with pytest.raises(OSError, match=r"layer head state 'param' \(row 0 of 'head/param'") as info:
        tier.write_("head/param", 0, torch.zeros(5000).bfloat16()).result()
    assert info.value.errno == errno.ENOSPC
    out = torch.empty(5000, dtype=torch.bfloat16)
    tier.read_("head/param", 0, out).result()
    assert torch.equal(bits(out), bits(good))
    tier.close()


@pytest.mark.parametrize("depth", [0, 2])
def test_nvme_clipped_two_pass_and_grad_accum_bitwise_equal_in_ram(tmp_path, depth):
    """The two-pass clipping path stashes grads on NVMe and streams them back: still the same
    training."""
    common = dict(
        param_dtype=torch.bfloat16, clip_grad_norm=0.5, grad_accum=2, prefetch_depth=depth
    )
    ref_losses, _, _, ref_state = run_engine(zf.Config(**common), steps=6)
    ref = all_states(ref_state)
    losses, _, _, state = run_engine(
        zf.Config(
            offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path), **common
        ),
        steps=6,
    )
    assert losses == ref_losses
    states = all_states(state)
    assert "opt:blocks/grad" in states
    for name, rows in states.items():
        assert torch.equal(bits(rows), bits(ref[name])), name


def test_mixed_placements_bitwise_equal_in_ram(tmp_path):
    """Params on NVMe with the optimizer in RAM, and the other way round."""
    ref_losses, _, _, ref_state = run_engine(zf.Config(), steps=5)
    ref = all_states(ref_state)
    for params, opt in [("nvme", "cpu"), ("cpu", "nvme")]:
        config = zf.Config(
            offload_params=params, offload_optimizer=opt, nvme_path=str(tmp_path / params)
        )
        (tmp_path / params).mkdir()
        losses, _, _, state = run_engine(config, steps=5)
        assert losses == ref_losses
        for name, rows in all_states(state).items():
            assert torch.equal(bits(rows), bits(ref[name])), (params, opt, name)


def _train_world(rank, world_size, placement, path, partition):
    """Three steps on this rank's half of each batch; (losses, every state row of this rank)."""
    from engine_helpers import CFG, batches

    from layers import gpt

    config = zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        nvme_path=path,
        prefetch_depth=2,
        partition=partition,
    )
    state = zf.init(gpt.model(CFG), zf.adamw(), config)
    losses = []
    for batch in batches(3):
        part = {k: v.chunk(world_size)[rank] for k, v in batch.items()}
        state, metrics = zf.train_step(state, part)
        losses.append(metrics["loss"])
    rows = {k: bits(v).numpy() for k, v in all_states(state).items()}  # numpy: pickled by value
    zf.close(state)
    return losses, rows


PARTITIONS = ("allgather", "broadcast")


def _two_ranks_world(rank, world_size, root):
    """This rank's (in-RAM, on-NVMe under ``root/<partition>``) runs of each partition mode, all
    in one world."""
    return {
        p: (
            _train_world(rank, world_size, "none", None, p),
            _train_world(rank, world_size, "nvme", os.path.join(root, p), p),
        )
        for p in PARTITIONS
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[str, list[dict]]:
    """(the NVMe root, each rank's runs): one spawned world of 2 for both partition modes."""
    from dist_utils import run_world

    root = tmp_path_factory.mktemp("two_ranks")
    for partition in PARTITIONS:
        (root / partition).mkdir()
    return str(root), run_world(2, _two_ranks_world, root)


@pytest.mark.parametrize("partition", PARTITIONS)
def test_two_ranks_on_nvme_bitwise_equal_two_ranks_in_ram(two_ranks, partition):
    """Each rank keeps its own rows under rank<r>/ (a shard of every unit, or the units it owns):
    the same training as the in-RAM world of 2 in the same partition mode."""
    root, results = two_ranks
    assert sorted(os.listdir(os.path.join(root, partition))) == ["rank0", "rank1"]
    for (ref_losses, ref_rows), (losses, rows) in (r[partition] for r in results):
        assert losses == ref_losses
        assert sorted(rows) == sorted(ref_rows)
        assert all(np.array_equal(rows[k], ref_rows[k]) for k in ref_rows)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_tiled_gpt_on_nvme_bitwise_equals_in_ram(tmp_path, clip):
    """Tiles are units of their own groups: read on demand by the optimizer stream, written
    behind."""
    import dataclasses

    from engine_helpers import CFG
    from reference import make_batches

    from layers import gpt

    tiled = dataclasses.replace(CFG, attn_tiles=2, mlp_tiles=3, head_tiles=5)
    runs = []
    for placement in ("none", "nvme"):
        config = zf.Config(
            offload_params=placement,
            offload_optimizer=placement,
            nvme_path=str(tmp_path),
            clip_grad_norm=clip,
            prefetch_depth=2,
        )
        state = zf.init(gpt.model(tiled), zf.adamw(lr=3e-3), config)
        losses = []
        for batch in make_batches(tiled, 4, 8, seed=1):
            state, metrics = zf.train_step(state, batch)
            losses.append(metrics["loss"])
        runs.append((losses, all_states(state)))
    (ref_losses, ref), (losses, states) = runs
    assert losses == ref_losses
    assert any(":" in name for name in states)  # tile groups, e.g. "blocks:mlp.fc.w"
    assert sorted(states) == sorted(ref)
    for name, rows in states.items():
        assert torch.equal(bits(rows), bits(ref[name])), name
