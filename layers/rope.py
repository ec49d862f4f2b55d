"""Rotary position embeddings as Hugging Face computes them: inverse frequencies, cos/sin,
``rotate_half``.

The layout is HF's (GPT-NeoX style): a head's ``head_dim`` features are two halves, feature ``j``
and ``j + head_dim/2`` rotate together by angle ``pos * inv_freq[j]``. HF's ``q_proj``/``k_proj``
weights are stored for this layout, so they load as they are (no interleaving permutation).

``inv_freq`` follows ``transformers.modeling_rope_utils`` op for op, in fp32 on the CPU (where HF
computes it at model build time), for the rope types

    "default"  inv_freq[j] = 1 / theta ** (2j / dim)
    "linear"   inv_freq / factor                              (position interpolation)
    "llama3"   Llama 3.1's band-wise rescaling: wavelengths above original_max / low_freq_factor are
    divided
               by ``factor``, those below original_max / high_freq_factor kept, the band in between
               blended.

The attention scaling HF multiplies cos/sin by is 1.0 for all three, so it is left out.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from einops import rearrange

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rope:
    """Rotary hyper-parameters; ``factor`` is used by "linear" and "llama3", the rest by "llama3"
    only."""

    theta: float = 10_000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise ValueError(f"rope.Rope: type must be one of {ROPE_TYPES}, got {self.type!r}")
        if not self.theta > 0 or not self.factor > 0:
            raise ValueError(
                f"rope.Rope: theta and factor must be > 0, got theta={self.theta}, "
                f"factor={self.factor}"
            )
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                f"rope.Rope: llama3 needs high_freq_factor > low_freq_factor > 0, got "
                f"high_freq_factor={self.high_freq_factor}, low_freq_factor={self.low_freq_factor}"
            )


@functools.lru_cache(maxsize=32)
def inv_freq(rope: Rope, dim: int) -> torch.Tensor:
    """The (dim/2,) fp32 CPU inverse frequencies of ``rope`` for a head of ``dim`` features
    (even)."""
    if dim <= 0 or dim % 2:
        raise ValueError(f"rope.inv_freq: head_dim must be a positive even int, got {dim}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim  # (dim/2,)
    freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        freq = freq / rope.factor
    elif rope.type == "llama3":
        freq = _llama3(rope, freq)
    return freq


def _llama3(rope: Rope, freq: torch.Tensor) -> torch.Tensor:
    """``transformers``' ``_compute_llama3_parameters`` after its default frequencies, in its op
    order."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / rope.factor, freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin(rope: Rope, dim: int, t: int, device: torch.device, dtype: torch.dtype):
    """``(cos, sin)``, each (T, dim) in ``dtype`` on ``device``, for positions ``0 .. t-1``.

    Angles are formed in fp32 as HF's ``LlamaRotaryEmbedding.forward`` does, then cast.
    """
    positions = torch.arange(t, device=device).float()  # (T,)
    freqs = positions[:, None] * inv_freq(rope, dim).to(device=device)  # (T, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, dim): both halves share an angle
    return emb.cos().to(dtype), emb.sin().to(dtype)


def cos_sin_at(rope: Rope, dim: int, positions: torch.Tensor, dtype: torch.dtype):
    """``(cos, sin)``, each (B, 1, T, dim) in ``dtype``, at integer ``positions`` (B, T)
    (per-example positions of packed rows); the angles of ``cos_sin`` at each position, formed the
    same way in fp32."""
    freqs = positions.float()[..., None] * inv_freq(rope, dim).to(
        device=positions.device
    )  # (B, T, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, dim): broadcast over heads
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the halves of the last dimension; shape of ``x``."""
    x1, x2 = rearrange(x, "... (two d) -> two ... d", two=2)
    return torch.cat((-x2, x1), dim=-1)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, dim) by ``cos``/``sin`` (T, dim) or (B, 1, T, dim):
    ``x * cos + rotate_half(x) * sin``."""
    return x * cos + rotate_half(x) * sin  # (B, H, T, dim) * (T, dim) broadcasts over B, H
