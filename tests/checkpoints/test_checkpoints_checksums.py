"""Checksums are on by default: one byte flipped anywhere in a default save is a CheckpointError
naming the array, for every array a save writes (bf16 params, fp32 masters, int8 moment codes and
their scales, remainders, bf16 moments, NF4 codes of a frozen base); ``checksums=False`` stays
available (the v1 fixture, without checksums, restores: test_checkpoints_formats).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from ckpt_workers import TILED, config, int8_opt, local_rows, model, optimizer, train
from engine_helpers import batches

import checkpoints
import zinf_fn as zf


def _lora_nf4():
    from layers import llama, lora

    cfg = llama.Config(
        vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=2, seq_len=16
    )
    lm = lora.apply(llama.model(cfg), rank=4, alpha=8, targets=("attn.q", "attn.v"))
    return lm, zf.adamw(lr=3e-3), zf.Config(offload_params="cpu", frozen_storage="nf4")


# (model, optimizer, config, steps trained before the save) of each kind of state
RUNS = {
    "fp32": lambda: (model(), optimizer(), config("cpu"), 2),
    "int8-remainder": lambda: (model(TILED), int8_opt(), config("cpu", master="remainder"), 2),
    "bf16-moments": lambda: (model(), zf.adamw(lr=3e-3, moments="bf16"), config("cpu"), 2),
    "nf4-base": lambda: (*_lora_nf4(), 0),
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def default_save(request, tmp_path_factory):
    """(restore of a path, the good checkpoint, its rows) of a save given no ``checksums``."""
    lm, opt, cfg, steps = RUNS[request.param]()
    state = zf.init(lm, opt, cfg, seed=0)
    if steps:
        state = train(state, batches(steps))[0]
    path = checkpoints.save(tmp_path_factory.mktemp("crc") / "good", state)
    rows = local_rows(state)
    zf.close(state)

    def restore(p):
        return checkpoints.restore(p, *RUNS[request.param]()[:3])

    return restore, path, rows


def _flip(file: str, at: int) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def test_a_flipped_byte_in_any_array_is_refused_naming_it(default_save, tmp_path):
    restore, good, rows = default_save
    manifest = checkpoints.read_manifest(good)
    assert manifest["checksums"] is True
    case = str(tmp_path / "case")
    shutil.copytree(good, case)
    back = local_rows(restore(case))
    assert all(torch.equal(back[k], rows[k]) for k in rows)
    arrays = [e for e in manifest["arrays"] if e["shape"][0] and e["shape"][1]]
    kinds = {e["kind"].split(".")[-1] for e in arrays}
    assert {"param", "0", "1"} <= kinds, kinds  # params and both moments at least
    for entry in arrays:
        last_row = entry["shape"][0] - 1
        chunk = os.path.join(case, entry["name"], "c", str(last_row), "0")
        size = os.path.getsize(chunk)
        for at in (size // 3, size - 1):  # a byte of the data, a byte of the stored crc32c
            original = open(chunk, "rb").read()
            _flip(chunk, at)
            with pytest.raises(checkpoints.CheckpointError) as err:
                restore(case)
            message = str(err.value)
            assert (
                f"{entry['name']}', row {last_row}, is corrupt" in message and "crc32c" in message
            ), message
            with open(chunk, "wb") as f:
                f.write(original)


def test_checksums_false_writes_raw_chunks_and_both_restore(tmp_path):
    state = train(zf.init(model(), optimizer(), config("cpu")), batches(1))[0]
    raw = checkpoints.save(tmp_path / "raw", state, checksums=False)
    crc = checkpoints.save(tmp_path / "crc", state)
    rows = local_rows(state)
    for path, extra in ((raw, 0), (crc, 4)):
        entry = checkpoints.read_manifest(path)["arrays"][0]
        chunk = os.path.join(path, entry["name"], "c", "0", "0")
        itemsize = torch.empty(0, dtype=getattr(torch, entry["dtype"])).element_size()
        assert os.path.getsize(chunk) == entry["chunk_cols"] * itemsize + extra
        back = local_rows(checkpoints.restore(path, model(), optimizer(), config("cpu")))
        assert all(torch.equal(back[k], rows[k]) for k in rows)
