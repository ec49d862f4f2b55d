"""A plain-torch reference of the compressed AdamW update, op by op
(tests/optim/test_compressed_update.py compares the kernels against it bitwise; the checkpoint tests
use its quantization and rounding).

The reference rounds every operation to fp32 as the kernels do. One deliberate choice: its sqrt is
``v.double().sqrt().float()``, the correctly rounded fp32 sqrt (double has 53 >= 2 * 24 + 2 bits, so
rounding twice is exact), because eager ``torch.sqrt`` of a large CPU tensor runs MKL's vector sqrt,
which is off by an ulp on ~20 % of inputs; the kernels and torch's fused AdamW use the correctly
rounded instruction.
"""

from __future__ import annotations

import math

import torch

from zinf_fn.optim import compressed as C
from zinf_fn.optim import formats

HYPER = C.AdamWHyper(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
M32 = 0xFFFFFFFF


# -- the reference: plain torch, every operation in fp32
# --------------------------------------------------
def ref_adamw(p, g, m, v, hyper, step, lr, decayed):
    """torch's AdamW formula (fused kernel's order); ``decayed``: bool mask of the elements that
    decay."""
    f32 = lambda x: torch.tensor(
        x, dtype=torch.float32
    )  # a host scalar rounded to fp32, as torch's kernel
    t = step + 1
    p = p * torch.where(decayed, f32(1.0 - lr * hyper.weight_decay), f32(1.0))
    m = m + f32(1.0 - hyper.b1) * (g - m)
    v = v * f32(hyper.b2) + f32(1.0 - hyper.b2) * g * g
    denom = v.double().sqrt().float() / f32(math.sqrt(1.0 - hyper.b2**t)) + f32(hyper.eps)
    return p - f32(lr / (1.0 - hyper.b1**t)) * m / denom, m, v


def ref_quantize(x, code):
    """bitsandbytes' block-wise quantization (its torch backend): nearest code of x / absmax, per
    256 block."""
    blocks = x.view(-1, 256)
    absmax = blocks.abs().amax(dim=1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1)
    codes = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2).to(torch.uint8)
    return codes.view(-1), absmax


def ref_dequantize(codes, absmax, code):
    return (code[codes.long()].view(-1, 256) * absmax[:, None]).view(-1)


def ref_hash(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & M32
    return x ^ (x >> 16)


def ref_stochastic_bf16(x, offset, unit_seed, step, high):
    """The bf16 format's rounding: 16 bits of hash(index ^ hash(hash(seed) ^ step)) added, then
    truncated."""
    key = ref_hash(ref_hash(torch.tensor(unit_seed)) ^ step)
    h = ref_hash((torch.arange(x.numel()) + offset) ^ key)
    noise = (h >> 16) if high else (h & 0xFFFF)
    hi = (((x.view(torch.int32).long() & M32) + noise) >> 16) & 0xFFFF
    return ((hi ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16)


def ref_update(grad, p, moments, step, lr, decayed, offset=0, unit_seed=0):
    """(new fp32 master, new moments) of one piece, by the reference."""
    if isinstance(moments, C.Int8Moments):
        code_m, code_v = formats.dynamic_map(True), formats.dynamic_map(False)
        m = ref_dequantize(moments.m_codes, moments.m_absmax, code_m)
        v = ref_dequantize(moments.v_codes, moments.v_absmax, code_v)
        p, m, v = ref_adamw(p, grad, m, v, HYPER, step, lr, decayed)
        return p, C.Int8Moments(*ref_quantize(m, code_m), *ref_quantize(v, code_v))
    p, m, v = ref_adamw(p, grad, moments.m.float(), moments.v.float(), HYPER, step, lr, decayed)
    return p, C.Bf16Moments(
        *(
            ref_stochastic_bf16(x, offset, unit_seed, step, high)
            for x, high in ((m, False), (v, True))
        )
    )
