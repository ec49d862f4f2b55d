"""Checkpoints of int8 moments (``zf.adamw(moments="int8")``): stored as they are, restored bitwise,
converted by the engine's own codec, refused when edited.

The model is the test GPT with tiled MLP and head weights; every group keeps int8 moments but the
embedding, which the predicate keeps fp32 (``ckpt_workers.not_embed``). Storage moves and resumes
are compared bitwise (a checkpoint holds the rows' bits). A conversion is one deterministic function
of the saved rows, so it is compared bitwise too, against the plain-torch references of
tests/optim/test_compressed_update.py (which the engine's kernels equal bitwise): int8 -> fp32 is
the dequantization, fp32 -> int8 the quantization (also ``compressed.quantize``, the engine's
encode), bf16 the stochastic rounding keyed as the engine keys it.
"""

from __future__ import annotations

import os
import shutil
import struct

import crc32c
import numpy as np
import pytest
import torch
from ckpt_workers import (
    TILED,
    assert_rows_equal,
    config,
    int8_opt,
    int8_worker,
    local_rows,
    model,
    placed,
    tensors,
    train,
    tree_digest,
    unit_rows,
)
from compressed_reference import ref_dequantize, ref_quantize, ref_stochastic_bf16
from dist_utils import run_world
from engine_helpers import batches
from manifest_edits import edit_manifest
from safetensors.torch import load_file

import checkpoints
import zinf_fn as zf
from layers import gpt2_hf
from zinf_fn.optim import compressed as C
from zinf_fn.optim import formats
from zinf_fn.state import units, view

MAPS = {
    "opt.0": formats.dynamic_map(signed=True),
    "opt.1": formats.dynamic_map(signed=False),
}  # m, v
BLOCK = formats.BLOCK


@pytest.fixture(scope="module", params=["fp32", "remainder"])
def int8_run(request, tmp_path_factory):
    """An int8 run (fp32 or remainder master) on the CPU tier saved at step 2 (in the background, as
    steps 3-4 run); its rows there, its steps 3-4."""
    master = request.param
    data = batches(4)
    state, _ = train(
        zf.init(model(TILED), int8_opt(), config("cpu", master=master), seed=0), data[:2]
    )
    saved, gathered = local_rows(state), unit_rows(state)
    handle = checkpoints.save_async(tmp_path_factory.mktemp("int8") / "step_2", state)
    state, more = train(state, data[2:])  # while the save runs: it must hold the rows of step 2
    path = handle.result()
    return {
        "master": master,
        "path": path,
        "saved": saved,
        "gathered": gathered,
        "more": more,
        "final": local_rows(state),
        "state": state,
    }


@pytest.mark.parametrize("placement", ["none", "cpu", "nvme"])
def test_int8_states_round_trip_and_resume_bitwise(int8_run, tmp_path, placement):
    cfg = placed(tmp_path, placement, master=int8_run["master"])
    back = checkpoints.restore(int8_run["path"], model(TILED), int8_opt(), cfg)
    assert_rows_equal(local_rows(back), int8_run["saved"])
    if (
        placement == "nvme"
    ):  # saved again from the NVMe tier (rows streamed through the staging pool)
        again = checkpoints.restore(
            checkpoints.save(tmp_path / "again", back),
            model(TILED),
            int8_opt(),
            config("cpu", master=int8_run["master"]),
        )
        assert_rows_equal(local_rows(again), int8_run["saved"])
    back, losses = train(back, batches(4)[2:])
    assert losses == int8_run["more"]
    assert_rows_equal(local_rows(back), int8_run["final"])


def test_the_manifest_names_codes_and_scales(int8_run):
    manifest = checkpoints.read_manifest(int8_run["path"])
    assert (
        manifest["formats"]["moments"]["kind"] == "int8"
        and manifest["formats"]["moments"]["block"] == BLOCK
    )
    assert sorted(manifest["formats"]["compressed"]) == sorted(
        g for g in manifest["groups"] if g != "embed"
    )
    arrays = {e["name"]: e for e in manifest["arrays"]}
    numel = manifest["groups"]["blocks"][
        "numel"
    ]  # 12704 (not a multiple of 256): a partial last block
    assert arrays["blocks/adam_m"]["dtype"] == "uint8" and arrays["blocks/adam_m"]["shape"] == [
        3,
        numel,
    ]
    assert arrays["blocks/adam_v.absmax"]["dtype"] == "float32"
    assert arrays["blocks/adam_v.absmax"]["shape"] == [3, -(-numel // BLOCK)]
    assert arrays["blocks--mlp.fc.w/adam_m"]["dtype"] == "uint8"  # a tile group: int8 too
    assert (
        arrays["embed/adam_m"]["dtype"] == "float32" and "embed/adam_m.absmax" not in arrays
    )  # kept fp32


def dequantized(rows: dict, unit: str, leaf: str) -> torch.Tensor:
    """The fp32 values of ``unit``'s gathered int8 rows of ``leaf`` (padding cut), by the
    reference."""
    codes, scales = rows[(unit, leaf)], rows[(unit, leaf + ".absmax")]
    zero = int(ref_quantize(torch.zeros(BLOCK), MAPS[leaf])[0][0])
    padded = torch.cat(
        [codes, torch.full((scales.numel() * BLOCK - codes.numel(),), zero, dtype=torch.uint8)]
    )
    return ref_dequantize(padded, scales, MAPS[leaf])[: codes.numel()]


def quantized(x: torch.Tensor, leaf: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of fp32 ``x`` (a unit's row, padding cut) by the reference, padded with zeros
    to blocks as the engine's row is; checked against the engine's own encode
    (``compressed.quantize``)."""
    padded = torch.cat([x, torch.zeros(-x.numel() % BLOCK)])
    codes, scales = ref_quantize(padded, MAPS[leaf])
    engine = C.quantize(padded, signed=leaf == "opt.0")
    assert torch.equal(engine[0], codes) and torch.equal(engine[1], scales)
    return codes[: x.numel()], scales


def int8_units(rows: dict) -> set[str]:
    return {unit for unit, kind in rows if kind.endswith(".absmax")}


def expected_fp32(rows: dict) -> dict:
    """``rows`` (int8 ``unit_rows``) as an fp32-moments state holds them: the int8 leaves
    dequantized."""
    out = {k: v for k, v in rows.items() if not k[1].endswith(".absmax")}
    for unit in int8_units(rows):
        for leaf in MAPS:
            out[(unit, leaf)] = dequantized(rows, unit, leaf)
    return out


def expected_int8(rows: dict, int8: set[str]) -> dict:
    """``rows`` (fp32 or bf16 ``unit_rows``) as an int8 state holds them: the leaves of the units
    ``int8`` quantized (codes and scales)."""
    out = dict(rows)
    for unit in int8:
        for leaf in MAPS:
            out[(unit, leaf)], out[(unit, leaf + ".absmax")] = quantized(rows[(unit, leaf)], leaf)
    return out


def test_int8_and_fp32_moments_convert_as_the_engine_codes_them(int8_run, tmp_path):
    """int8 -> fp32: the saved codes dequantized (the masters as saved); fp32 -> int8 of that state:
    the reference's (and the engine's) quantization of those values. (Not always the saved codes
    again: m's map has no -1, so a block whose largest magnitude is negative comes back with a scale
    0.993 times as large.)"""
    cfg = config("cpu", master=int8_run["master"])
    fp32 = checkpoints.restore(int8_run["path"], model(TILED), int8_opt("fp32"), cfg)
    got = unit_rows(fp32)
    assert_rows_equal(got, expected_fp32(int8_run["gathered"]))
    back = checkpoints.restore(
        checkpoints.save(tmp_path / "fp32", fp32), model(TILED), int8_opt(), cfg
    )
    assert_rows_equal(unit_rows(back), expected_int8(got, int8_units(int8_run["gathered"])))
    _, losses = train(back, batches(3)[2:])
    assert losses == int8_run["more"][:1]


def test_int8_and_bf16_moments_convert_as_the_engine_writes_them(int8_run, tmp_path):
    """int8 -> bf16: the dequantized values rounded as the engine's write at the update that
    produced them (keyed by unit index, saved step - 1 and element index); bf16 -> int8: their
    upcast quantized."""
    cfg = config("cpu", master=int8_run["master"])
    bf16 = checkpoints.restore(int8_run["path"], model(TILED), int8_opt("bf16"), cfg)
    v, got = view(bf16), unit_rows(bf16)
    index = {r.unit.name: r.unit.index for r in v.all_rows()}
    want = expected_fp32(int8_run["gathered"])
    for unit in int8_units(int8_run["gathered"]):
        for leaf in MAPS:
            rounded = ref_stochastic_bf16(
                want[(unit, leaf)], 0, index[unit], bf16.step - 1, leaf == "opt.1"
            )
            want[(unit, leaf)] = rounded.float()
    assert_rows_equal(got, want)
    back = checkpoints.restore(
        checkpoints.save(tmp_path / "bf16", bf16), model(TILED), int8_opt(), cfg
    )
    assert_rows_equal(unit_rows(back), expected_int8(got, int8_units(int8_run["gathered"])))


def test_world_2_int8_states_round_trip_at_world_2_and_1(tmp_path):
    """World 2 saves a remainder + int8 state of the tiled GPT (shards of whole blocks: 2304 of the
    blocks' 4512 elements) and trains on; restored at world 2 it trains the same steps bitwise;
    restored at world 1 every gathered row is the saved one; restored with fp32 moments, at world 2
    (rank 1's fp32 shard starts at element 2256, inside a block) and at world 1, the moments are the
    saved codes dequantized; restored in "broadcast" mode (each rank whole rows) and saved from
    there, at world 1 it is the saved state again."""
    path = str(tmp_path / "w2")
    out = tensors(run_world(2, int8_worker, path, 2, 2)[0])
    manifest = checkpoints.read_manifest(path)
    assert manifest["world_size"] == 2
    for e in manifest[
        "arrays"
    ]:  # each stored element (a scale: a block) written by exactly one rank
        spans = sorted(
            s for s in (rank[(e["group"], e["kind"])] for rank in out["spans"]) if s[1] > s[0]
        )
        assert [lo for lo, _ in spans] == [0, *(hi for _, hi in spans[:-1])] and spans[-1][1] == e[
            "shape"
        ][1], e
    assert out["resumed_losses"] == out["losses"][2:]
    assert_rows_equal(out["resumed_final"], out["final"])
    back = checkpoints.restore(path, model(TILED), int8_opt(), config("cpu", master="remainder"))
    assert_rows_equal(unit_rows(back), out["saved"])
    _, losses = train(back, batches(4)[2:])
    assert losses == pytest.approx(
        out["losses"][2:], rel=1e-5
    )  # world 1 sums the ranks' gradients otherwise
    want = expected_fp32(out["saved"])
    assert_rows_equal(out["as_fp32"], want)
    fp32 = checkpoints.restore(
        path, model(TILED), int8_opt("fp32"), config("cpu", master="remainder")
    )
    assert_rows_equal(unit_rows(fp32), want)
    assert_rows_equal(
        out["broadcast"], out["saved"]
    )  # restored in "broadcast" mode at world 2 (whole rows)
    again = checkpoints.restore(
        path + "_broadcast", model(TILED), int8_opt(), config("cpu", master="remainder")
    )
    assert_rows_equal(unit_rows(again), out["saved"])  # and saved from there: read at world 1


def test_to_hf_and_export_of_an_int8_state_write_the_exact_master(int8_run, tmp_path):
    state = int8_run["state"]
    v = view(state)
    ours = {
        f"{u.name}.{path}": t
        for u in units(v.n_layers)
        for path, t in v.gather_unit("master", u).items()
    }
    checkpoints.export(checkpoints.save(tmp_path / "ck", state), tmp_path / "out.safetensors")
    exported = load_file(tmp_path / "out.safetensors")
    assert exported.keys() == ours.keys() and all(torch.equal(exported[k], ours[k]) for k in ours)
    checkpoints.to_hf(state, str(tmp_path / "hf"), dtype="fp32")
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    for name, t in hf.items():
        want = ours[gpt2_hf.hf_to_ours(name)]
        assert torch.equal(t, want.T if gpt2_hf.transposed(name) else want), name


# -- untrusted input
# ----------------------------------------------------------------------------------------
def entry_index(path, name: str) -> int:
    return [e["name"] for e in checkpoints.read_manifest(path)["arrays"]].index(name)


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda m: m["formats"]["moments"].update(block=128),
            "formats.moments.block: expected 256 (the one value this version reads), got 128",
        ),
        (
            lambda m: m["formats"]["moments"].update(
                maps=["dynamic-signed-6", "dynamic-unsigned-7"]
            ),
            "formats.moments.maps: expected ['dynamic-signed-7', 'dynamic-unsigned-7'] (the one "
            "value "
            "this version reads), got ['dynamic-signed-6', 'dynamic-unsigned-7']",
        ),
        (
            lambda m: m["formats"]["moments"].update(kind="bf16"),
            "arrays: expected 24 arrays (each group's state kinds as its format stores them), got "
            "34; "
            "'blocks/adam_m.absmax' is not one of them",
        ),
    ],
)
def test_an_edited_int8_manifest_is_refused(int8_run, tmp_path, edit, message):
    assert_refused(int8_run, tmp_path, edit, message)


@pytest.mark.parametrize(
    "name,delta",
    [("blocks/adam_m", BLOCK - 1), ("blocks/adam_v.absmax", -1), ("blocks--mlp.fc.w/adam_v", 1)],
)
def test_codes_or_scales_of_another_length_are_refused(int8_run, tmp_path, name, delta):
    """An array of codes (or of scales) with columns other than the unit's elements (blocks) it
    holds."""
    i = entry_index(int8_run["path"], name)
    cols = checkpoints.read_manifest(int8_run["path"])["arrays"][i]["shape"][1]

    def edit(m):
        m["arrays"][i]["shape"][1] = cols + delta

    assert_refused(
        int8_run, tmp_path, edit, f"arrays[{i}].shape[1]: expected {cols}, got {cols + delta}"
    )


def assert_refused(int8_run, tmp_path, edit, message: str) -> None:
    """A copy of the run's checkpoint, ``edit``ed (its manifest), is refused with ``message``; no
    file changes."""
    case = shutil.copytree(int8_run["path"], tmp_path / "case")
    edit_manifest(case, edit)
    before = tree_digest(case)
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.restore(
            case, model(TILED), int8_opt(), config("cpu", master=int8_run["master"])
        )
    assert message in str(err.value) and "PosixPath" not in str(err.value), str(err.value)
    assert tree_digest(case) == before


def test_a_codes_chunk_of_the_wrong_length_is_refused(int8_run, tmp_path):
    case = shutil.copytree(int8_run["path"], tmp_path / "case")
    chunk = os.path.join(case, "blocks", "adam_m", "c", "1", "0")
    size = os.path.getsize(
        chunk
    )  # a chunk of the writer's shard: 4608 codes, whole blocks of the 4512 elements
    os.truncate(chunk, size - 1)
    with pytest.raises(
        checkpoints.CheckpointError,
        match=rf"adam_m', row 1, is corrupt: chunk file 'c/1/0' has "
        rf"{size - 1} bytes, expected {size}",
    ):
        checkpoints.restore(
            case, model(TILED), int8_opt(), config("cpu", master=int8_run["master"])
        )


@pytest.mark.parametrize(
    "bad,moments",
    [(float("nan"), "int8"), (-1.0, "int8"), (float("inf"), "fp32")],
    ids=["nan-read-as-saved", "negative-read-as-saved", "inf-converted"],
)
def test_a_scale_no_save_writes_is_refused_and_the_checkpoint_kept(
    int8_run, tmp_path, moments, bad
):
    """A NaN, negative or infinite scale, read straight into the state's rows or converted to fp32
    moments, is refused naming the array, row and element; the checkpoint is unchanged and the good
    one still restores."""
    case = shutil.copytree(int8_run["path"], tmp_path / "case")
    chunk = os.path.join(case, "blocks", "adam_v.absmax", "c", "2", "0")
    n_scales = (os.path.getsize(chunk) - 4) // 4  # then the chunk's crc32c
    scales = np.fromfile(chunk, dtype="<f4", count=n_scales)
    scales[7] = bad
    with open(chunk, "wb") as f:  # sealed with its crc32c: the scale is refused for its value
        f.write(scales.tobytes() + struct.pack("<I", crc32c.crc32c(scales.tobytes())))
    before = tree_digest(case)
    cfg = placed(tmp_path, "nvme", master=int8_run["master"])
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.restore(case, model(TILED), int8_opt(moments), cfg)
    assert (
        f"checkpoint array '{case}/blocks/adam_v.absmax', row 2, element 7: expected a finite "
        "scale >= 0 (the "
        f"absmax of a block of 256 elements), got {bad!r}" in str(err.value)
    )
    assert tree_digest(case) == before
    back = checkpoints.restore(
        int8_run["path"], model(TILED), int8_opt(), cfg
    )  # the good one, into the same path
    assert_rows_equal(local_rows(back), int8_run["saved"])
