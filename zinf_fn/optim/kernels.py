"""The elementwise pieces of the compressed AdamW update, as plain torch that ``torch.compile``
fuses.

Everything here is traceable: ``optim.compressed`` composes these into one function per (master,
moments) format and compiles it, the fallback where the C kernels (``optim.native``) cannot be built
and the definition they follow operation for operation. Run eagerly each is its own slow twin,
except ``sqrt`` (see ``adamw_math``).

Stochastic rounding (bf16 moments) is keyed, not drawn: 32 bits per element come from a
counter-based hash of (unit seed, step, element index in the unit's row), the low 16 for m and the
high 16 for v, so a rerun, a resume, and every placement, world size and piece size write the same
bits.
"""

from __future__ import annotations

import torch

from .remainder import _as_int16, _bits

_M32 = 0xFFFFFFFF


def hash32(x):
    """A bijective 32-bit mix (xorshift-multiply; multipliers below 2^31 so int64 never overflows)
    of ``x`` in [0, 2^32): a Python int or an int64 tensor."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & _M32
    return x ^ (x >> 16)


def rounding_key(unit_seed: int, step: int) -> int:
    """The per-(unit, step) 32-bit key of the stochastic rounding noise."""
    return hash32(hash32(unit_seed & _M32) ^ (step & _M32))


def rounding_noise(numel: int, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(noise for m, noise for v): int64 (numel,) in [0, 2^16) for elements ``counter[0] +
    arange(numel)`` of the row, keyed by ``counter[1]`` (``rounding_key``)."""
    index = torch.arange(numel, dtype=torch.int64, device=counter.device) + counter[0]
    h = hash32((index & _M32) ^ counter[1])
    return h & 0xFFFF, h >> 16


def to_bf16_stochastic(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` -> bf16: ``noise`` (int64 in [0, 2^16), x's shape) added to the low half of the
    bits, then truncated; the magnitude rounds up with probability low / 2^16, so E[result] = x. NaN
    stays NaN."""
    u = _bits(x)
    hi = ((u + noise) >> 16) & 0xFFFF
    return _as_int16(torch.where(torch.isnan(x), 0x7FC0, hi)).view(torch.bfloat16)


def adamw_math(p, g, m, v, s: torch.Tensor, decay: torch.Tensor | None):
    """One AdamW step in fp32, torch's fused AdamW's formula and order (elementwise, any one
    shape)::

        p <- p * (1 - lr wd)                      (where ``decay``; everywhere if ``decay`` is None)
        m <- m + (1 - b1) (g - m)                 v <- v b2 + (1 - b2) g g
        p <- p - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    ``s`` is ``optim.compressed.step_scalars``' fp32 (7,): (1 - lr wd, 1 - b1, b2, 1 - b2,
    sqrt(1 - b2^t), eps, lr / (1 - b1^t)), each rounded to fp32 as torch's kernel rounds them.
    Compiled, ``sqrt`` is the correctly rounded vector sqrt (as in torch's fused kernel); eager
    ``torch.sqrt`` of a large CPU tensor is MKL's and may differ by an ulp, so a slow twin takes
    ``sqrt`` in float64.
    """
    factor = s[0] if decay is None else torch.where(decay, s[0], 1.0)
    p = p * factor
    m = m + s[1] * (g - m)
    v = v * s[2] + s[3] * g * g
    denom = torch.sqrt(v) / s[4] + s[5]
    return p - s[6] * m / denom, m, v
