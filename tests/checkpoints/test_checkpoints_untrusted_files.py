"""Checkpoints are untrusted input, as files: a link out of the checkpoint directory (of an array,
a group, a row, a chunk, a zarr.json or the manifest), a damaged or truncated file, a checksummed
chunk with other bytes makes ``restore`` raise ``CheckpointError``; files a restore never reads
change nothing; ``latest`` and ``keep`` never follow a link out. Edits of the JSON fields:
test_checkpoints_untrusted_edits.py; the sentinel copy the links point at: sentinel_checkpoints.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from ckpt_workers import config, model, optimizer, train, tree_digest
from engine_helpers import batches
from sentinel_checkpoints import outcome, save_with_sentinel_copy

import checkpoints
import zinf_fn as zf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``sentinel_checkpoints.save_with_sentinel_copy``, once for the module."""
    return save_with_sentinel_copy(tmp_path_factory.mktemp("untrusted"))


# -- links out, damaged and foreign files ----------------------------------------------------------


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


# -- latest and retention never follow a link out --------------------------------------------------


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
