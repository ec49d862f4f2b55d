"""A lent fp32 master made an fp32 layer in one pass (``optim.masters.cast16_widened_``, the C
kernel ``round_bf16``): bit for bit torch's ``master.to(bfloat16).to(float32)``, the two casts the
backward fetch made before, NaNs, infinities, subnormals and overflow to infinity included."""

from __future__ import annotations

import pytest
import torch

from zinf_fn.optim import masters, native


def _hard_values(n: int) -> torch.Tensor:
    """``n`` fp32 values over the whole exponent range, with ties, NaNs of several payloads and
    signs, infinities and values that round up to infinity."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=gen) * torch.logspace(-45, 38, n).flip(0)
    bits = x.view(torch.int32)
    specials = [0x7FC00000, 0x7F800001, -0x400000, 0x7FA12345, -0x7E7EDCBB, 0x7F800000]
    specials += [-0x800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x00000001, -0x7FFF8000]
    for i, b in enumerate(specials):
        bits[i * 37 % n] = b
    bits[-1] = 0x7FC00001  # a NaN in the scalar tail
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("n", [1, 15, 1000, 1 << 20])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_the_one_pass_cast_is_torchs_two_casts_bitwise(monkeypatch, n, kernel):
    if kernel:
        assert native.library() is not None
    else:
        monkeypatch.setattr(native, "library", lambda: None)
    x = _hard_values(max(n, 1))
    out = torch.empty_like(x)
    masters.cast16_widened_(out, x)
    assert torch.equal(_bits(out), _bits(x.to(torch.bfloat16).to(torch.float32)))
