"""The engine's compressed-moment update against one call of ``adamw_piece_`` over a unit's whole
row.

``unit_rows`` reads a unit's rows of every kind through the state interface
(``StateView.gather_row``: gathered over ranks, padding cut) and pads them back to whole blocks with
the values padding holds (zeros; int8 codes of 0.0), so a row is what one rank of a world of one
holds. ``one_call`` applies the gradient the engine applied to those rows in one ``adamw_piece_``
call over the whole row (element offset 0, the unit's index as seed): the engine cuts the row into
shards and pieces, so its bits must equal this at every world size, partition mode, placement and
piece size. The gradient applied is the clipped path's stashed "grad" row (times the clip
coefficient the step used).
"""

from __future__ import annotations

import torch
from engine_helpers import BETAS, EPS, LR, WD

import zinf_fn as zf
from zinf_fn.optim import compressed as C
from zinf_fn.optim import formats
from zinf_fn.optim.optimizers import clip_coefficient

HYPER = C.AdamWHyper(BETAS[0], BETAS[1], EPS, WD)
MOMENTS = {torch.float32: C.Fp32Moments, torch.bfloat16: C.Bf16Moments, torch.uint8: C.Int8Moments}
ZERO_CODES = tuple(
    int(c[0]) for c in C.init_moments(formats.MomentsFormat("int8"), formats.BLOCK)[::2]
)  # m, v


def opt(moments: str, **kw):
    return zf.adamw(
        lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD, moments=moments, **kw
    )


def train(state, data: list) -> tuple:
    """(the state, the losses, the last metrics) after a step on each batch of ``data``."""
    losses = []
    for batch in data:
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
    return state, losses, metrics


def unit_rows(v, unit, kinds: list[str]) -> dict[str, torch.Tensor]:
    """``unit``'s rows of ``kinds`` in their stored dtypes, whole and padded to whole blocks (a
    collective)."""
    numel = v.groups[unit.group].spec.numel
    int8 = v.dtype("opt.0", unit.group) == torch.uint8
    padded = -(-numel // formats.BLOCK) * formats.BLOCK if int8 else numel
    out = {}
    for kind in kinds:
        row = v.gather_row(kind, unit)
        dtype = v.dtype(kind, unit.group)
        row = row.to(
            dtype
        )  # gather_row upcasts 16-bit floats to fp32: exactly, so this is the stored row
        if not kind.endswith(".absmax") and row.numel() < padded:
            fill = ZERO_CODES[kind == "opt.1"] if dtype == torch.uint8 else 0
            row = torch.cat([row, torch.full((padded - row.numel(),), fill, dtype=dtype)])
        out[kind] = row
    return out


def applied_gradient(rows: dict, grad_norm: float, clip: float) -> torch.Tensor:
    """The gradient a clipped step applied: the stashed row times ``clip_coefficient`` (the engine's
    ``mul_``)."""
    scale = clip_coefficient(grad_norm, clip)
    return rows["grad"] if scale == 1.0 else rows["grad"].mul(scale)


def one_call(v, unit, before: dict, grad: torch.Tensor, step: int) -> dict:
    """``before`` (``unit_rows`` of the kinds after "param", with "param" where the master is a
    remainder) after one ``adamw_piece_`` of ``grad`` over the whole row: the rows the engine's
    update must have left."""
    rows = {k: t.clone() for k, t in before.items()}
    master = (
        C.RemainderMaster(rows["param"], rows["remainder"])
        if "remainder" in rows
        else rows["master"]
    )
    leaves = [k for k in v.kinds(group=unit.group) if k.startswith("opt.")]
    moments = MOMENTS[v.dtype("opt.0", unit.group)](*(rows[k] for k in leaves))
    C.adamw_piece_(grad, master, moments, HYPER, step, LR, 0, unit.index)
    return rows


def mismatches(v, unit, after: dict, want: dict) -> list[str]:
    """The kinds whose rows differ in a bit (an fp32 master's 16-bit copy is the engine's cast, not
    compared)."""
    return [
        f"{unit.name} {k}"
        for k in want
        if k != "param" or "remainder" in want
        if not torch.equal(after[k], want[k])
    ]
