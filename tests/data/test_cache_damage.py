"""The token cache is untrusted input: every damage of an entry on disk is either rebuilt from the
data to the same tokens (said once on the ``zinf_data`` logger) or refused with a DataError naming
the file.

The entry is built as ``examples/finetune_hf.py`` builds it (chat data, the tiny tokenizer), then
each case damages a copy of it the way a disk, an editor or bad luck would (the 45 kinds of issue
35, and a few more) and opens it again by the same call.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import zinf_data as zd
from zinf_data import cache as cache_module
from zinf_data.tiny import chat_examples, corpus_of, tiny_tokenizer


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(tokenizer, its directory, the data file, a cache holding one good entry, the entry)."""
    root = tmp_path_factory.mktemp("cache")
    tok_dir = str(root / "tok")
    tiny_tokenizer(tok_dir, corpus_of(chat_examples(200)) * 3)
    tok = zd.load_tokenizer(tok_dir, vocab_size=512)
    data = str(root / "chats.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in chat_examples(120, seed=3))
    good = zd.tokenized([data], "chat", tok, tok_dir, str(root / "good"), progress=False)
    return tok, tok_dir, data, str(root / "good"), good


def _open(built, cache: str, **kw) -> zd.Tokenized:
    tok, tok_dir, data, _, _ = built
    return zd.tokenized([data], "chat", tok, tok_dir, cache, progress=False, **kw)


def _same(a: zd.Tokenized, b: zd.Tokenized) -> bool:
    return (
        np.array_equal(a.tokens, b.tokens)
        and np.array_equal(a.mask, b.mask)
        and np.array_equal(a.starts, b.starts)
        and np.array_equal(a.origin, b.origin)
    )


# -- damages: each takes the entry directory -------------------------------------------------------
def _edit_bytes(name: str, edit):
    def damage(entry):
        file = os.path.join(entry, name)
        with open(file, "rb") as f:
            data = bytearray(f.read())
        with open(file, "wb") as f:
            f.write(edit(data))

    damage.__name__ = f"{name}:{edit.__name__}"
    return damage


def flip_first(b):
    b[0] ^= 0x01
    return b


def flip_middle(b):
    b[len(b) // 2] ^= 0x10
    return b


def flip_last(b):
    b[-1] ^= 0x80
    return b


def id_0xffff(b):
    b[10:12] = b"\xff\xff"
    return b


def garbage(b):
    return bytes(np.random.default_rng(0).integers(0, 256, len(b), dtype=np.uint8))


def all_ones(b):
    return b"\x01" * len(b)


def all_zeros(b):
    return b"\x00" * len(b)


def a_byte_2(b):
    b[5] = 2
    return b


def cut_2(b):
    return b[:-2]


def cut_half(b):
    return b[: len(b) // 2]


def emptied(b):
    return b""


def extended(b):
    return b + b"\x00\x00"


def _edit_index(edit):
    def damage(entry):
        file = os.path.join(entry, "index.npy")
        np.save(file, edit(np.load(file)))

    damage.__name__ = f"index.npy:{edit.__name__}"
    return damage


def starts_swapped(x):
    x[[3, 4], 0] = x[[4, 3], 0]
    return x


def start_plus_1(x):
    x[7, 0] += 1
    return x


def example_dropped(x):
    return np.delete(x, 5, axis=0)


def shape_n_2(x):
    return np.ascontiguousarray(x[:, :2])


def start_beyond(x):
    x[-1, 0] = 999_999_999
    return x


def start_negative(x):
    x[2, 0] = -5
    return x


def as_float(x):
    return x.astype(np.float64)


def as_int32(x):
    return x.astype(np.int32)


def transposed(x):
    return np.ascontiguousarray(x.T)


def file_index_out(x):
    x[0, 1] = 3
    return x


def line_negative(x):
    x[1, 2] = -1
    return x


def first_start_not_0(x):
    x[0, 0] = 1
    return x


def index_of_objects(entry):
    np.save(os.path.join(entry, "index.npy"), np.array([{"a": 1}], dtype=object), allow_pickle=True)


index_of_objects.__name__ = "index.npy:an object array"


def _edit_meta(edit):
    def damage(entry):
        file = os.path.join(entry, "meta.json")
        with open(file) as f:
            meta = json.load(f)
        with open(file, "w") as f:
            f.write(edit(meta))

    damage.__name__ = f"meta.json:{edit.__name__}"
    return damage


def _field(name, value):
    def edit(meta):
        return json.dumps({**meta, name: value})

    edit.__name__ = f"{name}={value!r}"
    return edit


def n_tokens_lowered(meta):
    return json.dumps({**meta, "n_tokens": meta["n_tokens"] - 10})


def n_tokens_raised(meta):
    return json.dumps({**meta, "n_tokens": meta["n_tokens"] + 10})


def n_examples_lowered(meta):
    return json.dumps({**meta, "n_examples": meta["n_examples"] - 1})


def crc_changed(meta):
    meta["checksums"]["tokens.bin"]["crc32c"] ^= 1
    return json.dumps(meta)


def bytes_changed(meta):
    meta["checksums"]["mask.bin"]["bytes"] += 1
    return json.dumps(meta)


def checksums_deleted(meta):
    return json.dumps({k: v for k, v in meta.items() if k != "checksums"})


def n_tokens_deleted(meta):
    return json.dumps({k: v for k, v in meta.items() if k != "n_tokens"})


def not_json(meta):
    return json.dumps(meta)[:40]


def a_list(meta):
    return json.dumps([meta])


def n_tokens_nan(meta):
    return json.dumps(meta).replace(f'"n_tokens": {meta["n_tokens"]}', '"n_tokens": NaN')


def _remove(name):
    def damage(entry):
        os.remove(os.path.join(entry, name))

    damage.__name__ = f"{name}:deleted"
    return damage


def _directory_in_place_of(name):
    def damage(entry):
        os.remove(os.path.join(entry, name))
        os.mkdir(os.path.join(entry, name))

    damage.__name__ = f"{name}:a directory"
    return damage


def tokens_symlinked(entry):
    file = os.path.join(entry, "tokens.bin")
    shutil.copy(file, file + ".elsewhere")
    os.remove(file)
    os.symlink(file + ".elsewhere", file)


tokens_symlinked.__name__ = "tokens.bin:a symlink"


def meta_deleted_with_a_stale_build(entry):
    """meta.json gone and a dead process's temporary build beside the entry (issue 35: ``OSError:
    Directory not empty`` on this and every later run)."""
    os.remove(os.path.join(entry, "meta.json"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{entry}.tmp-{dead.pid}"
    shutil.copytree(entry, stale)


def entry_a_file(entry):
    shutil.rmtree(entry)
    with open(entry, "w") as f:
        f.write("x")


def entry_emptied(entry):
    shutil.rmtree(entry)
    os.mkdir(entry)


DAMAGES = [
    *(
        _edit_bytes("tokens.bin", e)
        for e in (
            flip_first,
            flip_middle,
            flip_last,
            id_0xffff,
            garbage,
            all_zeros,
            cut_2,
            cut_half,
            emptied,
            extended,
        )
    ),
    *(
        _edit_bytes("mask.bin", e)
        for e in (
            flip_first,
            flip_last,
            garbage,
            all_ones,
            all_zeros,
            a_byte_2,
            cut_2,
            cut_half,
            emptied,
            extended,
        )
    ),
    *(
        _edit_index(e)
        for e in (
            starts_swapped,
            start_plus_1,
            example_dropped,
            shape_n_2,
            start_beyond,
            start_negative,
            as_float,
            as_int32,
            transposed,
            file_index_out,
            line_negative,
            first_start_not_0,
        )
    ),
    index_of_objects,
    _edit_bytes("index.npy", garbage),
    _edit_bytes("index.npy", cut_half),
    _edit_bytes("index.npy", flip_last),
    *(
        _edit_meta(e)
        for e in (
            n_tokens_lowered,
            n_tokens_raised,
            n_examples_lowered,
            crc_changed,
            bytes_changed,
            checksums_deleted,
            n_tokens_deleted,
            not_json,
            a_list,
            n_tokens_nan,
            _field("dtype", "uint8"),
            _field("dtype", "uint32"),
            _field("n_tokens", "12"),
            _field("n_tokens", 2**64),
            _field("version", 1),
            _field("vocab_size", 70000),
            _field("files", []),
            _field("train_on_prompt", True),
            _field("extra", 1),
        )
    ),
    *(_remove(name) for name in ("tokens.bin", "mask.bin", "index.npy", "meta.json")),
    _directory_in_place_of("tokens.bin"),
    tokens_symlinked,
    meta_deleted_with_a_stale_build,
    entry_a_file,
    entry_emptied,
]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__)
def test_every_damage_is_rebuilt_to_the_same_tokens_or_refused_by_name(
    built, tmp_path, damage, caplog
):
    good = built[4]
    cache = str(tmp_path / "cache")
    shutil.copytree(built[3], cache)
    entry = os.path.join(cache, os.path.basename(good.path))
    damage(entry)
    file = damage.__name__.split(":")[0]
    with caplog.at_level(logging.WARNING, logger="zinf_data"):
        try:
            again = _open(built, cache)
        except zd.DataError as e:  # refused: the message names the file
            assert file in str(e) or entry in str(e), str(e)
            return
    assert _same(again, good), "an entry opened with other tokens than its build wrote"
    said = [r.getMessage() for r in caplog.records if r.name == "zinf_data"]
    assert len(said) == 1 and "rebuilding" in said[0], said  # said once
    if "." in file:  # the damaged file is named
        assert file in said[0], said[0]
    assert sorted(os.listdir(cache)) == [os.path.basename(entry)], (
        "a temporary build was left behind"
    )
    caplog.clear()
    assert (
        _same(_open(built, cache), good) and not caplog.records
    )  # the rebuilt entry opens cleanly


def test_a_good_entry_opens_without_a_word(built, caplog):
    with caplog.at_level(logging.WARNING, logger="zinf_data"):
        again = _open(built, built[3])
    assert _same(again, built[4]) and not caplog.records


def test_no_verify_keeps_the_length_and_index_checks(built, tmp_path, caplog):
    """``verify=False`` (``--no-verify``) reads no checksum: a flipped byte goes through, a cut
    file or a broken index does not."""
    cache = str(tmp_path / "cache")
    shutil.copytree(built[3], cache)
    entry = os.path.join(cache, os.path.basename(built[4].path))
    _edit_bytes("tokens.bin", flip_middle)(entry)
    assert not _same(_open(built, cache, verify=False), built[4])  # what the checksum is for
    _edit_index(start_negative)(entry)
    with caplog.at_level(logging.WARNING, logger="zinf_data"):
        rebuilt = _open(built, cache, verify=False)
    assert _same(rebuilt, built[4])
    assert "index.npy" in caplog.records[0].getMessage()


def test_a_running_builds_temporary_directory_is_left_alone(built, tmp_path):
    cache = str(tmp_path / "cache")
    shutil.copytree(built[3], cache)
    entry = os.path.join(cache, os.path.basename(built[4].path))
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.mkdir(f"{entry}.tmp-{alive.pid}")
        _open(built, cache)
        assert os.path.isdir(f"{entry}.tmp-{alive.pid}")
    finally:
        alive.kill()
        alive.wait()
    _open(built, cache)
    assert not os.path.exists(f"{entry}.tmp-{alive.pid}")


@pytest.mark.parametrize("before", ["none", "damaged"])
def test_an_entry_another_process_installs_during_the_build_is_kept(
    built, tmp_path, monkeypatch, before
):
    """The ranks of one run tokenize the same files into one cache: an entry another process
    installed while this one built (where there was none, or a damaged one) is kept as it is, since
    replacing it would pull its files from under that process's reads; this build is removed."""
    cache = str(tmp_path / "cache")
    entry = os.path.join(cache, os.path.basename(built[4].path))
    if before == "damaged":
        shutil.copytree(built[3], cache)
        _remove("mask.bin")(entry)
    install, theirs = cache_module.install, []

    def racing(*args):
        other = f"{entry}.other"  # the other process's build, complete, installed first
        shutil.copytree(built[4].path, other)
        shutil.rmtree(entry, ignore_errors=True)
        os.rename(other, entry)
        theirs.append(os.lstat(entry).st_ino)
        install(*args)

    monkeypatch.setattr(cache_module, "install", racing)
    got = _open(built, cache)
    assert os.lstat(entry).st_ino == theirs[0] and _same(got, built[4])
    assert os.listdir(cache) == [os.path.basename(entry)]  # no build or moved-aside entry left
