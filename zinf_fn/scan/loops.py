"""The scan-over-layers runtime: forward keeping boundary carries, reverse scan with a vjp per
layer.

Every function here equals the plain loop of ``zinf_fn.model.plain_loss`` with autograd; the
difference is only what is resident: one layer's parameters and activations at a time, plus the
boundary carries (the inputs of each layer, one per micro-batch). In training the forward records
each block's graph without its activations (``tape.Tape``), so the reverse scan recomputes only
what the backward needs, on the refetched layer and the restored carry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import optree
import torch

from ..layout.units import head_index, reused
from ..model import block_apply
from ..tree import FlatSpec
from .blocks import _float_leaves, block_forward, block_record, block_vjp, embed_vjp, head_vjp
from .grads import LeafGrads, accumulate_
from .tape import Kept


class ScanOptions(NamedTuple):
    """How one step's scans run, fixed for the step: what the loops read besides the ``ScanIO``
    calls.

    ``checkpoints`` keeps the boundary carries (``keep(l, carries) -> token``, ``restore(l, token)
    -> carries``, ``forget(l)``); None keeps them as they are, in the list. ``record_blocks``: the
    training forward records each block's graph (``tape.Tape``) so that the backward recomputes only
    what it needs (tiled blocks too: their ops hold a late-bound tile handle,
    ``tiling.handles.TileHandle``); False recomputes every block from scratch. ``loss_scale``: set
    for a model whose head returns a ``TokenLoss``: the head's cotangent of every micro-batch's loss
    sum (None: 1 / micro-batches). ``embed_trains`` False: nothing of the embedding trains, so
    neither its backward nor block 0's carry cotangent runs (the plan fetches no embedding in
    backward).
    """

    checkpoints: Any = None
    record_blocks: bool = True  # False: blocks are recomputed from scratch in backward, no tape
    # a TokenLoss head: world_size / (target tokens of the global batch)
    loss_scale: float | None = None
    # False: no embedding backward, no cotangent of block 0's input carry
    embed_trains: bool = True
    # bytes of recorded blocks' activations a step may keep (tape.Kept): no recompute
    keep_activations: int = 0
    # the forward's last blocks held into the backward, which the plan does not refetch
    # (units.reused)
    reuse: int = 0


class ScanIO(Protocol):
    """What the loops need from the runtime; the loops never see tiers, ranks or files.

    The runtime's implementation is ``zinf_fn.step_io.StepIO``; the scan's tests use an in-memory
    one.
    """

    options: ScanOptions

    def get(self, i: int) -> Any:
        """Plan entry i materialised: a layer with ``.unit`` and ``.tree``."""

    def release(self, layer: Any) -> None:
        """Give back a layer ``get`` returned."""

    def grad_buffer(self, unit: Any) -> torch.Tensor | LeafGrads | None:
        """Where ``unit``'s gradient goes: a zeroed flat fp32 buffer, a ``grads.LeafGrads`` that
        keeps the leaves, or None for a unit none of whose leaves takes a gradient."""

    def emit_grad(self, unit: Any, flat: torch.Tensor | LeafGrads | None) -> None:
        """Take ``unit``'s gradient (``grad_buffer``'s, filled): the callee owns it from then on."""

    def recorded(self, layer: Any, kept: list[bool]) -> None:
        """The forward recorded ``layer``'s block over every micro-batch; ``kept[m]``: micro-batch
        m's tape keeps its activations (``tape.Kept``), so that block's backward recomputes nothing
        for it."""

    def spec_of(self, unit: Any) -> FlatSpec:
        """The flat layout of ``unit``'s tree."""

    def frozen_of(self, unit: Any) -> tuple[int, ...]:
        """The indices of ``unit``'s leaves (for the head: then its tied leaves) that take no
        gradient (``zinf_fn.formats.frozen``)."""


class InPlaceCheckpoints:
    """Boundary carries stay where they are: the token is the list of carries itself."""

    def keep(self, layer: int, carries: list) -> list:
        return carries

    def restore(self, layer: int, token: list) -> list:
        return token

    def forget(self, layer: int) -> None:
        pass


IN_PLACE = InPlaceCheckpoints()


def forward_scan(model, io: ScanIO, micro_batches: list, keep_boundaries: bool, check: bool):
    """Embed and every block over all micro-batches, layer-major (plan entries 0..L).

    Returns (carries entering the head, boundaries) where ``boundaries[l]`` is (the checkpoints'
    token for the input carries of block l, block l's tapes, one per micro-batch, and for the last
    ``io.options.reuse`` blocks their layer, held for the backward, else None); empty when
    ``keep_boundaries`` is False (evaluation: no graph is recorded, every layer released).
    """
    checkpoints = io.options.checkpoints or IN_PLACE
    layer = io.get(0)
    with torch.no_grad():
        carries = [model.embed.apply(layer.tree, mb) for mb in micro_batches]
    io.release(layer)
    boundaries, kept = [], Kept(io.options.keep_activations)
    for i in range(model.n_layers):
        layer = io.get(1 + i)
        token = checkpoints.keep(i, carries) if keep_boundaries else None
        if keep_boundaries and io.options.record_blocks:
            carry_grad = i > 0 or io.options.embed_trains
            carries, tapes = block_record(
                block_apply(model, i),
                layer.tree,
                carries,
                layer.unit.name,
                check,
                io.frozen_of(layer.unit),
                carry_grad,
                kept,
            )
            io.recorded(layer, [tape.kept for tape in tapes])
        else:
            carries, tapes = (
                block_forward(block_apply(model, i), layer.tree, carries, layer.unit.name, check),
                None,
            )
        # its backward uses this layer
        held = keep_boundaries and reused(layer.unit, model.n_layers, io.options.reuse)
        if keep_boundaries:
            boundaries.append((token, tapes, layer if held else None))
        if not held:
            io.release(layer)
    return carries, boundaries


def head_params(model, layer) -> Any:
    """What ``model.head.apply`` takes: the head's tree, or for a tied model
    (``zinf_fn.model.packed_head``) the pair (the head's tree, the tied leaves fetched along with
    it)."""
    return (layer.tree, list(layer.tied)) if model.ties else layer.tree


def head_step(
    model, io: ScanIO, carries: list, micro_batches: list
) -> tuple[list, list[tuple], list[list]]:
    """The head over every micro-batch (plan entry L+1): losses, the carry cotangents, and per
    micro-batch the gradients of the tied leaves (``model.ties``; empty lists for an untied model).

    The gradient of the mean micro-batch loss (of ``io.options.loss_scale`` times the summed loss of
    a ``TokenLoss`` head: the reduce-scatter's mean over ranks then makes it the mean over the
    global batch's target tokens) wrt the head's own leaves goes out through ``emit_grad``; the tied
    leaves' gradients are held for ``backward_scan``, which adds them to the embedding's.
    """
    layer = io.get(head_index(model.n_layers))
    spec = io.spec_of(layer.unit)
    leaves, treedef = optree.tree_flatten(head_params(model, layer))
    n_own = len(spec.leaves)  # the packed tree's own leaves come first, the tied ones after
    token = io.options.loss_scale is not None
    scale = io.options.loss_scale if token else 1.0 / len(micro_batches)
    flat = io.grad_buffer(layer.unit)
    losses, d_carries, d_tied = [], [], []

    def unflatten(ls):
        return optree.tree_unflatten(treedef, list(ls))

    for m, (carry, mb) in enumerate(zip(carries, micro_batches, strict=True)):
        loss, d_params, d_c = head_vjp(
            model.head.apply, leaves, unflatten, carry, mb, scale, token, io.frozen_of(layer.unit)
        )
        accumulate_(flat, spec, list(d_params[:n_own]), m == 0, keep=(*d_c, *d_params[n_own:]))
        losses.append(loss)
        d_carries.append(d_c)
        d_tied.append(list(d_params[n_own:]))
    io.release(layer)
    io.emit_grad(layer.unit, flat)
    return losses, d_carries, d_tied


def backward_scan(
    model,
    io: ScanIO,
    boundaries: list,
    d_carries: list,
    micro_batches: list,
    d_tied: list | None = None,
) -> None:
    """Blocks L-1..0 then the embedding (plan entries L+2 .. 2L+2, less the ``io.options.reuse``
    blocks the forward held: ``boundaries``' layers, released here): recompute (or not:
    ``tape.Kept``), pull back, emit.

    ``d_tied`` (``head_step``'s, consumed): per micro-batch, the head's gradients of the tied
    leaves; each is added to the embedding's gradient of that leaf of the same micro-batch (``head +
    embed`` per micro-batch, then summed over micro-batches: autograd's order for a shared leaf)."""
    entry = model.n_layers + 2  # the plan's next backward fetch (the reused blocks have none)
    try:
        entry = _blocks_backward(model, io, boundaries, d_carries, entry)
    except BaseException:
        for bound in boundaries:  # the reused layers not yet pulled back go back to the pool
            if bound is not None and bound[2] is not None:
                io.release(bound[2])
        raise
    if io.options.embed_trains:
        _embed_backward(model, io, entry, d_carries, micro_batches, d_tied)


def _blocks_backward(model, io: ScanIO, boundaries: list, d_carries: list, entry: int) -> int:
    """``backward_scan``'s blocks, L-1..0 (plan entries from ``entry`` on); returns the next plan
    entry."""
    checkpoints = io.options.checkpoints or IN_PLACE
    for i in reversed(range(model.n_layers)):
        token, tapes, layer = boundaries[i]
        if layer is None:
            layer, entry = io.get(entry), entry + 1
        spec, frozen = io.spec_of(layer.unit), io.frozen_of(layer.unit)
        leaves, flat = optree.tree_leaves(layer.tree), io.grad_buffer(layer.unit)
        # nothing needs block 0's input cotangent without an embed backward
        carry_grad = i > 0 or io.options.embed_trains
        for m, carry in enumerate(checkpoints.restore(i, token)):
            if tapes is None:
                apply = block_apply(model, i)
                d_params, d_in = block_vjp(
                    apply, leaves, _unflattener(spec), carry, d_carries[m], frozen, carry_grad
                )
            else:
                c_leaves, _, idx = _float_leaves(carry)
                d_params, d_in = tapes[m].pull_back(
                    [leaves, [c_leaves[j] for j in idx]], tuple(d_carries[m])
                )
            d_carries[m] = tuple(d_in)
            accumulate_(flat, spec, d_params, m == 0, keep=d_carries[m])
        boundaries[i] = None  # this layer's checkpoints are no longer needed
        checkpoints.forget(i)
        io.release(layer)
        io.emit_grad(layer.unit, flat)
    return entry


def _embed_backward(
    model, io: ScanIO, i: int, d_carries: list, micro_batches: list, d_tied: list | None
) -> None:
    """The embedding's backward (plan entry ``i``): its gradient, with the head's of each tied leaf
    added."""
    layer = io.get(i)
    spec = io.spec_of(layer.unit)
    leaves, flat = optree.tree_leaves(layer.tree), io.grad_buffer(layer.unit)
    for m, mb in enumerate(micro_batches):
        d_params = embed_vjp(
            model.embed.apply,
            leaves,
            _unflattener(spec),
            mb,
            d_carries[m],
            io.frozen_of(layer.unit),
        )
        if model.ties:
            d_params = _add_tied(model.ties, spec, list(d_params), d_tied[m])
            d_tied[m] = None
        accumulate_(flat, spec, list(d_params), m == 0)
    io.release(layer)
    io.emit_grad(layer.unit, flat)


def _add_tied(ties, spec: FlatSpec, d_params: list, d_head: list) -> list:
    """The embedding's leaf gradients with the head's gradient of each tied leaf added (in fp32)."""
    index = {leaf.path: j for j, leaf in enumerate(spec.leaves)}
    for tie, g in zip(ties, d_head, strict=True):
        j = index[tie.embed]
        # None: a frozen leaf (zinf_fn.formats.frozen), whose embed gradient is None too
        if g is not None:
            d_params[j] = d_params[j].float() + g.float()
    return d_params


def _unflattener(spec: FlatSpec) -> Callable:
    return lambda leaves: optree.tree_unflatten(spec.treedef, list(leaves))
