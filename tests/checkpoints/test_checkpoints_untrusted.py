"""Checkpoints are untrusted input: every edit of every field, every link out and every damaged file
either makes ``restore`` raise ``CheckpointError`` or restores bitwise the saved states, and never
reads a byte from outside the checkpoint directory.

A sentinel copy of the checkpoint sits beside it with every chunk byte 0x5A; the edits point names,
paths and links at it, so a restore that read outside would hold 0x5A5A words (no saved state does:
the check is made on the reference too). "Bitwise the saved states" is the only success: an edit may
be accepted only where the field does not matter to what is restored (a timestamp, a learning rate).
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
from ckpt_workers import config, local_rows, model, optimizer, train, tree_digest
from engine_helpers import batches
from manifest_edits import DELETE, edited, write_json

import checkpoints
import zinf_fn as zf
from zinf_fn.state import view

SENTINEL_BYTE = 0x5A


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(root, good checkpoint, its rows, the sentinel copy) for a 2-step trained state."""
    root = tmp_path_factory.mktemp("untrusted")
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


def _restore(path: str):
    return checkpoints.restore(path, model(), optimizer(), config())


def outcome(path: str, rows: dict, restore=_restore) -> str:
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


# -- edits of JSON files, field by field
# ------------------------------------------------------------------
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


def run_json_edits(case: str, file: str, rows: dict, outside: str, restore=_restore) -> dict:
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


# -- links out, damaged and foreign files
# -----------------------------------------------------------------
def link_array_dir(case, outside):
    shutil.rmtree(os.path.join(case, "blocks", "master"))
    os.symlink(os.path.join(outside, "blocks", "master"), os.path.join(case, "blocks", "master"))


def link_group_dir(case, outside):
    shutil.rmtree(os.path.join(case, "blocks"))
    os.symlink(os.path.join(outside, "blocks"), os.path.join(case, "blocks"))


def link_chunk_file(case, outside):
    os.remove(os.path.join(case, "blocks", "adam_m", "c", "1", "0"))
    os.symlink(
        os.path.join(outside, "blocks", "adam_m", "c", "1", "0"),
        os.path.join(case, "blocks", "adam_m", "c", "1", "0"),
    )


def link_row_dir(case, outside):
    shutil.rmtree(os.path.join(case, "head", "param", "c", "0"))
    os.symlink(
        os.path.join(outside, "head", "param", "c", "0"),
        os.path.join(case, "head", "param", "c", "0"),
    )


def link_c_dir(case, outside):
    shutil.rmtree(os.path.join(case, "embed", "master", "c"))
    os.symlink(
        os.path.join(outside, "embed", "master", "c"), os.path.join(case, "embed", "master", "c")
    )


def link_zarr_json(case, outside):
    os.remove(os.path.join(case, "head", "master", "zarr.json"))
    os.symlink(
        os.path.join(outside, "head", "master", "zarr.json"),
        os.path.join(case, "head", "master", "zarr.json"),
    )


def link_manifest(case, outside):
    os.remove(os.path.join(case, "manifest.json"))
    os.symlink(os.path.join(outside, "manifest.json"), os.path.join(case, "manifest.json"))


def writer(rel: str, data: bytes | None = None, size: int | None = None):
    def damage(case, outside):
        p = os.path.join(case, rel)
        if size is not None:
            os.truncate(p, size)
        else:
            with open(p, "wb") as f:
                f.write(data)

    damage.__name__ = f"{rel}:{'truncated' if size is not None else len(data)}"
    return damage


def chunk_as_directory(case, outside):
    p = os.path.join(case, "blocks", "param", "c", "2", "0")
    os.remove(p)
    os.mkdir(p)


def junk_beside(case, outside):  # files a restore never reads: ignored
    os.makedirs(os.path.join(case, "blocks", "master", "c", "99"))
    with open(os.path.join(case, "blocks", "master", "c", "99", "0"), "wb") as f:
        f.write(b"junk")
    with open(os.path.join(case, "notes.txt"), "w") as f:
        f.write("hello")


GARBAGE = bytes(range(256)) * 3
REFUSED = [
    link_array_dir,
    link_group_dir,
    link_chunk_file,
    link_row_dir,
    link_c_dir,
    link_zarr_json,
    link_manifest,
    chunk_as_directory,
    writer("manifest.json", size=0),
    writer("manifest.json", size=300),
    writer("manifest.json", GARBAGE),
    writer("manifest.json", b"[" * 100_000),
    writer("manifest.json", b"1" * 5000),
    writer("manifest.json", b'{"format": NaN}'),
    writer("manifest.json", b" " * (17 << 20)),
    writer("blocks/master/zarr.json", size=0),
    writer("blocks/master/zarr.json", size=40),
    writer("blocks/master/zarr.json", GARBAGE),
    writer("embed/param/zarr.json", b"null"),
    writer("blocks/adam_v/c/2/0", size=0),
    writer("blocks/adam_v/c/2/0", size=1000),
    writer("head/param/c/0/0", GARBAGE),
]


@pytest.mark.parametrize("damage", REFUSED, ids=lambda d: d.__name__)
def test_links_out_and_damaged_files_are_refused(saved, tmp_path, damage):
    _, good, _, rows, outside = saved
    case = str(tmp_path / "case")
    shutil.copytree(good, case)
    damage(case, outside)
    assert outcome(case, rows).startswith("refused")


def test_files_a_restore_never_reads_change_nothing(saved, tmp_path):
    _, good, _, rows, outside = saved
    case = str(tmp_path / "case")
    shutil.copytree(good, case)
    junk_beside(case, outside)
    assert outcome(case, rows) == "same"


@pytest.mark.parametrize(
    "damage",
    [writer("blocks/param/c/1/0", GARBAGE), writer("head/adam_m/c/0/0", size=12), link_chunk_file],
    ids=lambda d: d.__name__,
)
def test_checksummed_checkpoint_refuses_edited_chunks(saved, tmp_path, damage):
    _, _, crc, rows, outside = saved
    case = str(tmp_path / "case")
    shutil.copytree(crc, case)
    assert outcome(case, rows) == "same"
    path = os.path.join(case, "blocks", "param", "c", "1", "0")
    with open(path, "r+b") as f:  # the same size, other bytes: only the crc32c tells
        data = bytearray(f.read())
        data[5] ^= 0x01
        f.seek(0)
        f.write(data)
    assert outcome(case, rows).startswith("refused")
    shutil.rmtree(case)
    shutil.copytree(crc, case)
    if damage is link_chunk_file:
        shutil.copytree(crc, outside + "-crc")
        damage(case, outside + "-crc")
    else:
        damage(case, outside)
    assert outcome(case, rows).startswith("refused")


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


# -- latest and retention never follow a link out
# ---------------------------------------------------------
def test_latest_and_keep_never_follow_a_symlink(saved, tmp_path):
    _, good, _, _, _ = saved
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(good, elsewhere / "step_99")
    manifest = json.loads((elsewhere / "step_99" / "manifest.json").read_text())
    manifest["step"] = 99
    (elsewhere / "step_99" / "manifest.json").write_text(json.dumps(manifest))
    before = tree_digest(elsewhere)
    runs = tmp_path / "runs"
    runs.mkdir()
    os.symlink(elsewhere / "step_99", runs / "step_99")  # a link to a newer checkpoint
    os.symlink(elsewhere, runs / ".step_1.tmp-0123456789ab")  # looks like a stale save of step_1
    state = train(zf.init(model(), optimizer(), config()), batches(1))[0]
    checkpoints.save(runs / "step_1", state, keep=1)
    checkpoints.save(runs / "step_2", train(state, batches(2)[1:])[0], keep=1)
    assert checkpoints.latest(runs) == str(runs / "step_2")
    assert sorted(os.listdir(runs)) == [".step_1.tmp-0123456789ab", "step_2", "step_99"]
    assert tree_digest(elsewhere) == before


# -- other inputs read from disk
# --------------------------------------------------------------------------
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
