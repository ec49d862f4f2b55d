"""``zinf_cli.corpus`` (``zinf-fn train``'s data):
token files (nanoGPT's flat uint16/uint32 ``train.bin``) beside the byte-level corpus."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zinf_cli import corpus as data


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows_are_the_file_contents(tmp_path, dtype):
    top = 65_535 if dtype == "uint16" else 100_000  # uint32 ids above the uint16 range must survive
    ids = np.random.default_rng(0).integers(0, top, size=5000).astype(dtype)
    path = tmp_path / "train.bin"
    ids.tofile(path)  # nanoGPT's prepare.py writes it this way: raw ids, no header
    tokens = data.load_tokens(str(path), dtype)
    assert isinstance(tokens, np.memmap) and tokens.shape == (5000,) and not tokens.flags.writeable
    train, held_out = data.split(tokens, holdout=0.1)
    assert len(train) == 4500 and len(held_out) == 500
    batch = next(data.batches(train, batch_size=4, seq_len=16, seed=0))
    assert batch["inputs"].shape == (4, 16) and batch["inputs"].dtype == torch.long
    assert torch.equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    starts = torch.randint(
        0, 4500 - 17, (4,), generator=torch.Generator().manual_seed(0)
    )  # batches' draw
    windows = np.stack([ids[s : s + 17] for s in starts.tolist()]).astype(np.int64)  # (B, T + 1)
    assert torch.equal(batch["inputs"], torch.from_numpy(windows[:, :-1]))
    assert torch.equal(batch["targets"], torch.from_numpy(windows[:, 1:]))


def test_token_windows_follow_the_same_draws_as_bytes():
    """The same seed picks the same window starts for a memmap and for a byte tensor of the same
    values."""
    values = np.arange(3000, dtype=np.uint16) % 251
    as_tokens = next(data.batches(values, batch_size=3, seq_len=8, seed=5))
    as_bytes = next(
        data.batches(torch.from_numpy(values.astype(np.uint8)), batch_size=3, seq_len=8, seed=5)
    )
    assert torch.equal(as_tokens["inputs"], as_bytes["inputs"])
    assert torch.equal(as_tokens["targets"], as_bytes["targets"])


def test_token_file_errors(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 4097)
    with pytest.raises(ValueError, match="not a whole number of uint16"):
        data.load_tokens(str(odd), "uint16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        data.load_tokens(str(odd), "int8")
    small = tmp_path / "small.bin"
    np.zeros(10, dtype=np.uint32).tofile(small)
    with pytest.raises(ValueError, match="need at least 1024"):
        data.load_tokens(str(small), "uint32")
