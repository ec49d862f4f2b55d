"""Checkpoints in one process: bitwise round trips and resume, async saves that cannot tear, the
on-disk format read without project code, export/import, and every kind of bad input.

Storage moves are compared bitwise: a checkpoint stores the exact bits of every state row, and a
resumed run executes the same kernels in the same order as the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import tensorstore as ts
import torch
from ckpt_workers import (
    config,
    equal_lists,
    full_params,
    local_rows,
    model,
    optimizer,
    resume_worker,
    tensors,
    train,
    tree_digest,
)
from dist_utils import one_thread, run_world
from engine_helpers import CFG, batches
from reference import RefGPT, state_dict_to_tree
from safetensors.torch import load_file

import checkpoints
import zinf_fn as zf
from layers import gpt
from zinf_fn.state import view

FP32 = dict(param_dtype=torch.float32)


def trained(placement="none", steps=2, **kw):
    state = zf.init(model(), optimizer(), config(placement, **kw))
    return train(state, batches(steps))[0]


def assert_rows_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"rows differ: {bad}"


@pytest.mark.parametrize("src,dst", [("none", "cpu"), ("cpu", "none")])
def test_round_trip_is_bitwise_across_placements(tmp_path, src, dst):
    state = trained(src)
    path = checkpoints.save(tmp_path / "ck", state)
    back = checkpoints.restore(path, model(), optimizer(), config(dst))
    assert back.step == state.step == 2
    assert_rows_equal(local_rows(back), local_rows(state))
    manifest = checkpoints.read_manifest(path)
    assert manifest["step"] == 2 and manifest["world_size"] == 1
    assert manifest["optimizer_state"] == ["adam_m", "adam_v"]
    names = {e["name"] for e in manifest["arrays"]}
    assert {
        "blocks/param",
        "blocks/master",
        "blocks/adam_m",
        "blocks/adam_v",
        "embed/master",
    } <= names


def test_resume_in_a_fresh_process_is_bitwise(tmp_path):
    """10 steps straight == 5 steps, save, restore in a new process, 5 more: losses, params, Adam
    state."""
    cfg = config("cpu", **FP32)
    data = batches(10)
    with one_thread():  # as run_world's process
        straight, straight_losses = train(zf.init(model(), optimizer(), cfg), data)
        half, half_losses = train(zf.init(model(), optimizer(), cfg), data[:5])
    checkpoints.save(tmp_path / "step_5", half)
    [(rest_losses, rows)] = tensors(run_world(1, resume_worker, str(tmp_path / "step_5"), 5, 10))
    assert half_losses + rest_losses == straight_losses
    assert_rows_equal(rows, local_rows(straight))


def nvme_config(tmp_path, placement: str, name: str = "nvme", **kw):
    """config(placement), with a fresh NVMe directory when the placement is "nvme"."""
    if placement != "nvme":
        return config(placement, **kw)
    (tmp_path / name).mkdir()
    return config(placement, nvme_path=str(tmp_path / name), **kw)


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
@pytest.mark.parametrize("staging_bytes", [1, 1 << 30])
def test_save_async_is_not_torn_by_the_steps_that_follow(tmp_path, staging_bytes, placement):
    """Steps run right after save_async; the checkpoint still holds the state at the call, and the
    steps themselves are the same training as without a save. ``staging_bytes=1``: one row at a
    time, so the steps must wait on the write guard or copy rows out first. On NVMe the rows are
    read, not viewed."""
    data = batches(6)
    plain, plain_losses = train(zf.init(model(), optimizer(), config("cpu")), data)
    state, losses = train(zf.init(model(), optimizer(), nvme_config(tmp_path, placement)), data[:3])
    at_save = local_rows(state)
    handle = checkpoints.save_async(tmp_path / "ck", state, staging_bytes=staging_bytes)
    state, more = train(state, data[3:])
    assert handle.result() == str(tmp_path / "ck")
    assert losses + more == plain_losses
    assert_rows_equal(local_rows(state), local_rows(plain))
    back = checkpoints.restore(
        tmp_path / "ck", model(), optimizer(), nvme_config(tmp_path, placement, "nvme2")
    )
    assert back.step == 3
    assert_rows_equal(local_rows(back), at_save)
    assert handle.stats["bytes"] > 0 and handle.stats["call_s"] >= 0


def test_write_guard_copies_each_row_out_before_a_step_changes_it():
    """The copy-on-write half of save_async, deterministically: no copier runs, so the step's
    updater must take every row through the guard, and each snapshot holds the row as it was before
    the step."""
    from queue import Queue

    from checkpoints.rows import held_rows
    from checkpoints.snapshot import RowSnapshotter, StagingPool

    state = trained("cpu")
    store, before = view(state), local_rows(state)
    order = [(r.group, r.row) for r in held_rows(store)]
    queue = Queue()
    snapshotter = RowSnapshotter(
        store, {g: store.kinds(group=g) for g in store.groups}, order, StagingPool(1 << 30), queue
    )
    with store.save_guard(snapshotter.guard):
        state, _ = train(state, batches(1))
    assert snapshotter.guard_copies == len(order) == queue.qsize() == 5
    while not queue.empty():
        snap = queue.get()
        for kind, tensor in snap.tensors.items():
            assert torch.equal(tensor, before[f"{snap.group}/{kind}/{snap.row}"]), (
                snap.group,
                snap.row,
                kind,
            )
    assert not torch.equal(local_rows(state)["head/master/0"], before["head/master/0"])


@pytest.mark.parametrize("use_async", [False, True])
def test_nvme_states_stream_within_the_staging_budget(tmp_path, use_async):
    """States on NVMe have no memory views: save and save_async stream them row by row through the
    staging pool, which never holds more than its budget (here: one row at a time)."""
    state = train(zf.init(model(), optimizer(), nvme_config(tmp_path, "nvme")), batches(2))[0]
    biggest_row = max(g.part.shard_numel * (2 + 4 * 3) for g in view(state).groups.values())
    stats = {}
    if use_async:
        handle = checkpoints.save_async(tmp_path / "ck", state, staging_bytes=1)
        handle.result()
        stats = handle.stats
    else:
        checkpoints.save(tmp_path / "ck", state, staging_bytes=1, stats=stats)
    assert 0 < stats["peak_staging_bytes"] <= biggest_row
    back = checkpoints.restore(tmp_path / "ck", model(), optimizer(), config("none"))
    assert_rows_equal(local_rows(back), local_rows(state))


def test_plain_tensorstore_reads_the_same_values_as_the_exported_safetensors(tmp_path):
    state = trained("cpu")
    path = checkpoints.save(tmp_path / "ck", state)
    checkpoints.export(path, str(tmp_path / "w32.safetensors"))
    checkpoints.export(path, str(tmp_path / "w16.safetensors"), dtype="bf16")
    w32, w16 = load_file(tmp_path / "w32.safetensors"), load_file(tmp_path / "w16.safetensors")
    # No project code from here: the manifest is JSON, the arrays plain zarr v3.
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    seen = 0
    for gname, group in manifest["groups"].items():
        for kind, exported in (("master", w32), ("param", w16)):
            spec = {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": f"{path}/{gname}/{kind}"},
            }
            array = ts.open(spec).result()
            values = array.read().result()  # (rows, numel)
            for row in range(group["rows"]):
                prefix = f"blocks.{row}" if gname == "blocks" else gname
                for leaf in group["leaves"]:
                    flat = values[row, leaf["offset"] : leaf["offset"] + leaf["numel"]]
                    want = exported[f"{prefix}.{leaf['path']}"]
                    got = torch.from_numpy(flat.view("int16") if kind == "param" else flat.copy())
                    got = got.view(torch.bfloat16) if kind == "param" else got
                    assert torch.equal(got.reshape(want.shape), want), (prefix, leaf["path"], kind)
                    seen += 1
    assert seen == 2 * len(w32) == 2 * (3 * 12 + 2 + 3)
    assert equal_lists([w32[k] for k in sorted(w32)], sorted_leaves(zf.gather_params(state)))


def sorted_leaves(full: dict) -> list[torch.Tensor]:
    """gather_params leaves in the sorted order of their exported names."""
    named = {**_names(full["embed"], "embed"), **_names(full["head"], "head")}
    for i, layer in enumerate(full["blocks"]):
        named.update(_names(layer, f"blocks.{i}"))
    return [named[k] for k in sorted(named)]


def _names(tree, prefix):
    """Dotted key path -> leaf of a nested dict / list tree."""
    if not isinstance(tree, (dict, list)):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    return {name: leaf for k, v in items for name, leaf in _names(v, f"{prefix}.{k}").items()}


def test_import_from_safetensors_and_state_dict(tmp_path):
    """A state built from exported weights or from an nn.Module state_dict equals the exported
    state, and (at step 0, fresh optimizer state) trains exactly like zf.init's."""
    cfg = config("cpu", **FP32)
    init = zf.init(model(), optimizer(), cfg)
    checkpoints.save(tmp_path / "step_0", init)
    checkpoints.export(str(tmp_path / "step_0"), str(tmp_path / "w.safetensors"))
    from_file = checkpoints.from_safetensors(
        str(tmp_path / "w.safetensors"), model(), optimizer(), cfg
    )
    assert_rows_equal(local_rows(from_file), local_rows(init))

    ref = RefGPT(CFG)
    sd = ref.state_dict()
    ours = _names(
        state_dict_to_tree({n: n for n in sd}, CFG.n_layers), ""
    )  # ".blocks.0.attn.qkv.w" -> nn name
    rename = {nn_name: ours_name[1:] for ours_name, nn_name in ours.items()}
    from_sd = checkpoints.from_state_dict(sd, model(), optimizer(), cfg, rename=rename.__getitem__)
    for path, value in zip(
        sorted(rename.values()), sorted_leaves(zf.gather_params(from_sd)), strict=True
    ):
        assert torch.equal(value, sd[{v: k for k, v in rename.items()}[path]]), path

    data = batches(3)
    _, a = train(init, data)
    _, b = train(from_file, data)
    assert a == b


def test_tiled_model_round_trip_export_and_import(tmp_path):
    """Tiled weights are groups of their own (one row per tile): they save and restore bitwise like
    any row, export whole under their untiled key path (so a tiled model's export equals the untiled
    model's, which has the same values at the same seed), and import from an untiled export."""
    tiled_cfg = gpt.Config(**{**CFG.__dict__, "attn_tiles": 2, "mlp_tiles": 3, "head_tiles": 4})
    cfg = config("cpu", **FP32)
    tiled = zf.init(gpt.model(tiled_cfg), optimizer(), cfg)
    plain = zf.init(model(), optimizer(), cfg)
    for name, state in (("tiled", tiled), ("plain", plain)):
        checkpoints.save(tmp_path / name, state)
        checkpoints.export(str(tmp_path / name), str(tmp_path / f"{name}.safetensors"))
    a, b = load_file(tmp_path / "tiled.safetensors"), load_file(tmp_path / "plain.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "blocks:mlp.fc.w" in checkpoints.read_manifest(tmp_path / "tiled")["tiles"]

    imported = checkpoints.from_safetensors(
        str(tmp_path / "plain.safetensors"), gpt.model(tiled_cfg), optimizer(), cfg
    )
    assert_rows_equal(local_rows(imported), local_rows(tiled))
    tiled, losses = train(tiled, batches(2))
    path = checkpoints.save(tmp_path / "tiled_step_2", tiled)
    back = checkpoints.restore(path, gpt.model(tiled_cfg), optimizer(), config("none", **FP32))
    assert_rows_equal(local_rows(back), local_rows(tiled))
    with pytest.raises(
        ValueError, match="blocks:mlp.fc.w: present in the checkpoint, absent in the model"
    ):
        checkpoints.restore(path, model(), optimizer(), cfg)


def test_import_names_every_problem(tmp_path):
    sd = {
        "embed.tok.w": torch.zeros(CFG.vocab_size, CFG.d_model),
        "blocks.0.attn.qkv.w": torch.zeros(3, 3),
        "extra.weight": torch.zeros(1),
    }
    with pytest.raises(ValueError) as err:
        checkpoints.from_state_dict(sd, model(), optimizer(), config())
    msg = str(err.value)
    assert "embed.pos.w: missing" in msg and "extra.weight: not a parameter" in msg
    assert "blocks.0.attn.qkv.w: shape (3, 3)" in msg and "head.lm_head.w: missing" in msg


def test_restore_into_another_structure_lists_the_key_paths(tmp_path):
    path = checkpoints.save(tmp_path / "ck", trained())
    wider = gpt.Config(vocab_size=64, d_model=48, n_heads=2, n_layers=3, seq_len=16)
    with pytest.raises(ValueError) as err:
        checkpoints.restore(path, gpt.model(wider), optimizer(), config())
    msg = str(err.value)
    for p in (
        "blocks.*.attn.qkv.w: shape (96, 32) in the checkpoint, (144, 48)",
        "embed.tok.w",
        "head.lm_head.w",
        "blocks.*.mlp.fc.b",
    ):
        assert p in msg, msg
    deeper = gpt.Config(vocab_size=64, d_model=32, n_heads=2, n_layers=4, seq_len=16)
    with pytest.raises(ValueError, match="blocks: the checkpoint has 3 layers, the model 4"):
        checkpoints.restore(path, gpt.model(deeper), optimizer(), config())
    with pytest.raises(ValueError, match="optimizer state"):
        checkpoints.restore(path, model(), zf.sgd(lr=0.1), config())


def corrupt_missing_array(path):
    shutil.rmtree(os.path.join(path, "blocks", "adam_v"))


def corrupt_manifest(path):
    with open(os.path.join(path, "manifest.json"), "r+") as f:
        f.truncate(100)


def corrupt_missing_chunk(path):
    os.remove(os.path.join(path, "blocks", "master", "c", "1", "0"))


def corrupt_truncated_chunk(path):
    chunk = os.path.join(path, "head", "adam_m", "c", "0", "0")
    with open(chunk, "r+b") as f:
        f.truncate(os.path.getsize(chunk) // 2)


def corrupt_flipped_byte(path):
    chunk = os.path.join(path, "blocks", "param", "c", "2", "0")
    with open(chunk, "r+b") as f:
        f.seek(17)
        byte = f.read(1)
        f.seek(17)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize(
    "corrupt,message,checksums",
    [
        (corrupt_missing_array, "array 'blocks/adam_v' listed in the manifest is missing", False),
        (corrupt_manifest, "manifest.json is not valid JSON", False),
        (corrupt_missing_chunk, "truncated: array 'blocks/master' is missing 1 chunk file", False),
        (
            corrupt_truncated_chunk,
            "bad/head/adam_m', row 0, is corrupt",
            False,
        ),  # wrong size: no crc needed
        (
            corrupt_flipped_byte,
            "bad/blocks/param', row 2, is corrupt",
            True,
        ),  # a flipped bit needs the crc32c
    ],
)
def test_a_damaged_checkpoint_raises_and_changes_nothing(tmp_path, corrupt, message, checksums):
    good = checkpoints.save(tmp_path / "good", trained(), checksums=checksums)
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    corrupt(bad)
    before = tree_digest(tmp_path)
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.restore(bad, model(), optimizer(), config())
    assert message in str(err.value), str(err.value)
    assert tree_digest(tmp_path) == before


def test_newer_format_version_is_refused_with_its_version(tmp_path):
    path = checkpoints.save(tmp_path / "ck", trained())
    manifest_file = os.path.join(path, "manifest.json")
    with open(manifest_file) as f:
        manifest = json.load(f)
    manifest["format_version"] = checkpoints.FORMAT_VERSION + 98
    with open(manifest_file, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(
        checkpoints.CheckpointError, match=f"format_version {checkpoints.FORMAT_VERSION + 98}"
    ):
        checkpoints.restore(path, model(), optimizer(), config())


def test_overwrite_is_refused_unless_asked(tmp_path):
    state = trained(steps=1)
    path = checkpoints.save(tmp_path / "ck", state)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        checkpoints.save(path, state)
    (tmp_path / "junk").mkdir()
    with pytest.raises(FileExistsError, match="not a complete checkpoint"):
        checkpoints.save(tmp_path / "junk", state)
    state, _ = train(state, batches(2)[1:])
    checkpoints.save(path, state, overwrite=True)
    assert checkpoints.read_manifest(path)["step"] == 2
    assert_rows_equal(
        local_rows(checkpoints.restore(path, model(), optimizer(), config())), local_rows(state)
    )
    assert sorted(os.listdir(tmp_path)) == ["ck", "junk"]


def test_latest_and_keep_retention(tmp_path):
    state = zf.init(model(), optimizer(), config())
    assert checkpoints.latest(tmp_path) is None
    for step, batch in enumerate(batches(4), start=1):
        state, _ = train(state, [batch])
        checkpoints.save(tmp_path / f"step_{step}", state, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_3", "step_4"]
    (tmp_path / ".step_5.tmp-deadbeef" / "blocks").mkdir(parents=True)  # a killed save: ignored
    (tmp_path / "notes").mkdir()  # not a checkpoint: ignored, kept
    assert checkpoints.latest(tmp_path) == str(tmp_path / "step_4")
    checkpoints.save(tmp_path / "step_5", state, keep=1)
    assert sorted(os.listdir(tmp_path)) == [
        "notes",
        "step_5",
    ]  # the stale temp of step_5 is gone too
    with pytest.raises(ValueError, match="keep must be >= 1"):
        checkpoints.save(tmp_path / "step_6", state, keep=0)


def test_saving_a_consumed_state_is_an_error(tmp_path):
    state = zf.init(model(), optimizer(), config())
    train(state, batches(1))
    with pytest.raises(ValueError, match="consumed by zf.train_step"):
        checkpoints.save(tmp_path / "ck", state)


def test_param_dtype_may_change_on_restore(tmp_path):
    """A bf16 run restored with fp32 params: the 16-bit copy is recast from the fp32 master."""
    state = trained()
    path = checkpoints.save(tmp_path / "ck", state)
    back = checkpoints.restore(path, model(), optimizer(), config(**FP32))
    assert equal_lists(full_params(back, "param"), full_params(state, "master"))
    assert equal_lists(full_params(back), full_params(state))


def test_export_cli(tmp_path):
    import subprocess
    import sys

    path = checkpoints.save(tmp_path / "ck", trained())
    out = tmp_path / "w.safetensors"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run(
        [sys.executable, "-m", "checkpoints.export", path, str(out), "--dtype", "bf16"],
        check=True,
        cwd=root,
        capture_output=True,
    )
    weights = load_file(out)
    assert weights["blocks.2.mlp.fc.w"].dtype == torch.bfloat16
    assert torch.equal(
        weights["head.lm_head.w"],
        zf.gather_params(trained(), "param")["head"]["lm_head"]["w"].to(torch.bfloat16),
    )
