"""LoRA on stacked expert linears, and its correspondence with PEFT's ``target_parameters`` adapter.

An expert leaf ``{"w": (E, out, in)}`` adapted holds ``"lora_a"`` (E, r, in) and ``"lora_b"``
(E, out, r): expert e adds ``B[e] @ A[e]`` (times alpha / r) to its weight, the per-expert low-rank
update PEFT's ``lora.ParamWrapper`` puts on a 3-D ``nn.Parameter`` (``target_parameters``:
``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``). PEFT keeps the experts' factors side by
side in two ``nn.Linear`` weights::

    lora_A.weight (r*E, in)    row e*r + j      = A[e][j]
    lora_B.weight (out, r*E)   column j*E + e   = B[e][:, j]

``from_peft`` and ``to_peft`` move between the two (reshapes and permutes, so a round trip is
bitwise). gpt-oss's ``gate_up_proj`` interleaves gate and up outputs where our ``gate_up`` leaf has
the gates first, so its B rows are regrouped (``interleaved=True``).
"""

from __future__ import annotations

import math

import torch


def init(gen: torch.Generator, rank: int, n_experts: int, d_in: int, d_out: int) -> dict:
    """``{"lora_a": (E, r, in), "lora_b": (E, out, r) zeros}`` in fp32: A drawn as PEFT's
    ``kaiming_uniform_(a=sqrt(5))`` over the (r*E, in) ``lora_A`` weight (U(+-1/sqrt(in))), so the
    adapted experts start equal to the base ones."""
    a = torch.empty(rank * n_experts, d_in, device=gen.device, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
    b = torch.zeros(n_experts, d_out, rank, device=gen.device, dtype=torch.float32)
    return {"lora_a": a.reshape(n_experts, rank, d_in), "lora_b": b}


def from_peft(
    lora_a: torch.Tensor, lora_b: torch.Tensor, n_experts: int, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ``lora_A.weight`` (r*E, in) and ``lora_B.weight`` (out, r*E) -> our (E, r, in) and
    (E, out, r); ``interleaved``: B's rows alternate gate and up (gpt-oss), ours have the gates
    first."""
    if lora_a.shape[0] % n_experts or lora_b.shape[1] != lora_a.shape[0]:
        raise ValueError(
            f"moe_lora.from_peft: expected lora_A (r*E, in) and lora_B (out, r*E) for "
            f"E={n_experts}, got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}"
        )
    rank = lora_a.shape[0] // n_experts
    a = lora_a.reshape(n_experts, rank, lora_a.shape[1])  # (E, r, in)
    b = lora_b.reshape(lora_b.shape[0], rank, n_experts).permute(2, 0, 1)  # (E, out, r)
    if interleaved:
        b = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)  # gate rows, then up rows
    return a.contiguous(), b.contiguous()


def to_peft(
    lora_a: torch.Tensor, lora_b: torch.Tensor, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our (E, r, in) and (E, out, r) -> PEFT's ``lora_A.weight`` (r*E, in) and ``lora_B.weight``
    (out, r*E); the inverse of ``from_peft``."""
    n_experts, rank, d_in = lora_a.shape
    b = lora_b
    if interleaved:
        gate, up = b.chunk(2, dim=1)
        b = torch.stack((gate, up), dim=2).reshape(b.shape)  # rows alternate gate, up
    a = lora_a.reshape(n_experts * rank, d_in)
    b = b.permute(1, 2, 0).reshape(b.shape[1], rank * n_experts)  # column j*E + e
    return a.contiguous(), b.contiguous()
