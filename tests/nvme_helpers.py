"""Reading every row of a tier or a state back, bitwise: the helpers of the NVMe tests."""

from __future__ import annotations

import torch

from zinf_fn.offload.nvme import NvmeTier


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so that NaN payloads and -0.0 compare too."""
    return t.contiguous().view(torch.uint8)


def tier_rows(tier) -> dict[str, torch.Tensor]:
    """Every array of a tier, read back row by row into (rows, numel) tensors (the rows this rank stores)."""
    tier = getattr(tier, "inner", tier)   # broadcast mode wraps the tier to map global rows to owned ones
    out = {}
    for key in tier.keys():
        rows, numel, dtype = _shape(tier, key)
        full = torch.empty(rows, numel, dtype=dtype)
        for r in range(rows):
            tier.read_(key, r, full[r]).result()
        out[key] = full
    return out


def _shape(tier, key):
    if isinstance(tier, NvmeTier):
        arr = tier._arrays[key]
        return arr.rows, arr.numel, arr.dtype
    arr = tier._arrays[key]
    return arr.shape[0], arr.shape[1], arr.dtype


def all_states(state) -> dict[str, torch.Tensor]:
    """Params, master, moments: every array of both tiers, keyed by tier role and array key."""
    store = state.runtime.store
    return {**{f"param:{k}": v for k, v in tier_rows(store.param_tier).items()},
            **{f"opt:{k}": v for k, v in tier_rows(store.opt_tier).items()}}
