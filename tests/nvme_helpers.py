"""Reading every row of a tier or a state back, bitwise: the helpers of the NVMe tests."""

from __future__ import annotations

import torch

from zinf_fn.state import key, view


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so that NaN payloads and -0.0 compare too."""
    return t.contiguous().view(torch.uint8)


def all_states(state) -> dict[str, torch.Tensor]:
    """Params, master, moments (and stashed grads): every array of both tiers as (rows this rank holds,
    numel) tensors, keyed "param:<group>/param" or "opt:<group>/<kind>"; read through ``zinf_fn.state``."""
    v, out = view(state), {}
    held = {}
    for row in v.rows():
        held.setdefault(row.group, []).append(row.row)
    for kind in v.kinds(grads=True):
        for group, rows in held.items():
            full = torch.empty(len(rows), v.shard_numel(group), dtype=v.dtype(kind))
            for i, r in enumerate(sorted(rows)):
                v.read_(kind, group, r, full[i]).result()   # sync: read
            out[f"{'param' if kind == 'param' else 'opt'}:{key(group, kind)}"] = full
    return out
