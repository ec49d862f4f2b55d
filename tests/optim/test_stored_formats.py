"""The codec a restore converts formats with (``zinf_fn.state.RowFormat``: ``optim/stored.py``)
against the plain-torch references of tests/optim/test_compressed_update.py, which the update
kernels equal bitwise: a conversion writes the bits the engine's own write would.

Everything is compared bitwise: each conversion is either exact (join, split, the bf16 upcast) or
one deterministic rounding (the cast of the 16-bit copy, the keyed stochastic rounding, the int8
quantizer).
"""

from __future__ import annotations

import pytest
import torch
from compressed_reference import ref_dequantize, ref_quantize, ref_stochastic_bf16

from zinf_fn.optim import compressed as C
from zinf_fn.optim import formats
from zinf_fn.optim.remainder import split_master, to_bf16_ties_away
from zinf_fn.state import Formats, RowFormat, Where, check_values, parse_formats

N = 4 * 256 + 256  # five int8 blocks


def fmt(master="fp32", moments="fp32", ties_away=False):
    return RowFormat(
        master, formats.MomentsFormat(moments), torch.bfloat16, ties_away or master == "remainder"
    )


def values(seed=0, n=N):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-3
    x[:7] = torch.tensor(
        [0.0, -0.0, 1e-45, -3e38, 3.3895e38, 1.0 + 2**-8, -(1.0 + 3 * 2**-8)]
    )  # ties, extremes
    return x


def test_master_slots_join_and_split_exactly():
    x = values()
    rows = fmt("remainder").encode("master", x, Where(0, 0, 0))
    assert set(rows) == {"param", "remainder"}
    want_param, want_rem = split_master(x)
    assert torch.equal(rows["param"].view(torch.int16), want_param.view(torch.int16))
    assert torch.equal(rows["remainder"], want_rem)
    assert torch.equal(
        fmt("remainder").decode("master", rows).view(torch.int32), x.view(torch.int32)
    )
    assert torch.equal(fmt().decode("master", {"master": x}), x)
    assert torch.equal(
        fmt("none").decode("master", {"param": rows["param"]}), rows["param"].float()
    )


def test_the_16_bit_copy_rounds_as_the_engine_casts():
    x = values()
    ties = x[5:7]  # exact ties: 1 + 2^-8 and -(1 + 3 * 2^-8)
    away, even = (
        fmt(ties_away=True).encode("param", x, None)["param"],
        fmt().encode("param", x, None)["param"],
    )
    assert torch.equal(away.view(torch.int16), to_bf16_ties_away(x).view(torch.int16))
    assert torch.equal(even.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert not torch.equal(
        to_bf16_ties_away(ties).view(torch.int16), ties.to(torch.bfloat16).view(torch.int16)
    )


@pytest.mark.parametrize("leaf", [0, 1])
def test_bf16_moments_round_as_the_engine_writes_them(leaf):
    x = values(leaf).abs() if leaf else values(leaf)
    for where in (Where(3, 7, 0), Where(0, -1, 4096), Where(11, 1 << 33, 12704)):
        got = fmt(moments="bf16").encode(f"opt.{leaf}", x, where)[f"opt.{leaf}"]
        want = ref_stochastic_bf16(
            x, where.element_offset, where.unit_seed, where.step & 0xFFFFFFFF, leaf == 1
        )
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), where
        assert (
            (got.float() - x).abs() <= (x.abs() * 2**-7).clamp(min=1e-44)
        ).all()  # one of x's neighbours
        assert torch.equal(
            fmt(moments="bf16").decode(f"opt.{leaf}", {f"opt.{leaf}": got}), got.float()
        )


@pytest.mark.parametrize("leaf", [0, 1])
def test_int8_moments_quantize_and_dequantize_as_the_engine(leaf):
    x = values(leaf).abs() if leaf else values(leaf)
    x[256:512] = 0.0  # a block of zeros: absmax 0, every code the code of 0
    if leaf == 0:
        x[512] = -1.0  # a block of m led by a negative value (the rest are ~1e-3)
    code = formats.dynamic_map(signed=leaf == 0)
    int8 = fmt(moments="int8")
    rows = int8.encode(f"opt.{leaf}", x, None)
    want_codes, want_absmax = ref_quantize(x, code)
    assert torch.equal(rows[f"opt.{leaf}"], want_codes) and torch.equal(
        rows[f"opt.{leaf}.absmax"], want_absmax
    )
    decoded = int8.decode(f"opt.{leaf}", rows)
    assert torch.equal(decoded, ref_dequantize(want_codes, want_absmax, code))
    # int8 -> fp32 -> int8 gives the same codes and scales in every block whose largest magnitude
    # decodes to +-absmax exactly: every block of v (the unsigned map ends at 1.0) and the blocks of
    # m whose largest magnitude is positive (the signed map ends at +1.0 but at -0.993...: a block
    # led by a negative value comes back with its scale times 0.993..., the codes re-chosen against
    # it)
    again = int8.encode(f"opt.{leaf}", decoded, None)
    blocks = x.view(-1, 256)
    exact = (
        (blocks.gather(1, blocks.abs().argmax(1, keepdim=True)).squeeze(1) >= 0)
        if leaf == 0
        else torch.ones(blocks.shape[0], dtype=torch.bool)
    )
    assert exact.any() and (leaf == 1 or not exact.all())  # the data has blocks of both kinds for m
    assert torch.equal(again[f"opt.{leaf}.absmax"][exact], rows[f"opt.{leaf}.absmax"][exact])
    assert torch.equal(
        again[f"opt.{leaf}"].view(-1, 256)[exact], rows[f"opt.{leaf}"].view(-1, 256)[exact]
    )
    lowest = code[0].abs()  # the signed map's most negative code's magnitude (< 1)
    assert torch.equal(
        again[f"opt.{leaf}.absmax"][~exact], rows[f"opt.{leaf}.absmax"][~exact] * lowest
    )
    fresh = C.init_moments(formats.MomentsFormat("int8"), 256)
    zero = int8.zero_value(f"opt.{leaf}")
    assert zero == int((fresh.m_codes if leaf == 0 else fresh.v_codes)[0])
    assert (rows[f"opt.{leaf}"][256:512] == zero).all()
    assert (
        int8.zero_value(f"opt.{leaf}.absmax") == 0
        and fmt(moments="bf16").zero_value(f"opt.{leaf}") == 0
    )


def test_a_scale_no_save_writes_is_named():
    good = torch.tensor([0.0, 1.5, 3e38])
    assert check_values("opt.0.absmax", good) is None
    for bad, i in ((float("nan"), 1), (float("inf"), 1), (-0.5, 1), (float("-inf"), 1)):
        scales = good.clone()
        scales[i] = bad
        where, expected = check_values("opt.1.absmax", scales)
        assert where == i and "finite scale >= 0" in expected
    assert (
        check_values("opt.0", torch.tensor([float("nan")])) is None
    )  # only scales carry this rule


def test_formats_descriptions_are_checked_field_by_field():
    f = Formats.fp32()
    assert parse_formats(f.master, f.moments) == (formats.MasterFormat(), formats.MomentsFormat())
    cases = [
        ({**f.master, "kind": "fp8"}, f.moments, "master: master='fp8' is not a known format"),
        (
            f.master,
            {**f.moments, "version": 9},
            "moments: MomentsFormat version 9 is not one this reader knows",
        ),
        (f.master, {**f.moments, "bits": 4}, "moments: MomentsFormat: unknown fields ['bits']"),
        (f.moments, f.moments, "master: expected a MasterFormat description, got 'MomentsFormat'"),
        (
            {k: v for k, v in f.master.items() if k != "version"},
            f.moments,
            "got none for ['version']",
        ),
    ]
    for master, moments, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_formats(master, moments)
