"""gpt-oss's MXFP4 expert weights, dequantized at import; other ``quantization_config``\\s refused.

A real gpt-oss checkpoint (``quantization_config.quant_method`` "mxfp4") stores each expert
projection ``P`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) as two uint8 tensors::

    P_blocks  (E, R, G, 16)   two FP4 (e2m1) codes a byte, low nibble first: 32 values of a block
    P_scales  (E, R, G)       the block's shared power-of-two exponent, biased by 127 (E8M0)

R rows (output features), G blocks of 32 input features. ``dequantize`` computes what transformers'
``integrations.mxfp4.convert_moe_packed_tensors`` does, op for op (a table lookup of the codes, then
``ldexp`` by the exponent), and returns its layout: the unquantized on-disk tensor ``P`` (E, G*32,
R), input x output, which ``layers.moe_names``' gpt-oss rules then read as any unquantized gpt-oss
file. ``Mxfp4Weights`` wraps a checkpoint's tensors so each ``P_blocks``/``P_scales`` pair reads as
``P``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from .manifest import CheckpointError

FP4_VALUES = (
    +0.0,
    +0.5,
    +1.0,
    +1.5,
    +2.0,
    +3.0,
    +4.0,
    +6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)  # e2m1 by its 4-bit code
SCALE_BIAS = 127
BLOCKS = "_blocks"
SCALES = "_scales"
QUANT_METHODS = ("mxfp4",)


class Weights(Protocol):
    """A checkpoint's tensors by name, as ``hf_files.HFWeights`` offers them."""

    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def get(self, name: str) -> torch.Tensor: ...
    def locate(self, name: str) -> str: ...


def quantization(hf_config: Mapping) -> str | None:
    """The quantization a ``config.json`` dict declares: None (none) or "mxfp4" (gpt-oss only).
    Raises ``CheckpointError`` naming ``quantization_config`` or its ``quant_method`` for anything
    else."""
    quant = hf_config.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    if method not in QUANT_METHODS:
        raise CheckpointError(
            f"config.json: quantization_config.quant_method={method!r} is not "
            f"supported; expected one of {QUANT_METHODS} (gpt-oss's experts) or "
            "no quantization_config (dequantize it with transformers first)"
        )
    if hf_config.get("model_type") != "gpt_oss":
        raise CheckpointError(
            f"config.json: quantization_config.quant_method 'mxfp4' with "
            f"model_type {hf_config.get('model_type')!r}; expected model_type "
            "'gpt_oss'"
        )
    return method


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``blocks`` (E, R, G, 16) and ``scales`` (E, R, G) uint8 -> (E, G*32, R) in ``dtype``, one
    expert at a time (the index tensors stay one expert's size); equal to transformers'
    dequantization."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(
            f"mxfp4: expected uint8 blocks and scales, got {blocks.dtype} and {scales.dtype}"
        )
    paired = tuple(blocks.shape[:-1]) == tuple(scales.shape)
    if blocks.ndim != 4 or blocks.shape[-1] != 16 or not paired:
        raise CheckpointError(
            f"mxfp4: expected blocks (E, R, G, 16) and scales (E, R, G), got "
            f"{tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    n_experts, rows, groups, _ = blocks.shape
    out = torch.empty(n_experts, groups * 32, rows, dtype=dtype, device=blocks.device)
    for e in range(n_experts):
        out[e] = _dequantize_expert(blocks[e], scales[e], lut).mT
    return out


def _dequantize_expert(
    blocks: torch.Tensor, scales: torch.Tensor, lut: torch.Tensor
) -> torch.Tensor:
    """One expert: (R, G, 16) codes and (R, G) exponents -> (R, G*32), in ``lut``'s dtype."""
    rows, groups, width = blocks.shape
    codes = blocks.reshape(rows * groups, width)  # (R*G, 16) bytes
    exponents = scales.to(torch.int32).reshape(rows * groups, 1) - SCALE_BIAS  # (R*G, 1)
    values = torch.empty(rows * groups, width * 2, dtype=lut.dtype, device=blocks.device)
    values[:, 0::2] = lut[(codes & 0x0F).to(torch.int)]  # the low nibble is the first value
    values[:, 1::2] = lut[(codes >> 4).to(torch.int)]
    torch.ldexp(values, exponents, out=values)
    return values.reshape(rows, groups * width * 2)


class Mxfp4Weights:
    """``weights`` with every ``P_blocks``/``P_scales`` pair read as the dequantized ``P`` (in
    ``dtype``): ``names()`` lists ``P`` in the pair's place, ``shape(P)`` is (E, G*32, R),
    ``get(P)`` dequantizes."""

    def __init__(self, weights: Weights, dtype: torch.dtype = torch.float32):
        self.weights = weights
        self.dtype = dtype
        names = weights.names()
        self.packed = {name[: -len(BLOCKS)] for name in names if name.endswith(BLOCKS)}
        unpaired = sorted(p for p in self.packed if p + SCALES not in names)
        scales = [n for n in names if n.endswith(SCALES)]
        unpaired += sorted(n for n in scales if n[: -len(SCALES)] not in self.packed)
        if unpaired:
            raise CheckpointError(
                f"mxfp4: {unpaired} lack their partner; expected every P_blocks "
                "beside its P_scales (and each P_scales beside its P_blocks)"
            )

    @property
    def where(self) -> str:
        """The checkpoint's files, as the wrapped weights name them (for errors)."""
        return self.weights.where

    def names(self) -> list[str]:
        out = [n for n in self.weights.names() if not n.endswith(SCALES)]
        return [n[: -len(BLOCKS)] if n.endswith(BLOCKS) else n for n in out]

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.packed:
            return self.weights.shape(name)
        n_experts, rows, groups, _ = self.weights.shape(name + BLOCKS)
        return n_experts, groups * 32, rows

    def get(self, name: str) -> torch.Tensor:
        if name not in self.packed:
            return self.weights.get(name)
        blocks = self.weights.get(name + BLOCKS)
        return dequantize(blocks, self.weights.get(name + SCALES), self.dtype)

    def locate(self, name: str) -> str:
        return self.weights.locate(name + BLOCKS if name in self.packed else name)
