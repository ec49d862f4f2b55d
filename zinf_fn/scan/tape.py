"""Pull-backs on plain autograd, and forwards recorded for a later pull-back (the checkpoint way).

``pull_back`` runs a function with its inputs as fresh leaves and pulls cotangents back to them:
``torch.func.vjp``'s contract. ``Tape`` splits that in two, as ``torch.utils.checkpoint``
(non-reentrant) does: the forward scan runs a block once, recording its autograd graph with every
tensor the backward will need dropped (saved-tensor hooks); the reverse scan later asks for the
gradients, and the hooks recompute the dropped tensors, stopping as soon as the last one the
backward needs exists. So a block's trailing ops (its last matmul and residual add) are run once in
forward and never again, where a recompute from scratch has to run the whole block to get an output
to pull back from. The block reads its parameters and input carry through a box: for the recompute
the box holds the refetched layer and the restored boundary carry, and the tensors the forward used
are replaced in the graph by stride-0 placeholders, so the graph keeps no layer buffer and no carry
alive between forward and backward: only its nodes.

Inputs may be marked as taking no gradient (``still``: a frozen leaf, ``zinf_fn.frozen``; the input carry of
a block whose cotangent nothing needs): they enter the graph with ``requires_grad=False``, so autograd
computes no gradient for them (no dW of a frozen linear, and saves no tensor only that gradient would
need), and their gradients come back as None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def pull_back(f: Callable, groups: list[list[torch.Tensor]], cotangents: tuple | Callable, still: tuple = ()):
    """Run ``f(*groups)`` recording a graph, and pull ``cotangents`` back to every tensor of ``groups``.
    ``still``: per group, the indices of its tensors that take no gradient (None comes back for them).

    The contract of ``torch.func.vjp`` (gradients of unused inputs are zeros; outputs that do not
    depend on any input take no part), on plain autograd: the same kernels, bitwise the same gradients,
    without functorch's per-op wrapping (``benchmarks/block_backward.py`` compares the two). ``f``
    returns a tuple of tensors; ``cotangents`` is a tuple like it, or a function of it. Returns (the
    outputs detached, the gradients as one list per group).
    """
    inputs = _leaves(groups, still)
    with torch.enable_grad():
        outputs = f(*inputs)
    if callable(cotangents):
        cotangents = cotangents(outputs)
    grads = _grads(outputs, cotangents, [x for group in inputs for x in group])
    return tuple(y.detach() for y in outputs), _split(grads, inputs)


def _leaves(groups: list[list[torch.Tensor]], still: tuple) -> list[list[torch.Tensor]]:
    """Fresh autograd leaves of ``groups``, those at ``still[g]`` of group g not requiring grad."""
    skip = [set(still[g]) if g < len(still) else set() for g in range(len(groups))]
    return [[_fresh_leaf(x, j not in skip[g]) for j, x in enumerate(group)] for g, group in enumerate(groups)]


def _fresh_leaf(x: torch.Tensor, grad: bool = True) -> torch.Tensor:
    """x's memory as a new autograd leaf with a version counter of its own.

    ``detach`` would share x's counter, which every row of a tier array shares: the update worker's
    in-place writes to *other* rows would then fail autograd's saved-tensor check in this backward.
    """
    with torch.no_grad():
        leaf = torch.empty(0, dtype=x.dtype, device=x.device)
        leaf.set_(x.untyped_storage(), x.storage_offset(), x.size(), x.stride())
    return leaf.requires_grad_(grad)


class Tape:
    """``f(*groups)`` run now with its graph recorded and no activation kept; ``pull_back`` later.

    ``outputs`` are f's outputs, detached. ``pull_back(groups, cotangents)`` takes the same inputs
    again (equal values: the refetched layer, the restored carry) and returns the gradients as
    ``pull_back`` does, bitwise the same; it can run once. ``still``: as ``pull_back``'s, for both runs.
    """

    def __init__(self, f: Callable, groups: list[list[torch.Tensor]], still: tuple = ()):
        self._still = still
        self._inputs = _leaves(groups, still)
        self._box = self._inputs
        with torch.enable_grad():
            outputs = checkpoint(lambda: f(*self._box), use_reentrant=False, preserve_rng_state=False)
        self.outputs = tuple(y.detach() for y in outputs)
        self._graph_outputs = outputs
        for t in (*self._flat_inputs(), *outputs):   # the graph keeps shapes and nodes, not memory
            t.data = _placeholder(t)
        self._box = None

    def pull_back(self, groups: list[list[torch.Tensor]], cotangents: tuple) -> list[list[torch.Tensor]]:
        if self._graph_outputs is None:
            raise RuntimeError("Tape.pull_back: this tape was already pulled back")
        self._box = _leaves(groups, self._still)
        try:
            grads = _grads(self._graph_outputs, cotangents, self._flat_inputs())
        finally:
            self._box, self._graph_outputs = None, None
        return _split(grads, self._inputs)

    def _flat_inputs(self) -> list[torch.Tensor]:
        return [x for group in self._inputs for x in group]


def _grads(outputs: tuple, cotangents: tuple, inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Gradients of ``outputs`` (with ``cotangents``) wrt ``inputs``; zeros where an input is unused, None
    where it takes no gradient (``requires_grad`` False)."""
    pairs = [(y, c) for y, c in zip(outputs, cotangents, strict=True) if y.requires_grad]
    wanted = [x for x in inputs if x.requires_grad]
    if not pairs or not wanted:
        return [torch.zeros(x.shape, dtype=x.dtype, device=x.device) if x.requires_grad else None for x in inputs]
    grads = iter(torch.autograd.grad([y for y, _ in pairs], wanted, [c for _, c in pairs], allow_unused=True,
                                     materialize_grads=True))
    return [next(grads) if x.requires_grad else None for x in inputs]


def _split(flat: list, groups: list[list]) -> list[list]:
    out, start = [], 0
    for group in groups:
        out.append(list(flat[start : start + len(group)]))
        start += len(group)
    return out


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``t`` that holds one element (stride 0): metadata without the memory."""
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)
