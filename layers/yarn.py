"""YaRN rotary embeddings (gpt-oss's ``rope_type`` "yarn") as transformers computes them.

``inv_freq`` follows ``transformers.modeling_rope_utils._compute_yarn_parameters`` op for op, in
fp32 on the CPU (where HF computes it when the model is built), so the frequencies agree bitwise: a
blend of the plain frequencies (extrapolation, fast dimensions) and those divided by ``factor``
(interpolation, slow dimensions) by a linear ramp between the correction dimensions of ``beta_fast``
and ``beta_slow`` rotations over ``original_max_position_embeddings``. cos and sin are multiplied by
``attention_factor`` (HF's ``attention_scaling``; by default ``0.1 * log(factor) + 1``).

cos/sin come in ``layers.rope``'s layout (both halves of a head share an angle), so ``rope.apply``
rotates with them; gpt-oss's own ``_apply_rotary_emb`` on halves computes the same products.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Yarn:
    """YaRN hyper-parameters, HF's ``rope_parameters`` names; ``factor`` already resolved (HF
    derives a missing one as max_position_embeddings / original_max_position_embeddings),
    ``attention_factor`` None: derived from ``factor`` (and ``mscale`` / ``mscale_all_dim`` when
    both are set)."""

    theta: float
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self):
        if not self.theta > 0 or not self.factor > 0:
            raise ValueError(
                f"yarn.Yarn: theta and factor must be > 0, got theta={self.theta}, "
                f"factor={self.factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "yarn.Yarn: original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


def from_hf(params: Mapping, max_position_embeddings: int) -> Yarn:
    """The ``Yarn`` of a config's ``rope_parameters`` dict (rope_type "yarn"); raises ``ValueError``
    naming a missing field, or a ``partial_rotary_factor`` other than 1 (a partly rotated head)."""
    needed = ("rope_theta", "original_max_position_embeddings")
    missing = [name for name in needed if name not in params]
    if missing:
        raise ValueError(
            f"config.json: rope_parameters lacks {missing} (rope_type 'yarn' needs them)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"config.json: rope_parameters.partial_rotary_factor="
            f"{params['partial_rotary_factor']!r} is not supported; expected 1.0"
        )
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    return Yarn(
        theta=float(params["rope_theta"]),
        factor=max_position_embeddings / original if factor is None else float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),  # HF: a 0 or missing beta is the default
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
    )


def to_hf(yarn: Yarn) -> dict:
    """The ``rope_parameters`` dict of ``yarn``; ``from_hf`` of it is ``yarn``."""
    out = {
        "rope_type": "yarn",
        "rope_theta": yarn.theta,
        "factor": yarn.factor,
        "original_max_position_embeddings": yarn.original_max_position_embeddings,
        "beta_fast": yarn.beta_fast,
        "beta_slow": yarn.beta_slow,
        "truncate": yarn.truncate,
    }
    optional = {
        "attention_factor": yarn.attention_factor,
        "mscale": yarn.mscale,
        "mscale_all_dim": yarn.mscale_all_dim,
    }
    out.update({name: value for name, value in optional.items() if value is not None})
    return out


def attention_factor(yarn: Yarn) -> float:
    """The factor cos and sin are scaled by: given, or HF's ``yarn_get_mscale`` ratio of
    ``factor``."""
    if yarn.attention_factor is not None:
        return yarn.attention_factor
    if yarn.mscale and yarn.mscale_all_dim:
        return float(_mscale(yarn.factor, yarn.mscale) / _mscale(yarn.factor, yarn.mscale_all_dim))
    return _mscale(yarn.factor, 1)


def _mscale(scale: float, mscale: float) -> float:
    """YaRN's eq. 21, ``0.1 * mscale * log(scale) + 1`` (1 for scale <= 1), as HF's
    ``yarn_get_mscale``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@functools.lru_cache(maxsize=32)
def inv_freq(yarn: Yarn, dim: int) -> torch.Tensor:
    """The (dim/2,) fp32 CPU inverse frequencies for a head of ``dim`` (even) features."""
    if dim <= 0 or dim % 2:
        raise ValueError(f"yarn.inv_freq: head_dim must be a positive even int, got {dim}")
    pos_freqs = yarn.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)  # (dim/2,)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (yarn.factor * pos_freqs)
    low, high = _correction_range(yarn, dim)
    extrapolation_factor = 1 - _linear_ramp(low, high, dim // 2)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _correction_range(yarn: Yarn, dim: int) -> tuple[float, float]:
    """The dimensions where ``beta_fast`` and ``beta_slow`` rotations fit the original context,
    clipped to [0, dim - 1] (floored and ceiled with ``truncate``)."""
    low = _correction_dim(yarn.beta_fast, dim, yarn)
    high = _correction_dim(yarn.beta_slow, dim, yarn)
    if yarn.truncate:
        low = math.floor(low)
        high = math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _correction_dim(rotations: float, dim: int, yarn: Yarn) -> float:
    context = yarn.original_max_position_embeddings
    return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(yarn.theta))


def _linear_ramp(low: float, high: float, n: int) -> torch.Tensor:
    """(n,) fp32: 0 up to ``low``, 1 from ``high`` on, linear between (HF's
    ``linear_ramp_factor``)."""
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = (torch.arange(n, dtype=torch.float32) - low) / (high - low)
    return torch.clamp(ramp, 0, 1)


def cos_sin(yarn: Yarn, dim: int, t: int, device: torch.device, dtype: torch.dtype):
    """``(cos, sin)``, each (T, dim) in ``dtype`` on ``device`` for positions 0 .. t-1, scaled by
    ``attention_factor``; the angles formed in fp32 as HF's rotary embedding does, then cast."""
    positions = torch.arange(t, device=device).float()  # (T,)
    return _cos_sin(yarn, dim, positions[:, None], dtype)


def cos_sin_at(yarn: Yarn, dim: int, positions: torch.Tensor, dtype: torch.dtype):
    """``(cos, sin)``, each (B, 1, T, dim), at integer ``positions`` (B, T) (packed rows)."""
    cos, sin = _cos_sin(yarn, dim, positions.float()[..., None], dtype)  # 2 x (B, T, dim)
    return cos[:, None], sin[:, None]


def _cos_sin(yarn: Yarn, dim: int, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin of ``positions`` (..., 1) fp32 times the frequencies: (..., dim) each."""
    freqs = positions * inv_freq(yarn, dim).to(device=positions.device)  # (..., dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., dim): both halves share an angle
    scale = attention_factor(yarn)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
