"""A unit's gradient on its way out of the reverse scan: a flat fp32 buffer, or its leaves as they
came.

The flat buffer is what a reduce-scatter, a stash on the optimizer tier or an accumulation over
micro-batches needs. When none of those happens (one rank, one micro-batch, no clipping, fp32
gradients on the optimizer's device), ``LeafGrads`` hands the vjp's own leaf tensors to the update,
which runs on each leaf's span of the flat master and moments: the copy into a flat buffer (one pass
over the layer) is skipped, and the values are the same elementwise.
"""

from __future__ import annotations

import torch

from ..tree import FlatSpec


def keeps_leaf_grads(
    world_size: int,
    micro_batches: int,
    clipping: bool,
    compute_dtype: torch.dtype,
    device: torch.device,
    opt_device: torch.device,
) -> bool:
    """Whether a step's unit gradients skip the flat buffer (``LeafGrads``): nothing needs one, as
    the module says. The one rule: the runtime asks it once, at construction (a step's micro-batches
    are always ``Config.grad_accum``), the gradients' demand (``optim.backlog.demand``) to count
    them as the vjp's tensors rather than pool buffers."""
    return (
        world_size == 1
        and micro_batches == 1
        and not clipping
        and compute_dtype == torch.float32
        and device == opt_device
    )


class LeafGrads:
    """One micro-batch's gradient of a unit, as ``(offset, flat leaf)`` spans of the flat layout."""

    def __init__(self, spec: FlatSpec):
        self.spec = spec
        self.leaves: list[torch.Tensor] | None = None

    def accumulate_(self, d_leaves: list[torch.Tensor], first: bool, keep: tuple = ()) -> None:
        """Take the leaves (the update may use them as scratch): a leaf sharing memory with another
        leaf or with a tensor of ``keep`` (a cotangent the scan still needs) is cloned first."""
        if not first or self.leaves is not None:
            raise RuntimeError(
                "LeafGrads holds one micro-batch's gradient; accumulation needs a flat buffer"
            )
        taken = {t.untyped_storage().data_ptr() for t in keep if isinstance(t, torch.Tensor)}
        self.leaves = []
        for g in d_leaves:
            if g is None:  # a frozen leaf's anchor: no gradient, no span
                self.leaves.append(None)
                continue
            g = g.reshape(-1)
            if g.untyped_storage().data_ptr() in taken:
                g = g.clone()
            taken.add(g.untyped_storage().data_ptr())
            self.leaves.append(g)

    def spans(self) -> list[tuple[int, torch.Tensor]]:
        """``(offset, flat leaf)`` of every leaf not released yet, in layout order."""
        if self.leaves is None:
            raise RuntimeError("LeafGrads: no gradient was accumulated")
        return [
            (leaf.offset, g)
            for leaf, g in zip(self.spec.leaves, self.leaves, strict=True)
            if g is not None
        ]

    def release_through(self, end: int) -> None:
        """Drop the leaves that end at or before flat offset ``end`` (a piece-wise update is past
        them), so a layer's gradient leaves memory as its update goes, not all at its end."""
        for i, leaf in enumerate(self.spec.leaves):
            if leaf.offset + leaf.numel <= end:
                self.leaves[i] = None

    def sq_norm(self) -> torch.Tensor:
        """Sum over leaves (in layout order) of the squared norm, in float64."""
        total = torch.zeros((), dtype=torch.float64)
        for _, g in self.spans():
            total += torch.dot(g, g).double().cpu()
        return total


def accumulate_(
    target: torch.Tensor | LeafGrads | None,
    spec: FlatSpec,
    d_leaves: list,
    first: bool,
    keep: tuple = (),
) -> None:
    """target[leaf] (+)= d_leaf for every leaf; the first micro-batch copies (0 + g == g exactly). A
    None gradient (a frozen leaf's, stored apart: its slot is a zero-size anchor) adds nothing; a
    None ``target`` (a unit none of whose leaves trains, ``zinf_fn.formats.frozen``) takes
    nothing."""
    if target is None:
        return
    if isinstance(target, LeafGrads):
        target.accumulate_(d_leaves, first, keep)
        return
    for leaf, g in zip(spec.leaves, d_leaves, strict=True):
        if g is None:
            continue
        dst = target[leaf.offset : leaf.offset + leaf.numel]
        if first:
            dst.copy_(g.reshape(-1))
        else:
            dst.add_(g.reshape(-1))
