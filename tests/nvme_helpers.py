"""The helpers of the NVMe tests: every row of a tier or a state read back bitwise, a written head
row, and a gate that holds chosen O_DIRECT writes in flight."""

from __future__ import annotations

import os
import re
import threading

import torch
from engine_internals import wrap_pwrite

from zinf_fn.offload.nvme import NvmeTier
from zinf_fn.state import key, view


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so that NaN payloads and -0.0 compare too."""
    return t.contiguous().view(torch.uint8)


def all_states(state) -> dict[str, torch.Tensor]:
    """Params, master, moments (and stashed grads): every array of both tiers as (rows this rank
    holds, numel) tensors, keyed "param:<group>/param" or "opt:<group>/<kind>"; read through
    ``zinf_fn.state``."""
    v, out = view(state), {}
    held = {}
    for row in v.rows():
        held.setdefault(row.group, []).append(row.row)
    for kind in v.kinds(grads=True):
        for group, rows in held.items():
            full = torch.empty(len(rows), v.shard_numel(group), dtype=v.dtype(kind))
            for i, r in enumerate(sorted(rows)):
                v.read_(kind, group, r, full[i]).result()  # sync: read
            out[f"{'param' if kind == 'param' else 'opt'}:{key(group, kind)}"] = full
    return out


def head_row_written(tmp_path) -> tuple[NvmeTier, torch.Tensor]:
    """A tier with one 5000-element bf16 row, ``head/param`` row 0, written and durable."""
    tier = NvmeTier(tmp_path, "rank0/params")
    tier.allocate("head/param", 1, 5000, torch.bfloat16)
    good = torch.randn(5000).bfloat16()
    tier.write_("head/param", 0, good).result()
    return tier, good


class Gate:
    """Holds every write request to a file whose path matches ``part`` (a regular expression,
    searched) until ``open()``; then lets it through, or fails it with ``error``."""

    def __init__(self, monkeypatch, part: str, error: OSError | None = None):
        self.part, self.error = part, error
        self.opened = threading.Event()
        self.arrived = threading.Event()
        self.held = 0
        wrap_pwrite(monkeypatch, self.gated)

    def gated(self, real):
        def pwrite(fd, mem, offset):
            if re.search(self.part, os.readlink(f"/proc/self/fd/{fd}")):
                self.held += 1
                self.arrived.set()
                assert self.opened.wait(timeout=120), "the gate was never opened"
                if self.error is not None:
                    raise self.error
            real(fd, mem, offset)

        return pwrite

    def open(self) -> None:
        self.opened.set()

    def holding(self, timeout: float = 60.0) -> bool:
        """Whether a write reached the gate (the write-behind issues it on its own thread: wait for
        it)."""
        return self.arrived.wait(timeout)
