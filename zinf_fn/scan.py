"""The scan-over-layers runtime: forward keeping boundary carries, reverse scan with a vjp per layer.

Every function here equals the plain loop of ``zinf_fn.model.plain_loss`` with autograd; the
difference is only what is resident: one layer's parameters and activations at a time, plus the
boundary carries (the inputs of each layer, one per micro-batch). In training the forward records
each block's graph without its activations (``tape.Tape``), so the reverse scan recomputes only
what the backward needs, on the refetched layer and the restored carry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from .grads import accumulate_
from .tape import Tape, pull_back
from .tree import FlatSpec, tensor_signature


def _float_split(tree: Any):
    """(leaves, treedef, indices of floating leaves): what a vjp differentiates."""
    leaves, treedef = optree.tree_flatten(tree)
    return leaves, treedef, [i for i, x in enumerate(leaves) if _is_float(x)]


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _with_floats(leaves: list, idx: list[int], floats) -> list:
    out = list(leaves)
    for i, x in zip(idx, floats, strict=True):
        out[i] = x
    return out


def check_carry(before: Any, after: Any, layer: str) -> None:
    """A block must map a carry to a carry of the same structure, shapes and dtypes."""
    want, got = tensor_signature(before), tensor_signature(after)
    if want != got:
        raise ValueError(
            f"{layer}: block.apply changed the carry: expected structure {want[0]} with (shape, dtype) "
            f"{list(want[1])}, got {got[0]} with {list(got[1])}. A block must return a carry shaped like its input."
        )


def check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        got = f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}" if isinstance(loss, torch.Tensor) else (
            type(loss).__name__)
        raise ValueError(f"head.apply must return a scalar floating-point loss, got {got}")
    return loss


def block_forward(apply: Callable, params: Any, carries: list, layer: str, check: bool) -> list:
    """Run one block over every micro-batch's carry (no autograd graph is kept)."""
    out = []
    with torch.no_grad():
        for carry in carries:
            new = apply(params, carry)
            if check:
                check_carry(carry, new, layer)
            out.append(new)
    return out


def block_record(apply: Callable, params: Any, carries: list, layer: str, check: bool) -> tuple[list, list]:
    """Run one block over every micro-batch's carry, recording each for the reverse scan (``tape.Tape``):
    (output carries, one tape per micro-batch). No activation is kept, only the graph's nodes."""
    p_leaves, treedef_p = optree.tree_flatten(params)
    out, tapes = [], []
    for carry in carries:
        f, c_floats, result = _block_fn(apply, lambda ls: optree.tree_unflatten(treedef_p, list(ls)), carry)
        tape = Tape(f, [p_leaves, c_floats])
        new_leaves, new_def, idx = _float_split(result.pop())   # its floats are the graph's (dropped) outputs
        new = optree.tree_unflatten(new_def, _with_floats(new_leaves, idx, tape.outputs))
        if check:
            check_carry(carry, new, layer)
        out.append(new)
        tapes.append(tape)
    return out, tapes


def _block_fn(apply: Callable, unflatten_params: Callable, carry: Any) -> tuple[Callable, list, list]:
    """One block on one carry as a function of (parameter leaves, the carry's floating leaves) returning the
    output carry's floating leaves; also those input floats, and a list that receives the output carry.

    Cotangents of a carry are the tuple of its floating leaves' gradients (other leaves, such as an
    integer mask, pass through undifferentiated).
    """
    leaves, treedef, idx = _float_split(carry)
    result: list = []

    def f(p_leaves, c_floats):
        new = apply(unflatten_params(p_leaves), optree.tree_unflatten(treedef, _with_floats(leaves, idx, c_floats)))
        result[:] = [new]
        new_leaves, _, new_idx = _float_split(new)
        return tuple(new_leaves[i] for i in new_idx)

    return f, [leaves[i] for i in idx], result


def block_vjp(apply: Callable, param_leaves: list[torch.Tensor], unflatten_params: Callable,
              carry: Any, d_floats: tuple) -> tuple[list[torch.Tensor], tuple]:
    """Recompute one block on one micro-batch and pull the carry's cotangent back through it.

    Returns (gradient of each parameter leaf, cotangent of the input carry's floating leaves).
    """
    f, c_floats, _ = _block_fn(apply, unflatten_params, carry)
    _, (d_params, d_in) = pull_back(f, [list(param_leaves), c_floats], tuple(d_floats))
    return d_params, tuple(d_in)


def head_vjp(apply: Callable, param_leaves: list[torch.Tensor], unflatten_params: Callable,
             carry: Any, batch: Any, scale: float) -> tuple[torch.Tensor, list[torch.Tensor], tuple]:
    """Loss of one micro-batch, and the gradients of ``scale * loss`` wrt head params and carry."""
    leaves, treedef, idx = _float_split(carry)

    def f(p_leaves, c_floats):
        c = optree.tree_unflatten(treedef, _with_floats(leaves, idx, c_floats))
        return (check_loss(apply(unflatten_params(p_leaves), c, batch)),)

    def cotangent(outputs):
        return (torch.full_like(outputs[0], scale),)

    (loss,), (d_params, d_c) = pull_back(f, [list(param_leaves), [leaves[i] for i in idx]], cotangent)
    return loss, d_params, tuple(d_c)


def embed_vjp(apply: Callable, param_leaves: list[torch.Tensor], unflatten_params: Callable,
              batch: Any, d_floats: tuple) -> list[torch.Tensor]:
    """Recompute the embedding on one micro-batch and pull the carry's cotangent back to its params."""

    def f(p_leaves):
        out = optree.tree_leaves(apply(unflatten_params(p_leaves), batch))
        return tuple(x for x in out if _is_float(x))

    _, (d_params,) = pull_back(f, [list(param_leaves)], tuple(d_floats))
    return d_params


class ScanIO(NamedTuple):
    """What the loops need from the runtime; the loops never see tiers, ranks or files.

    ``get(i)`` returns plan entry i materialised (a ``Layer`` with ``.unit``, ``.tree``), ``release``
    gives it back, ``grad_buffer(unit)`` hands out where a unit's gradient goes (a zeroed flat fp32
    buffer, or a ``grads.LeafGrads`` that keeps the leaves) and
    ``emit_grad(unit, flat)`` takes it (the callee owns it from then on). ``checkpoints`` keeps the
    boundary carries (``keep(l, carries) -> token``, ``restore(l, token) -> carries``, ``forget(l)``);
    None keeps them as they are, in the list. ``record_blocks``: the training forward records each
    block's graph (``tape.Tape``) so that the backward recomputes only what it needs; a block whose
    ops keep per-phase state in their autograd context (tiled ops hold the handle of the unit they
    were fetched through) is recomputed from scratch instead.
    """

    get: Callable[[int], Any]
    release: Callable[[Any], None]
    grad_buffer: Callable[[Any], torch.Tensor]
    emit_grad: Callable[[Any, torch.Tensor], None]
    spec_of: Callable[[Any], FlatSpec]
    checkpoints: Any = None
    record_blocks: bool = True   # False: blocks are recomputed from scratch in backward, no tape


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
    token for the input carries of block l, block l's tapes, one per micro-batch); empty when
    ``keep_boundaries`` is False (evaluation: no graph is recorded).
    """
    checkpoints = io.checkpoints or IN_PLACE
    layer = io.get(0)
    with torch.no_grad():
        carries = [model.embed.apply(layer.tree, mb) for mb in micro_batches]
    io.release(layer)
    boundaries = []
    for i in range(model.n_layers):
        layer = io.get(1 + i)
        token = checkpoints.keep(i, carries) if keep_boundaries else None
        if keep_boundaries and io.record_blocks:
            carries, tapes = block_record(model.block.apply, layer.tree, carries, layer.unit.name, check)
        else:
            carries, tapes = block_forward(model.block.apply, layer.tree, carries, layer.unit.name, check), None
        if keep_boundaries:
            boundaries.append((token, tapes))
        io.release(layer)
    return carries, boundaries


def head_step(model, io: ScanIO, carries: list, micro_batches: list) -> tuple[list[torch.Tensor], list[tuple]]:
    """The head over every micro-batch (plan entry L+1): losses, and the carry cotangents.

    The gradient of the mean micro-batch loss wrt the head leaves through ``emit_grad``.
    """
    layer = io.get(model.n_layers + 1)
    spec = io.spec_of(layer.unit)
    leaves = optree.tree_leaves(layer.tree)
    scale = 1.0 / len(micro_batches)
    flat = io.grad_buffer(layer.unit)
    losses, d_carries = [], []
    for m, (carry, mb) in enumerate(zip(carries, micro_batches, strict=True)):
        loss, d_params, d_c = head_vjp(model.head.apply, leaves, _unflattener(spec), carry, mb, scale)
        accumulate_(flat, spec, d_params, m == 0, keep=tuple(d_c))
        losses.append(loss)
        d_carries.append(d_c)
    io.release(layer)
    io.emit_grad(layer.unit, flat)
    return losses, d_carries


def backward_scan(model, io: ScanIO, boundaries: list, d_carries: list, micro_batches: list) -> None:
    """Blocks L-1..0 then the embedding (plan entries L+2 .. 2L+2): recompute, pull back, emit."""
    checkpoints = io.checkpoints or IN_PLACE
    base = model.n_layers + 2
    for step, i in enumerate(reversed(range(model.n_layers))):
        layer = io.get(base + step)
        spec = io.spec_of(layer.unit)
        leaves, flat = optree.tree_leaves(layer.tree), io.grad_buffer(layer.unit)
        token, tapes = boundaries[i]
        for m, carry in enumerate(checkpoints.restore(i, token)):
            if tapes is None:
                d_params, d_in = block_vjp(model.block.apply, leaves, _unflattener(spec), carry, d_carries[m])
            else:
                c_leaves, _, idx = _float_split(carry)
                d_params, d_in = tapes[m].pull_back([leaves, [c_leaves[j] for j in idx]], tuple(d_carries[m]))
            d_carries[m] = tuple(d_in)
            accumulate_(flat, spec, d_params, m == 0, keep=d_carries[m])
        boundaries[i] = None   # this layer's checkpoints are no longer needed
        checkpoints.forget(i)
        io.release(layer)
        io.emit_grad(layer.unit, flat)
    layer = io.get(base + model.n_layers)
    spec = io.spec_of(layer.unit)
    leaves, flat = optree.tree_leaves(layer.tree), io.grad_buffer(layer.unit)
    for m, mb in enumerate(micro_batches):
        d_params = embed_vjp(model.embed.apply, leaves, _unflattener(spec), mb, d_carries[m])
        accumulate_(flat, spec, d_params, m == 0)
    io.release(layer)
    io.emit_grad(layer.unit, flat)


def _unflattener(spec: FlatSpec) -> Callable:
    return lambda leaves: optree.tree_unflatten(spec.treedef, list(leaves))
