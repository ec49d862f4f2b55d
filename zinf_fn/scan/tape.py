"""Pull-backs on plain autograd, and forwards recorded for a later pull-back (the checkpoint way).

``pull_back`` runs a function with its inputs as fresh leaves and pulls cotangents back to them:
``torch.func.vjp``'s contract. ``Tape`` splits that in two, as ``torch.utils.checkpoint``
(non-reentrant, early stop) does: the forward scan runs a block once, recording its autograd graph
with every tensor the backward will need dropped (saved-tensor hooks keep only its position); the
reverse scan later asks for the gradients, and the first unpack recomputes the dropped tensors,
stopping as soon as the last one the backward needs exists. So a block's trailing ops (its last
matmul and residual add) are run once in forward and never again, where a recompute from scratch has
to run the whole block to get an output to pull back from. The block reads its parameters and input
carry through a box: for the recompute the box holds the refetched layer and the restored boundary
carry, and the tensors the forward used are replaced in the graph by stride-0 placeholders, so the
graph keeps no layer buffer and no carry alive between forward and backward: only its nodes.

The hooks are this module's own (``_Recorded``), not ``torch.utils.checkpoint``'s, whose first call
imports ``torch._dynamo`` (~75 MiB of resident memory for the process, which an all-NVMe run's host
memory would count).

Inputs may be marked as taking no gradient (``still``: a frozen leaf, ``zinf_fn.formats.frozen``;
the input carry of a block whose cotangent nothing needs): they enter the graph with
``requires_grad=False``, so autograd computes no gradient for them (no dW of a frozen linear, and
saves no tensor only that gradient would need), and their gradients come back as None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.autograd.graph import saved_tensors_hooks


def pull_back(
    f: Callable, groups: list[list[torch.Tensor]], cotangents: tuple | Callable, still: tuple = ()
):
    """Run ``f(*groups)`` recording a graph, and pull ``cotangents`` back to every tensor of
    ``groups``. ``still``: per group, the indices of its tensors that take no gradient (None comes
    back for them).

    The contract of ``torch.func.vjp`` (gradients of unused inputs are zeros; outputs that do not
    depend on any input take no part), on plain autograd: the same kernels, bitwise the same
    gradients, without functorch's per-op wrapping (``benchmarks/block_backward.py`` compares the
    two). ``f`` returns a tuple of tensors; ``cotangents`` is a tuple like it, or a function of it.
    Returns (the outputs detached, the gradients as one list per group).
    """
    inputs = _leaves(groups, still)
    with torch.enable_grad():
        outputs = f(*inputs)
    if callable(cotangents):
        cotangents = cotangents(outputs)
    grads = _grads(outputs, cotangents, [x for group in inputs for x in group])
    return tuple(y.detach() for y in outputs), _regroup(grads, inputs)


def _leaves(groups: list[list[torch.Tensor]], still: tuple) -> list[list[torch.Tensor]]:
    """Fresh autograd leaves of ``groups``, those at ``still[g]`` of group g not requiring grad."""
    skip = [set(still[g]) if g < len(still) else set() for g in range(len(groups))]
    return [
        [_fresh_leaf(x, j not in skip[g]) for j, x in enumerate(group)]
        for g, group in enumerate(groups)
    ]


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
    ``pull_back`` does, bitwise the same; it can run once. ``still``: as ``pull_back``'s, for both
    runs. ``kept``: True where ``kept`` (``Kept``) had room for the run's saved activations, which
    the tape then holds: its pull-back recomputes nothing (a tiled op's backward fetches its tiles
    once, not again for a recompute).
    """

    def __init__(
        self,
        f: Callable,
        groups: list[list[torch.Tensor]],
        still: tuple = (),
        kept: Kept | None = None,
    ):
        self._still = still
        self._inputs = _leaves(groups, still)
        self._box = self._inputs
        recorded = _Recorded(lambda: f(*self._box), lambda: self._box, kept)
        with torch.enable_grad(), saved_tensors_hooks(recorded.pack, recorded.unpack):
            outputs = f(*self._box)
        recorded.settle()
        self._recorded = recorded
        self.kept = recorded.keeps()
        self.outputs = tuple(y.detach() for y in outputs)
        self._graph_outputs = outputs
        for t in (*self._flat_inputs(), *outputs):  # the graph keeps shapes and nodes, not memory
            t.data = _placeholder(t)
        self._box = None

    def pull_back(
        self, groups: list[list[torch.Tensor]], cotangents: tuple
    ) -> list[list[torch.Tensor]]:
        if self._graph_outputs is None:
            raise RuntimeError("Tape.pull_back: this tape was already pulled back")
        self._box = _leaves(groups, self._still)
        try:
            grads = _grads(self._graph_outputs, cotangents, self._flat_inputs())
        finally:
            self._box, self._graph_outputs = None, None
            self._recorded.forget()
            # it refers back to this tape (its box): no cycle left for the collector
            self._recorded = None
        return _regroup(grads, self._inputs)

    def _flat_inputs(self) -> list[torch.Tensor]:
        return [x for group in self._inputs for x in group]


class _StopRecompute(Exception):
    """Raised inside a recompute once every tensor the recorded run saved exists again."""


class Kept:
    """The bytes of activations the tapes of one step may keep from forward to backward
    (``Config.keep_activations``).

    A tape whose saved activations fit keeps them and is never recomputed; one that does not fit is
    recorded as ever (dropped, recomputed in backward). Bytes come back when a tape is pulled
    back."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def take(self, nbytes: int) -> bool:
        if self.held + nbytes > self.limit:
            return False
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.held -= nbytes


class _Input(NamedTuple):
    """A saved tensor that is a view of an input of the recorded run (a parameter leaf, the carry):
    rebuilt on the pull-back's inputs (the refetched layer, the restored carry) instead of kept or
    recomputed."""

    group: int
    leaf: int
    offset: int  # storage offset relative to that input's
    size: tuple
    stride: tuple


# a saved tensor in an input's storage but in no input leaf: the tape cannot keep it
_SHARED = object()


class _Recorded:
    """The saved tensors of one recorded run, by position: dropped when saved (``pack`` keeps the
    position), recomputed on the first ``unpack`` by running ``run`` again (on the box's new inputs)
    until the last of them is saved again, each handed out once. With room in ``kept`` (``Kept``)
    the run's saved activations are kept instead and views of its inputs rebuilt on ``box()``'s new
    ones: nothing is recomputed."""

    def __init__(
        self,
        run: Callable[[], object],
        box: Callable[[], list] | None = None,
        kept: Kept | None = None,
    ):
        self._run, self._again, self._box, self._kept = run, None, box, kept
        # (shape, dtype) of each tensor saved: what the recompute must save again
        self._shapes: list[tuple] = []
        self._held: dict[int, torch.Tensor | _Input] | None = (
            {} if kept is not None and kept.limit > 0 else None
        )
        self._nbytes, self._storages = 0, None

    def pack(self, tensor: torch.Tensor) -> int:
        self._shapes.append((tensor.shape, tensor.dtype))
        if self._held is not None:
            held = self._input_view(tensor)
            self._held[len(self._shapes) - 1] = tensor.detach() if held is None else held
        return len(self._shapes) - 1

    def settle(self) -> None:
        """After the recorded run: keep its activations if they fit in ``kept``, else drop them
        (recompute)."""
        if self._held is None:
            return
        # a pool buffer the next fetch may reuse: not kept
        if any(h is _SHARED for h in self._held.values()):
            self._held = None
            return
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in self._held.values()
            if isinstance(t, torch.Tensor)
        }
        self._nbytes = sum(storages.values())
        if not self._kept.take(self._nbytes):
            self._held, self._nbytes = None, 0

    def keeps(self) -> bool:
        """After ``settle``: whether the run's saved activations are kept (no recompute)."""
        return self._held is not None

    def forget(self) -> None:
        """The pull-back is done: the kept bytes go back to ``kept``."""
        if self._nbytes:
            self._kept.give(self._nbytes)
        self._held, self._nbytes = None, 0

    def _input_view(self, tensor: torch.Tensor):
        """An ``_Input`` where ``tensor`` starts within an input leaf's memory; ``_SHARED`` where it
        shares an input's storage elsewhere (the layer's padding, another dtype); None for an
        activation of its own."""
        # (storage, group, leaf, offset, numel, dtype) of the recorded run's inputs
        if self._storages is None:
            self._storages = [
                (x.untyped_storage().data_ptr(), g, j, x.storage_offset(), x.numel(), x.dtype)
                for g, group in enumerate(self._box())
                for j, x in enumerate(group)
            ]
        ptr, shared = tensor.untyped_storage().data_ptr(), False
        for storage, g, j, start, numel, dtype in self._storages:
            if storage != ptr or ptr == 0:
                continue
            offset, shared = tensor.storage_offset() - start, True
            if dtype == tensor.dtype and 0 <= offset < numel:
                return _Input(g, j, offset, tuple(tensor.shape), tensor.stride())
        return _SHARED if shared else None

    def unpack(self, position: int) -> torch.Tensor:
        if self._held is not None:
            return self._unpack_held(position)
        if self._again is None:
            self._recompute()
        if position not in self._again:
            raise RuntimeError(
                f"Tape: saved tensor {position} of the recorded run was unpacked twice; a "
                "backward reads each of its ctx.saved_tensors once"
            )
        return self._again.pop(position)

    def _unpack_held(self, position: int) -> torch.Tensor:
        if position not in self._held:
            raise RuntimeError(
                f"Tape: saved tensor {position} of the recorded run was unpacked twice; a "
                "backward reads each of its ctx.saved_tensors once"
            )
        held = self._held.pop(position)
        if isinstance(held, torch.Tensor):
            return held
        x = self._box()[held.group][held.leaf]
        with torch.no_grad():
            view = torch.empty(0, dtype=x.dtype, device=x.device)
            return view.set_(
                x.untyped_storage(), x.storage_offset() + held.offset, held.size, held.stride
            )

    def _recompute(self) -> None:
        again: dict[int, torch.Tensor] = {}

        def pack(x: torch.Tensor) -> None:
            i = len(again)
            if i >= len(self._shapes) or (x.shape, x.dtype) != self._shapes[i]:
                want = self._shapes[i] if i < len(self._shapes) else "nothing more"
                raise RuntimeError(
                    f"Tape: the recompute saved {tuple(x.shape)} {x.dtype} as tensor {i}, the "
                    "recorded "
                    f"run {want}: a recorded block must run the same ops on its "
                    "inputs every time"
                )
            again[i] = x.detach() if x.requires_grad else x
            if len(again) == len(self._shapes):
                raise _StopRecompute  # the rest of the run saves nothing the backward needs

        def unpack(_):
            raise RuntimeError("Tape: the recompute's own graph is never pulled back")

        self._again = again
        try:
            with torch.enable_grad(), saved_tensors_hooks(pack, unpack):
                self._run()
        except _StopRecompute:
            pass
        if len(again) != len(self._shapes):
            raise RuntimeError(
                f"Tape: the recompute saved {len(again)} tensors, the recorded run "
                f"{len(self._shapes)}: a recorded block must run the same ops on "
                "its inputs every time"
            )


def _grads(
    outputs: tuple, cotangents: tuple, inputs: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Gradients of ``outputs`` (with ``cotangents``) wrt ``inputs``; zeros where an input is
    unused, None where it takes no gradient (``requires_grad`` False)."""
    pairs = [(y, c) for y, c in zip(outputs, cotangents, strict=True) if y.requires_grad]
    wanted = [x for x in inputs if x.requires_grad]
    if not pairs or not wanted:
        return [
            torch.zeros(x.shape, dtype=x.dtype, device=x.device) if x.requires_grad else None
            for x in inputs
        ]
    grads = iter(
        torch.autograd.grad(
            [y for y, _ in pairs],
            wanted,
            [c for _, c in pairs],
            allow_unused=True,
            materialize_grads=True,
        )
    )
    return [next(grads) if x.requires_grad else None for x in inputs]


def _regroup(flat: list, groups: list[list]) -> list[list]:
    out, start = [], 0
    for group in groups:
        out.append(list(flat[start : start + len(group)]))
        start += len(group)
    return out


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``t`` that holds one element (stride 0): metadata without the memory."""
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)
