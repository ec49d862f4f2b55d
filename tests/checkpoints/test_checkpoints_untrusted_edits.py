"""Checkpoints are untrusted input, edited field by field: every edit of every field of a
checkpoint's JSON (the manifest, each array's zarr.json, a quantized base's manifest) and of an
exported safetensors header either makes the read raise ``CheckpointError`` or gives bitwise the
saved states, and never reads a byte from outside the checkpoint directory (the sentinel copy of
sentinel_checkpoints.py). Links out, damaged and foreign files: test_checkpoints_untrusted_files.py.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
from ckpt_workers import config, local_rows, model, optimizer
from manifest_edits import DELETE, edited, write_json
from sentinel_checkpoints import outcome, restore_as_saved, save_with_sentinel_copy

import checkpoints
import zinf_fn as zf
from zinf_fn.state import view


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``sentinel_checkpoints.save_with_sentinel_copy``, once for the module."""
    return save_with_sentinel_copy(tmp_path_factory.mktemp("untrusted"))


# -- the edits -------------------------------------------------------------------------------------


def variants(value, outside: str, here: str):
    """Wrong values for a field holding ``value``: other types, out-of-range ints, paths that climb
    out."""
    common = [None, [], {}]
    if isinstance(value, bool):
        return [not value, 0, "true", *common]
    if isinstance(value, int):
        return [-1, 0, value + 1, 2**63, 10**30, str(value), value + 0.5, True, *common]
    if isinstance(value, float):
        return [-1.0, -value, 1e300, "1.0", 0, True, *common]
    if isinstance(value, str):
        climb = os.path.relpath(os.path.join(outside, "blocks", "master"), here)
        return [
            "",
            value + "x",
            climb,
            os.path.join(outside, "blocks", "master"),
            "../" + value,
            "/" + value,
            5,
            True,
            *common,
        ]
    if isinstance(value, list):
        return [value[:-1], value + value[-1:], list(reversed(value)), "list", 0, None, {}]
    if isinstance(value, dict):
        return [{}, {**value, "unexpected": 1}, "dict", 0, None, []]
    return [0, "", "null", [], {}]  # None


def edits(doc, outside: str, here: str, path=()):
    """(key path, edited document) for each variant of each node, and each key removed from each
    object."""
    node = doc
    for k in path:
        node = node[k]
    for new in variants(node, outside, here):
        if json.dumps(new) != json.dumps(
            node
        ):  # an edit, not the value itself (a 1-item list reversed)
            yield path, edited(doc, path, new)
    children = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for k, _ in list(children):
        if isinstance(node, dict):
            yield (*path, k), edited(doc, (*path, k), DELETE)  # removed
        yield from edits(doc, outside, here, (*path, k))


def run_json_edits(
    case: str, file: str, rows: dict, outside: str, restore=restore_as_saved
) -> dict:
    """Restore ``case`` with every edit of its JSON ``file`` (put back after each); outcome per key
    path."""
    with open(file) as f:
        original_text = f.read()
    original = json.loads(original_text)
    results = {}
    try:
        for path, doc in edits(original, outside, os.path.dirname(file)):
            write_json(file, doc)
            results.setdefault(path, []).append(outcome(case, rows, restore))
    finally:
        with open(file, "w") as f:
            f.write(original_text)
    return results


# -- the manifest and zarr.json --------------------------------------------------------------------


def test_every_manifest_edit_is_refused_or_harmless(saved, tmp_path):
    root, good, _, rows, outside = saved
    case = str(tmp_path / "case")
    shutil.copytree(good, case)
    results = run_json_edits(case, os.path.join(case, "manifest.json"), rows, outside)
    assert len(results) > 200
    for path, outs in results.items():  # where restore reads a path, every edit of it is refused
        if path[:1] == ("arrays",) and path[-1:] == ("name",):
            assert all(o.startswith("refused") for o in outs), (path, outs)
    name = [o for o in results[("arrays", 3, "name")] if "arrays[3].name" in o]
    assert name, results[("arrays", 3, "name")]
    cols = " ".join(results[("arrays", 5, "chunk_cols")])  # blocks/master
    assert "arrays[5].chunk_cols: expected a positive int dividing 12704" in cols, cols
    version = " ".join(results[("format_version",)])
    newest = checkpoints.FORMAT_VERSION
    assert f"format_version {newest + 1}, newer than this library reads ({newest})" in version, (
        version
    )
    formats = {path: " ".join(outs) for path, outs in results.items() if path[:1] == ("formats",)}
    assert all(o.startswith("refused") or o == "same" for outs in results.values() for o in outs)
    assert (
        "field formats.moments: moments='fp32x' is not a known format"
        in formats[("formats", "moments", "kind")]
    )
    assert (
        "MomentsFormat version 2 is not one this reader knows"
        in formats[("formats", "moments", "version")]
    )
    assert "formats.moments.unexpected: expected no such field" in formats[("formats", "moments")]
    assert (
        "field formats.master: unknown state format 'MasterFormatx'"
        in formats[("formats", "master", "format")]
    )
    assert "field formats: expected the formats of the arrays" in formats[("formats",)]
    assert (
        "field formats.moments.version: expected a value (the field is required)"
        in formats[("formats", "moments", "version")]
    )
    # every format field is one of its known values: none is accepted edited (rounding 7, "")
    accepted = {p[:3] for p, outs in results.items() if p[:1] == ("formats",) and "same" in outs}
    assert not accepted, accepted
    rounding = formats[("formats", "moments", "rounding")]
    assert "field formats.moments.rounding: expected 'stochastic-hash32'" in rounding
    harmless = [p for p, outs in results.items() if "same" in outs]
    assert {("created_unix",), ("optimizer", "lr"), ("extra",)} <= set(harmless), harmless


@pytest.mark.parametrize("array", ["embed/param", "blocks/master", "head/adam_v"])
def test_every_zarr_json_edit_is_refused(saved, tmp_path, array):
    """zarr.json must be exactly what a save writes: no field of it may change."""
    _, good, _, rows, outside = saved
    case = str(tmp_path / "case")
    shutil.copytree(good, case)
    results = run_json_edits(case, os.path.join(case, array, "zarr.json"), rows, outside)
    accepted = {p: o for p, o in results.items() if any(not x.startswith("refused") for x in o)}
    assert not accepted, accepted
    assert any("zarr.json field" in o for outs in results.values() for o in outs)


def test_a_quantized_base_checkpoint_refuses_every_harmful_edit(tmp_path):
    """A LoRA checkpoint whose frozen base is stored NF4 (``Config.frozen_storage``: a uint8 row of
    codes and scales): every edit of its manifest is refused or restores the same rows (the codes
    bitwise), an edit of the recorded storage is refused by name, and a flipped bit of the codes in
    a checksummed save is refused."""
    from layers import llama, lora

    cfg = llama.Config(
        vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=2, seq_len=16
    )
    lm = lora.apply(llama.model(cfg), rank=4, alpha=8, targets=("attn.q", "attn.v"))
    nf4 = zf.Config(offload_params="cpu", frozen_storage="nf4")
    state = zf.init(lm, zf.adamw(lr=3e-3), nf4, seed=0)
    good = checkpoints.save(tmp_path / "good", state, checksums=True)
    rows = local_rows(state)
    assert view(state).dtype("param", "blocks:frozen") == torch.uint8
    zf.close(state)

    def restore(path):
        return checkpoints.restore(path, lm, zf.adamw(lr=3e-3), nf4)

    case = str(tmp_path / "case")
    shutil.copytree(good, case)
    results = run_json_edits(
        case, os.path.join(case, "manifest.json"), rows, str(tmp_path / "outside"), restore
    )
    assert all(o.startswith("refused") or o == "same" for outs in results.values() for o in outs)
    storage = " ".join(results[("config", "frozen_storage")])
    # another storage the engine knows: refused against this state; one it does not: by the schema
    assert "config.frozen_storage: the checkpoint stores its frozen weights as 'bf16'" in storage, (
        storage
    )
    assert "config.frozen_storage: expected a value zf.Config takes" in storage, storage
    assert "refused" in storage and "same" not in storage
    (chunk,) = glob.glob(
        os.path.join(case, "blocks*frozen", "param", "c", "1", "0")
    )  # the frozen group's array
    with open(chunk, "r+b") as f:  # the same size, another code: only the crc32c tells
        data = bytearray(f.read())
        data[7] ^= 0x01
        f.seek(0)
        f.write(data)
    assert outcome(case, rows, restore).startswith("refused")


# -- a safetensors header --------------------------------------------------------------------------


def header_of(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), f.read()


def write_safetensors(path: str, header: dict, data: bytes, claimed: int | None = None) -> None:
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write((len(blob) if claimed is None else claimed).to_bytes(8, "little") + blob + data)


def test_safetensors_headers_are_checked_against_the_file(saved, tmp_path):
    _, good, _, _, outside = saved
    src = str(tmp_path / "w.safetensors")
    checkpoints.export(good, src)
    want = zf.gather_params(checkpoints.from_safetensors(src, model(), optimizer(), config()))
    header, data = header_of(src)
    case = str(tmp_path / "case.safetensors")
    results = {}
    for path, doc in edits(header, outside, str(tmp_path)):
        if not isinstance(doc, dict):
            continue
        write_safetensors(case, doc, data)
        try:
            got = zf.gather_params(
                checkpoints.from_safetensors(case, model(), optimizer(), config())
            )
        except checkpoints.CheckpointError as e:
            results.setdefault(path, []).append(f"refused: {e}")
            continue
        same = all(torch.equal(a, b) for a, b in zip(_leaves(got), _leaves(want), strict=True))
        assert same, f"{path}: another header gave other weights"
        results.setdefault(path, []).append("same")
    assert len(results) > 30
    for claimed in (2**63, len(json.dumps(header)) + len(data) + 1):
        write_safetensors(case, header, data, claimed=claimed)
        with pytest.raises(checkpoints.CheckpointError, match="header claims"):
            checkpoints.from_safetensors(case, model(), optimizer(), config())
    write_safetensors(case, header, data[: len(data) // 2])
    with pytest.raises(checkpoints.CheckpointError, match="data section"):
        checkpoints.from_safetensors(case, model(), optimizer(), config())


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree)
