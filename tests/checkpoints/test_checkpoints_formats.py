"""Checkpoint format version 2: compressed states stored as they are, restores into other formats
that convert, version-1 checkpoints still read, and the exact master exported.

Storage moves are compared bitwise (a checkpoint holds the rows' bits). Conversions are exact (the
join and split of a remainder master, the upcast of bf16 moments) or the engine's own write (the
cast of the 16-bit copy; bf16 moments rounded stochastically with the key of the update that
produced them, checked against the plain-torch reference of tests/optim/test_compressed_update.py):
bitwise too. A remainder run is bitwise its fp32 twin with ties-away copies
(tests/optim/test_remainder_engine.py), so a conversion between the two must give exactly the other
run's state, and train on as it does.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import tensorstore as ts
import torch
from ckpt_workers import (
    assert_rows_equal,
    compressed_worker,
    config,
    local_rows,
    model,
    placed,
    tensors,
    train,
)
from compressed_reference import ref_stochastic_bf16
from dist_utils import run_world
from engine_helpers import batches
from engine_internals import restore_value_check
from manifest_edits import edit_manifest
from safetensors.torch import load_file

import checkpoints
import zinf_fn as zf
from layers import gpt
from zinf_fn.optim.remainder import join, to_bf16_ties_away
from zinf_fn.state import view

REMAINDER, TWIN = {"master": "remainder"}, {"param_rounding": "ties_away"}
V1 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "ckpt_v1")
V1_MODEL = gpt.Config(vocab_size=16, d_model=8, n_heads=2, n_layers=2, seq_len=4)  # wrote ckpt_v1


def opt(moments: str = "fp32", **kw):
    return zf.adamw(lr=3e-3, b1=0.9, b2=0.95, weight_decay=0.1, moments=moments, **kw)


def run(cfg: zf.Config, moments: str, steps: int, data=None):
    return train(zf.init(model(), opt(moments), cfg, seed=0), (data or batches(steps))[:steps])


@pytest.fixture(scope="module")
def compressed_run(tmp_path_factory):
    """A remainder + bf16-moments run on the CPU tier saved at step 2; its rows there, and its steps
    3-4."""
    root = tmp_path_factory.mktemp("compressed")
    data = batches(4)
    state, _ = run(config("cpu", **REMAINDER), "bf16", 2, data)
    saved, path = local_rows(state), checkpoints.save(root / "step_2", state)
    state, more = train(state, data[2:])
    return path, saved, more, local_rows(state)


@pytest.mark.parametrize("placement", ["none", "cpu", "nvme"])
def test_compressed_states_round_trip_and_resume_bitwise(compressed_run, tmp_path, placement):
    path, saved, more, final = compressed_run
    back = checkpoints.restore(path, model(), opt("bf16"), placed(tmp_path, placement, **REMAINDER))
    assert_rows_equal(local_rows(back), saved)
    back, losses = train(back, batches(4)[2:])
    assert losses == more
    assert_rows_equal(local_rows(back), final)


def test_the_manifest_names_the_formats_and_every_array_as_stored(compressed_run):
    manifest = checkpoints.read_manifest(compressed_run[0])
    assert manifest["format_version"] == checkpoints.FORMAT_VERSION == 2
    formats = manifest["formats"]
    assert formats["master"]["kind"] == "remainder" and formats["moments"]["kind"] == "bf16"
    assert formats["compressed"] == ["blocks"] and formats["param_rounding"] == "ties_away"
    dtypes = {e["name"]: e["dtype"] for e in manifest["arrays"]}
    assert dtypes["blocks/remainder"] == "int16" and dtypes["blocks/param"] == "bfloat16"
    assert (
        dtypes["blocks/adam_m"] == dtypes["blocks/adam_v"] == "bfloat16"
    )  # 12704 elements: compressed
    assert (
        dtypes["embed/adam_m"] == "float32" and "blocks/master" not in dtypes
    )  # 2560: fp32; no fp32 master
    described = {e["name"]: e["description"] for e in manifest["arrays"]}
    assert described["blocks/adam_m"] == "Adam first moment m (bf16)"


def test_world_2_states_round_trip_bitwise_at_world_2_and_1(tmp_path):
    """World 2 saves a remainder + bf16 state and trains on; restored at world 2 it trains the same
    steps bitwise, and at world 1 every gathered row (masters joined, moments upcast) is the saved
    one."""
    path = str(tmp_path / "w2")
    out = tensors(run_world(2, compressed_worker, path, 2, 2)[0])
    assert out["resumed_losses"] == out["losses"][2:]
    assert all(torch.equal(a, b) for a, b in zip(out["resumed_final"], out["final"], strict=True))
    back = checkpoints.restore(path, model(), opt("bf16"), config("cpu", **REMAINDER))
    from ckpt_workers import gathered_rows

    got = gathered_rows(back)
    assert all(torch.equal(a, b) for a, b in zip(got, out["saved"], strict=True)) and len(
        got
    ) == len(out["saved"])


def test_remainder_and_fp32_masters_convert_exactly(tmp_path):
    """A remainder checkpoint restored with an fp32 master is bitwise its twin's state (joined), the
    twin's checkpoint restored with a remainder master is bitwise the remainder run's (split); each
    trains on as the other run."""
    data = batches(4)
    runs = {
        name: run(config("cpu", **kw), "bf16", 2, data)[0]
        for name, kw in (("rem", REMAINDER), ("twin", TWIN))
    }
    goes_on = {
        name: train(zf.init(model(), opt("bf16"), config("cpu", **kw), seed=0), data)[1]
        for name, kw in (("rem", REMAINDER), ("twin", TWIN))
    }
    for src, dst, kw in (("rem", "twin", TWIN), ("twin", "rem", REMAINDER)):
        path = checkpoints.save(tmp_path / src, runs[src])
        back = checkpoints.restore(path, model(), opt("bf16"), config("cpu", **kw))
        assert_rows_equal(local_rows(back), local_rows(runs[dst]))
        assert train(back, data[2:])[1] == goes_on[dst][2:]


def test_a_nearest_even_checkpoint_into_a_remainder_master_keeps_the_master_exact(tmp_path):
    state, _ = run(config("cpu"), "fp32", 2)
    back = checkpoints.restore(
        checkpoints.save(tmp_path / "ck", state), model(), opt(), config("cpu", **REMAINDER)
    )
    saved, got = local_rows(state), local_rows(back)
    for name in saved:
        group, kind, row = name.split("/")
        if kind == "master":
            param, remainder = got[f"{group}/param/{row}"], got[f"{group}/remainder/{row}"]
            assert torch.equal(
                join(param, remainder).view(torch.int32), saved[name].view(torch.int32)
            )
            assert torch.equal(
                param.view(torch.int16), to_bf16_ties_away(saved[name]).view(torch.int16)
            )
        elif kind != "param":
            assert torch.equal(got[name], saved[name]), name


def bf16_rounded(state, saved: dict, step: int) -> dict:
    """``saved`` (local rows of an fp32-moments state) with the compressed groups' moments rounded
    as the engine's bf16 write at update ``step - 1`` rounds them: keyed by the unit's index and
    element index."""
    v = view(state)
    out = dict(saved)
    for r in v.rows():
        if v.dtype("opt.0", r.group) == torch.bfloat16:
            lo = v.element_range(r.group)[0]
            for leaf in (0, 1):
                name = f"{r.group}/opt.{leaf}/{r.row}"
                out[name] = ref_stochastic_bf16(
                    saved[name], lo, r.unit.index, (step - 1) & 0xFFFFFFFF, leaf == 1
                )
    return out


def test_bf16_and_fp32_moments_convert_as_the_engine_writes(tmp_path):
    """bf16 -> fp32 moments: their exact upcast. fp32 -> bf16: rounded as the engine's write of the
    update that produced them (stochastic, keyed by unit, step - 1 and element index); every other
    row as saved."""
    bf16, _ = run(config("cpu"), "bf16", 2)
    back = checkpoints.restore(
        checkpoints.save(tmp_path / "bf16", bf16), model(), opt(), config("cpu")
    )
    saved = local_rows(bf16)
    assert_rows_equal(
        local_rows(back), {k: v.float() if "/opt." in k else v for k, v in saved.items()}
    )
    fp32, _ = run(config("cpu"), "fp32", 2)
    back = checkpoints.restore(
        checkpoints.save(tmp_path / "fp32", fp32), model(), opt("bf16"), config("cpu")
    )
    want = bf16_rounded(back, local_rows(fp32), 2)
    assert any(w.dtype == torch.bfloat16 for w in want.values())
    assert_rows_equal(local_rows(back), want)


def plain_arrays(path: str) -> dict:
    """Every array of the checkpoint at ``path``, read by tensorstore's zarr3 driver alone: no
    project code."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    out = {}
    for e in manifest["arrays"]:
        array = ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/{e['name']}"}}
        ).result()
        values = np.ascontiguousarray(array.read().result())
        out[(e["group"], e["kind"])] = torch.from_numpy(
            values.view(np.int16) if e["dtype"] == "bfloat16" else values
        )
    return out


def test_a_version_1_checkpoint_restores_as_saved_and_converts(tmp_path):
    """fixtures/ckpt_v1 (written by the format-1 code) restores bitwise what its arrays hold, and
    into a remainder master with bf16 moments: the master exact, the moments rounded as the engine
    writes them."""
    path = shutil.copytree(V1, tmp_path / "v1")
    assert checkpoints.read_manifest(path)["format_version"] == 1
    arrays = plain_arrays(str(path))
    back = checkpoints.restore(path, gpt.model(V1_MODEL), opt(), config("cpu"))
    rows, v = local_rows(back), view(back)
    for name, got in rows.items():
        group, kind, row = name.split("/")
        numel = v.groups[group].spec.numel
        want = arrays[(group, kind)][int(row)]
        want = want.view(torch.bfloat16) if got.dtype == torch.bfloat16 else want
        assert torch.equal(got[:numel], want) and not got[numel:].any(), name
    everything = opt(
        "bf16", compress=lambda path, numel: True
    )  # its rows are small: compress them all anyway
    back = checkpoints.restore(path, gpt.model(V1_MODEL), everything, config("cpu", **REMAINDER))
    got = local_rows(back)
    for r in view(back).rows():
        master = join(got[f"{r.group}/param/{r.row}"], got[f"{r.group}/remainder/{r.row}"])
        assert torch.equal(
            master.view(torch.int32), rows[f"{r.group}/master/{r.row}"].view(torch.int32)
        )
    want = bf16_rounded(back, rows, back.step)
    assert all(torch.equal(got[k], want[k]) for k in want if "/opt." in k)


def test_to_hf_and_export_of_a_remainder_state_write_the_exact_master(tmp_path):
    """The exported weights of a remainder run are its joined fp32 masters: bitwise the ties-away
    fp32 twin's."""
    rem, _ = run(config("cpu", **REMAINDER), "bf16", 2)
    twin, _ = run(config("cpu", **TWIN), "bf16", 2)
    for name, state in (("rem", rem), ("twin", twin)):
        checkpoints.to_hf(state, str(tmp_path / f"hf_{name}"), dtype="fp32")
        checkpoints.export(
            checkpoints.save(tmp_path / name, state), str(tmp_path / f"{name}.safetensors")
        )
    for a, b in (
        ("hf_rem/model.safetensors", "hf_twin/model.safetensors"),
        ("rem.safetensors", "twin.safetensors"),
    ):
        x, y = load_file(tmp_path / a), load_file(tmp_path / b)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), a
    exported = load_file(tmp_path / "rem.safetensors")
    assert torch.equal(exported["head.lm_head.w"], zf.gather_params(rem)["head"]["lm_head"]["w"])


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda m: m["formats"]["master"].update(kind="fp32"),
            "arrays[1].name: expected 'embed/master', got 'embed/remainder'",
        ),
        (
            lambda m: m["formats"].update(compressed=[]),
            "arrays[6].dtype: expected 'float32', got 'bfloat16'",
        ),
        (
            lambda m: m["formats"]["moments"].update(kind="int4"),
            "formats.moments: moments='int4' is not a known format",
        ),
        (
            lambda m: m["formats"]["moments"].update(version=2),
            "MomentsFormat version 2 is not one this reader knows",
        ),
        (
            lambda m: m["formats"]["master"].update(bits=16),
            "formats.master.bits: expected no such field",
        ),
        (
            lambda m: m["arrays"][5].update(shape=[3, 12703]),
            "arrays[5].shape[1]: expected 12704, got 12703",
        ),
    ],
)
def test_edited_formats_of_a_compressed_checkpoint_are_refused(
    compressed_run, tmp_path, edit, message
):
    case = shutil.copytree(compressed_run[0], tmp_path / "case")
    edit_manifest(case, edit)
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.restore(case, model(), opt("bf16"), config("cpu", **REMAINDER))
    assert message in str(err.value), str(err.value)


def test_a_remainder_chunk_of_the_wrong_length_is_refused(compressed_run, tmp_path):
    case = shutil.copytree(compressed_run[0], tmp_path / "case")
    chunk = os.path.join(case, "blocks", "remainder", "c", "1", "0")
    os.truncate(chunk, os.path.getsize(chunk) - 2)
    with pytest.raises(
        checkpoints.CheckpointError, match="remainder', row 1, is corrupt: chunk file 'c/1/0' has"
    ):
        checkpoints.restore(case, model(), opt("bf16"), config("cpu", **REMAINDER))


def test_frozen_groups_are_saved_once_then_linked(tmp_path):
    """A wholly frozen group (here the embedding) is never written after init: a later save of the
    run links its chunk files to the previous checkpoint's (the same inodes), every save restores
    bitwise the state it saved, deleting the first checkpoints (keep=) leaves the later whole, and a
    restored state links too."""
    frozen = model()._replace(trainable=lambda path: not path.startswith("embed."))
    data, saves = batches(3), {}
    state = zf.init(frozen, opt(), config("cpu"), seed=0)
    for step in (1, 2):
        state, _ = train(state, data[step - 1 : step])
        stats = {}
        checkpoints.save(tmp_path / f"step_{step}", state, stats=stats)
        saves[step] = (local_rows(state), stats)
    embed = [
        e for e in checkpoints.read_manifest(tmp_path / "step_2")["arrays"] if e["group"] == "embed"
    ]
    embed_bytes = sum(e["shape"][1] * {"bfloat16": 2, "float32": 4}[e["dtype"]] for e in embed)
    assert saves[1][1]["linked_bytes"] == 0 and saves[2][1]["linked_bytes"] == embed_bytes
    files = [
        os.path.join(e["name"], "c", "0", str(c))
        for e in embed
        for c in range(-(-e["shape"][1] // e["chunk_cols"]))
    ]
    assert all(os.path.samefile(tmp_path / "step_1" / f, tmp_path / "step_2" / f) for f in files)
    assert not os.path.samefile(
        tmp_path / "step_1/blocks/master/c/0/0", tmp_path / "step_2/blocks/master/c/0/0"
    )
    for step, (rows, _) in saves.items():
        back = checkpoints.restore(tmp_path / f"step_{step}", frozen, opt(), config("cpu"))
        assert_rows_equal(local_rows(back), rows)
    state, _ = train(state, data[2:])
    checkpoints.save(
        tmp_path / "step_3", state, keep=1
    )  # deletes step_1 and step_2, whose files step_3 links
    assert sorted(os.listdir(tmp_path)) == ["step_3"]
    back = checkpoints.restore(tmp_path / "step_3", frozen, opt(), config("cpu"))
    assert_rows_equal(local_rows(back), local_rows(state))
    stats = {}
    checkpoints.save(tmp_path / "again", back, stats=stats)  # the restored state links from step_3
    assert stats["linked_bytes"] == embed_bytes and os.path.samefile(
        tmp_path / "again" / files[0], tmp_path / "step_3" / files[0]
    )


def test_a_restored_scale_no_save_writes_is_a_checkpoint_error():
    """The check every slice of a restore passes (``engine_internals.restore_value_check``, on the
    engine's rule): a NaN, infinite or negative int8 scale names the array, row and element. (A
    restore of int8 rows waits for the engine to store them.)"""
    check = restore_value_check()
    check(
        "opt.0.absmax", torch.tensor([0.0, 2.5]), "ck/blocks/adam_m.absmax", 2, 48
    )  # valid: no error
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(
            checkpoints.CheckpointError,
            match=r"'ck/blocks/adam_m.absmax', row 2, element 49: expected a finite scale >= 0",
        ):
            check("opt.0.absmax", torch.tensor([0.5, bad]), "ck/blocks/adam_m.absmax", 2, 48)
