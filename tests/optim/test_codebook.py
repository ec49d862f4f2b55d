"""Frozen weights stored int8 or NF4 (``zinf_fn.formats.codebook``): the codes and values against
bitsandbytes (NF4) and a plain-torch reference of the same formula (int8).

Everything here is bitwise: NF4 follows bitsandbytes' own quantize_4bit / dequantize_4bit step for
step (absmax, the clamped scale, ``bucketize`` over the code book's midpoints, fp32 ``code *
absmax`` then the cast), so no tolerance is involved.
"""

from __future__ import annotations

import pytest
import torch

from zinf_fn.formats import codebook


def _weights(shape, seed: int = 0) -> torch.Tensor:
    """bf16 weights with a few exact zeros and an all-zero block (absmax 0 must not divide by
    zero)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    w.view(-1)[:64] = 0.0
    w.view(-1)[100:110] = 0.0
    return w.to(torch.bfloat16)


def test_nf4_is_bitsandbytes():
    import bitsandbytes.functional as bnb  # a dev dependency: the reference, never skipped

    assert torch.equal(codebook.frozen_code("nf4"), bnb.get_4bit_type("nf4", device="cpu"))
    w = _weights((96, 128))
    packed, qs = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    stored = codebook.encode_leaf("nf4", w)
    blocks = w.numel() // 64
    assert stored.dtype == torch.uint8 and stored.numel() == codebook.leaf_nbytes("nf4", w.numel())
    assert torch.equal(stored[: 4 * blocks].view(torch.float32), qs.absmax)  # the scales
    assert torch.equal(stored[4 * blocks :], packed.reshape(-1))  # the codes, packed as bnb packs
    ours = codebook.decode_leaf("nf4", stored, tuple(w.shape), torch.bfloat16)
    assert torch.equal(ours, bnb.dequantize_4bit(packed, qs))


def test_int8_is_the_absmax_formula():
    w = _weights((64, 96), seed=1)
    stored = codebook.encode_leaf("int8", w)
    x = w.float().reshape(-1, 64)
    absmax = x.abs().amax(dim=1)
    # the formula: the nearest of the codes k / 127 to x / absmax (ties to the lower code, as
    # bucketize)
    code = torch.arange(-127, 128, dtype=torch.float32) / 127
    scaled = torch.clamp(x * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1)
    index = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2)
    blocks = x.shape[0]
    assert stored.numel() == codebook.leaf_nbytes("int8", w.numel()) == w.numel() + 4 * blocks
    assert torch.equal(stored[: 4 * blocks].view(torch.float32), absmax)
    assert torch.equal(stored[4 * blocks :].long(), index.reshape(-1))
    ours = codebook.decode_leaf("int8", stored, tuple(w.shape), torch.bfloat16)
    assert torch.equal(ours, (code[index] * absmax[:, None]).reshape(w.shape).to(torch.bfloat16))
    # and it is the round-to-nearest int8 of x * 127 / absmax: off by at most half a step (1e-6
    # relative: the fp32 rounding of code * absmax), plus the bf16 cast's half ulp (2^-8 of the
    # value)
    step = (absmax / 127)[:, None]
    assert (
        (ours.float().reshape(-1, 64) - x).abs() <= step / 2 * (1 + 1e-6) + x.abs() * 2**-8
    ).all()


def test_bounds_keep_the_moments_map():
    """The moments' 256-code map: 255 midpoints and the +inf pad, as before the code book moved
    here."""
    from zinf_fn.optim import formats

    code = formats.dynamic_map(signed=True)
    got = codebook.bounds(code)
    assert (
        got.numel() == 256
        and torch.equal(got[:-1], (code[:-1] + code[1:]) / 2)
        and got[-1] == float("inf")
    )
    assert torch.isinf(codebook.bounds(codebook.frozen_code("nf4"))[15:]).all()


def test_a_search_bounded_by_the_code_count_gives_the_full_searchs_codes():
    """``quantize(x, bounds, n_codes)`` searches log2(n_codes) steps (int8), or looks the code up
    by the top 16 bits of x (NF4's 16 codes, ``codebook.TABLED``): the same codes as the 8-step
    search and as ``torch.bucketize`` over the real midpoints, bitwise, on random blocks with a zero
    block, ties at the midpoints, the floats either side of each midpoint and a NaN."""
    gen = torch.Generator().manual_seed(0)
    for kind in ("nf4", "int8"):
        code = codebook.frozen_code(kind)
        bounds = codebook.bounds(code)
        x = torch.randn(512, 64, generator=gen) * torch.rand(512, 1, generator=gen)
        x[1] = 0.0
        x[2, :15] = bounds[:15]  # exactly on a midpoint (absmax 1 below: x[2, 15] = 1)
        x[2, 15] = 1.0
        x[3, 0] = float("nan")
        for row, toward in ((4, 2.0), (5, -2.0)):  # the fp32 values next to each midpoint
            x[row, :15] = torch.nextafter(bounds[:15], torch.tensor(toward))
            x[row, 15] = 1.0
        x[6, 0] = -0.0
        full, absmax_full = codebook.quantize(x, bounds)
        short, absmax_short = codebook.quantize(x, bounds, code.numel())
        assert torch.equal(full, short)
        assert torch.equal(absmax_full.nan_to_num(), absmax_short.nan_to_num())
        scaled = (x * (1.0 / absmax_full.clamp(min=1e-38))[:, None]).clamp(-1.0, 1.0)  # as quantize
        finite = ~scaled.isnan().any(dim=1)
        want = torch.bucketize(scaled[finite], bounds[: code.numel() - 1])
        assert torch.equal(short[finite].long(), want)


def _hard_blocks(gen: torch.Generator) -> torch.Tensor:
    """fp32 blocks of 64 whose codes are hard to get right: random scales, an all-zero block, values
    on the midpoints, denormal and huge blocks, a block whose absmax is below the 1e-38 clamp."""
    code = codebook.frozen_code("nf4")
    x = torch.randn(300, 64, generator=gen) * torch.rand(300, 1, generator=gen)
    x[1] = 0.0
    x[2, :15] = codebook.bounds(code)[:15]
    x[2, 15] = 1.0
    x[3] *= 1e-40  # denormal values
    x[4] *= 1e37
    x[5] = torch.linspace(-1.0, 1.0, 64)
    return x


def test_the_c_kernels_give_the_torch_twins_bits():
    """``encode_leaf`` / ``decode_leaf`` / ``decode_leaf_`` run the C kernels
    (``codebook_kernels``) on the CPU: bytes and values bitwise those of their torch twins
    (``native=False``), for both codes, both value dtypes, fp32 and bf16 outputs; a leaf with an inf
    or NaN weight, or a NaN scale, comes from the twin (its NaN rules are torch's)."""
    from zinf_fn.formats import codebook_kernels

    assert codebook_kernels.library() is not None  # the CI machine has a C compiler
    gen = torch.Generator().manual_seed(1)
    for kind in ("nf4", "int8"):
        for w in (_hard_blocks(gen), _hard_blocks(gen).to(torch.bfloat16), _weights((96, 128))):
            stored = codebook.encode_leaf(kind, w)
            assert torch.equal(stored, codebook.encode_leaf(kind, w, native=False))
            for dtype in (torch.bfloat16, torch.float32):
                want = codebook.decode_leaf(kind, stored, tuple(w.shape), dtype, native=False)
                got = codebook.decode_leaf(kind, stored, tuple(w.shape), dtype)
                assert got.dtype == dtype and torch.equal(got, want)
                into = torch.empty(w.numel())
                assert codebook.decode_leaf_(kind, stored, into, dtype)
                assert torch.equal(into, want.reshape(-1).float())
        odd = _weights((4, 64))
        odd[0, 3], odd[2, 9] = float("inf"), float("nan")
        stored = codebook.encode_leaf(kind, odd)
        assert torch.equal(stored, codebook.encode_leaf(kind, odd, native=False))
        stored[:4] = torch.tensor([float("nan")]).view(torch.uint8)  # the first block's scale
        into = torch.empty(odd.numel())
        assert not codebook.decode_leaf_(kind, stored, into, torch.bfloat16)
        want = codebook.decode_leaf(kind, stored, (4, 64), torch.bfloat16, native=False)
        got = codebook.decode_leaf(kind, stored, (4, 64), torch.bfloat16)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# the decode paths built for this CPU and for others, by the instruction sets left out: AVX2, scalar
PATHS = {"native": (), "avx2": ("-mno-avx512f",), "scalar": ("-mno-avx512f", "-mno-avx2")}


@pytest.mark.parametrize("without", PATHS.values(), ids=PATHS.keys())
def test_every_instruction_sets_decode_gives_the_twins_bits(monkeypatch, without):
    """The decode kernel built for each path (``PATHS``) gives the torch twin's bits, for both
    codes, both value dtypes, fp32 and bf16 outputs, on blocks of 64 and of 96 (whose last 32
    values run the scalar tail after a vector chunk)."""
    from zinf_fn import native
    from zinf_fn.formats import codebook_kernels

    lib = codebook_kernels.load((*native.FLAGS, *without))
    assert lib is not None
    monkeypatch.setattr(codebook_kernels, "library", lambda: lib)
    gen = torch.Generator().manual_seed(2)
    for kind in ("nf4", "int8"):
        for block in (64, 96):
            w = _hard_blocks(gen).reshape(-1, block)  # (300 * 64 / block, block)
            stored = codebook.encode_leaf(kind, w, block)
            assert torch.equal(stored, codebook.encode_leaf(kind, w, block, native=False))
            for dtype in (torch.bfloat16, torch.float32):
                want = codebook.decode_leaf(kind, stored, w.shape, dtype, block, native=False)
                for into in (torch.empty(w.numel()), torch.empty(w.numel(), dtype=dtype)):
                    assert codebook.decode_leaf_(kind, stored, into, dtype, block)
                    assert torch.equal(into, want.reshape(-1).to(into.dtype))
