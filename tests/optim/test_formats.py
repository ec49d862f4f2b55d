"""Stored formats of the optimizer state: the exact remainder, the ties-away copy, the int8 maps,
format data, and the errors of ``Config(master=)`` / ``zf.adamw(moments=)``.

Everything here is bitwise: the remainder is exact by construction and the maps are copies of
bitsandbytes', so no tolerance is involved.
"""

from __future__ import annotations

import pytest
import torch

import zinf_fn as zf
from layers import gpt
from zinf_fn.optim import formats
from zinf_fn.optim.remainder import join, split_master, to_bf16_ties_away
from zinf_fn.state import view

LOWS = torch.arange(1 << 16, dtype=torch.int64)  # every low half


def _highs() -> torch.Tensor:
    """High halves covering every kind of fp32: ±0 and subnormals (0x0000-0x007F), the smallest
    normals, ordinary values of both signs, the largest finite (0x7F7F / 0xFF7F), ±inf, NaNs, and
    random ones."""
    named = [
        0x0000,
        0x0001,
        0x0040,
        0x007F,
        0x0080,
        0x0081,
        0x3F80,
        0x3F81,
        0x4049,
        0x7F7E,
        0x7F7F,
        0x7F80,
        0x7FC0,
        0x7FFF,
    ]
    rand = torch.randint(0, 1 << 15, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    return torch.tensor(
        sorted({h | sign for h in named + rand for sign in (0, 0x8000)}), dtype=torch.int64
    )


def _floats(highs: torch.Tensor) -> torch.Tensor:
    bits = (highs[:, None] << 16 | LOWS[None, :]).reshape(-1)  # (H * 65536,) uint32 patterns
    return ((bits ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.float32)


def test_split_join_is_exact_for_every_low_half():
    x = _floats(_highs())
    copy, remainder = split_master(x)
    assert copy.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    back = join(copy, remainder)
    number = ~x.isnan()  # finite values and the infinities
    assert torch.equal(
        back[number].view(torch.int32), x[number].view(torch.int32)
    )  # bits, so -0.0 != 0.0
    assert back[~number].isnan().all() and copy[~number].isnan().all()  # NaN stays NaN
    assert torch.equal(
        copy.view(torch.int16), to_bf16_ties_away(x).view(torch.int16)
    )  # the copy is the cast


def test_largest_finite_values_have_an_infinite_copy_and_an_exact_remainder():
    x = torch.tensor([3.4028234663852886e38, -3.4028234663852886e38, float("inf"), float("-inf")])
    copy, remainder = split_master(x)
    assert (
        copy.float().isinf().all()
    )  # fp32 max rounds past bf16's max, as round-to-nearest-even does
    assert torch.equal(join(copy, remainder), x)
    assert torch.equal(copy, x.to(torch.bfloat16))


def test_ties_away_equals_round_to_nearest_even_except_on_exact_ties():
    x = _floats(_highs())
    ours, torchs = to_bf16_ties_away(x).view(torch.int16), x.to(torch.bfloat16).view(torch.int16)
    low, number = x.view(torch.int32) & 0xFFFF, ~x.isnan()
    tie = (low == 0x8000) & number
    assert torch.equal(ours[~tie & number], torchs[~tie & number])
    hi = (x.view(torch.int32) >> 16) & 0xFFFF
    # a tie rounds the magnitude up (away from zero); to-even rounds up only from an odd high half
    assert torch.equal(ours[tie].long() & 0xFFFF, (hi[tie].long() + 1) & 0xFFFF)
    differs = ours[tie] != torchs[tie]
    assert torch.equal(differs, (hi[tie] & 1) == 0)


def test_dynamic_maps_are_bitsandbytes():
    import bitsandbytes.functional as bnb  # a dev dependency: the reference, never skipped

    for signed in (True, False):
        ours = formats.dynamic_map(signed)
        assert torch.equal(ours, bnb.create_dynamic_map(signed=signed))
        assert (ours == 0).sum() == 1 and ours.max() == 1.0  # an exact zero, and 1.0


def test_formats_are_data_with_a_version():
    for fmt in (
        formats.MasterFormat("remainder"),
        formats.MomentsFormat("int8"),
        formats.MomentsFormat("bf16"),
    ):
        assert formats.from_description(formats.describe(fmt)) == fmt
    desc = formats.describe(formats.MomentsFormat("int8"))
    with pytest.raises(ValueError, match="version 2 is not one this reader knows"):
        formats.from_description({**desc, "version": 2})
    with pytest.raises(ValueError, match="block=128"):
        formats.from_description({**desc, "block": 128})
    with pytest.raises(ValueError, match="unknown state format 'Fp8Moments'"):
        formats.from_description({**desc, "format": "Fp8Moments"})
    with pytest.raises(ValueError, match=r"unknown fields \['scale'\]"):
        formats.from_description({**desc, "scale": 2})


def test_bytes_per_element():
    assert formats.master_bytes_per_element(formats.MasterFormat("fp32")) == 4
    assert formats.master_bytes_per_element(formats.MasterFormat("remainder")) == 2
    assert formats.moments_bytes_per_element(formats.MomentsFormat("fp32")) == 8
    assert formats.moments_bytes_per_element(formats.MomentsFormat("bf16")) == 4
    assert formats.moments_bytes_per_element(formats.MomentsFormat("int8")) == 2 + 8 / 256
    assert formats.moments_nbytes(formats.MomentsFormat("int8"), 512) == 2 * 512 + 2 * 2 * 4
    with pytest.raises(AssertionError, match="multiples of 256"):
        formats.moments_nbytes(formats.MomentsFormat("int8"), 300)


def test_which_leaves_are_compressed():
    assert formats.compressed_leaf(None, "blocks.0.attn.qkv.w", 4096)
    assert not formats.compressed_leaf(None, "blocks.0.ln1.w", 4095)
    keep_embed = lambda path, numel: numel >= 4096 and not path.startswith("embed")
    assert not formats.compressed_leaf(keep_embed, "embed.tok.w", 1 << 20)
    assert formats.compressed_leaf(keep_embed, "head.lm_head.w", 1 << 20)
    opt = zf.adamw(moments="int8", compress=keep_embed)
    assert opt.moments == formats.MomentsFormat("int8") and opt.compress is keep_embed
    assert opt.hyperparams["moments"] == "int8"
    # the engine stores int8 where the rule accepts a group's whole row: none of this tiny model's
    # (< 4096 elements)
    state = zf.init(
        gpt.model(gpt.Config(vocab_size=16, d_model=8, n_heads=1, n_layers=1, seq_len=4)),
        opt,
        zf.Config(),
    )
    assert all(
        view(state).kinds(group=g) == ["param", "master", "opt.0", "opt.1"]
        for g in view(state).groups
    )


def test_remainder_master_needs_bf16_params():
    with pytest.raises(
        ValueError,
        match=r"Config.master='remainder' needs param_dtype=torch.bfloat16 .*"
        r"got param_dtype=torch.float32",
    ):
        zf.Config(master="remainder", param_dtype=torch.float32)
    with pytest.raises(
        ValueError,
        match=r"Config.master='fp16' is not a master format; expected one of "
        r"\('fp32', 'remainder'\)",
    ):
        zf.Config(master="fp16")
    assert (
        zf.Config(master="remainder", param_dtype=torch.bfloat16).describe()["master"]
        == "remainder"
    )


def test_unknown_moments_is_an_error_naming_the_field():
    with pytest.raises(
        ValueError,
        match=r"adamw: moments='fp8' is not a moments format; expected one of "
        r"\('fp32', 'bf16', 'int8'\)",
    ):
        zf.adamw(moments="fp8")
    with pytest.raises(TypeError, match="compress must be a callable"):
        zf.adamw(moments="int8", compress=4096)
