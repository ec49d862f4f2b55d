"""Learning-rate schedules of the step: a linear warmup, then cosine, linear or constant."""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")


def warmup_then(kind: str, peak: float, warmup: int, total: int, floor: float = 0.1):
    """lr(step): linear from ``peak / warmup`` up to ``peak`` over ``warmup`` steps, then ``kind``:
    "cosine" or "linear" down to ``floor * peak`` at step ``total``, or "constant" at ``peak``.

    transformers' ``get_cosine_schedule_with_warmup`` is ``floor=0`` (its warmup starts at 0, this
    one at ``peak / warmup``, so that step 0 trains).
    """
    if kind not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {kind!r}")
    if not 0 <= floor <= 1:
        raise ValueError(f"lr_floor: expected a fraction of lr in [0, 1], got {floor}")

    def lr(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "constant":
            return peak
        if kind == "linear":
            return peak * (1 - (1 - floor) * progress)
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

    return lr


def decays(path: str) -> bool:
    """Whether weight decay applies to the leaf at ``path`` (``blocks.3.attn.q.w``): not to biases
    (a last name ``b`` or ``bias``) nor to norm weights (a name containing ``norm`` or starting with
    ``ln``), as transformers' Trainer leaves out biases and LayerNorm / RMSNorm weights."""
    names = path.split(".")
    if names[-1] in ("b", "bias"):
        return False
    return not any("norm" in n or n.startswith("ln") for n in names[:-1])
