"""One block, head or embedding on one micro-batch, as functions of leaves: run, record, pull back.

The loops of ``scan.loops`` call these per layer and micro-batch. A block's parameters and its
carry's floating leaves are the differentiated inputs; other carry leaves (an integer mask) pass
through undifferentiated. ``frozen`` (indices of parameter leaves, ``zinf_fn.formats.frozen``) take
no gradient (None comes back for them), nor does the input carry where ``carry_grad`` is False
(nothing needs it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from ..model import TokenLoss
from ..tree import tensor_signature
from .tape import Kept, Tape, pull_back


def _float_leaves(tree: Any):
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
            f"{layer}: block.apply changed the carry: expected structure {want[0]} with (shape, "
            "dtype) "
            f"{list(want[1])}, got {got[0]} with {list(got[1])}. A block must return a carry "
            "shaped like its input."
        )


def check_loss(loss: Any, token: bool = False) -> torch.Tensor | TokenLoss:
    """``loss`` checked: a 0-d float tensor, or with ``token`` (the model declares
    ``count_targets``) a ``TokenLoss`` of a 0-d float sum and a 0-d integer count."""
    if token != isinstance(loss, TokenLoss):
        want = "zf.TokenLoss(sum, count)" if token else "a scalar loss"
        fix = (
            "drop Model.count_targets or return a TokenLoss"
            if token
            else "declare Model.count_targets (batch -> target tokens) to return a TokenLoss"
        )
        raise ValueError(f"head.apply: expected {want}, got {type(loss).__name__}; {fix}")
    if token:
        count = loss.count
        if not isinstance(count, torch.Tensor) or count.ndim != 0 or count.is_floating_point():
            raise ValueError(
                f"head.apply: TokenLoss.count must be a 0-d integer tensor, got {count!r}"
            )
        return TokenLoss(_check_scalar(loss.sum), count)
    return _check_scalar(loss)


def _check_scalar(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        got = (
            f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
            if isinstance(loss, torch.Tensor)
            else (type(loss).__name__)
        )
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


def block_record(
    apply: Callable,
    params: Any,
    carries: list,
    layer: str,
    check: bool,
    frozen: tuple = (),
    carry_grad: bool = True,
    kept: Kept | None = None,
) -> tuple[list, list]:
    """Run one block over every micro-batch's carry, recording each for the reverse scan
    (``tape.Tape``): (output carries, one tape per micro-batch). No activation is kept, only the
    graph's nodes, unless ``kept`` (``tape.Kept``) has room for a tape's: then that tape keeps them
    and is not recomputed."""
    p_leaves, treedef_p = optree.tree_flatten(params)
    out, tapes = [], []
    for carry in carries:
        f, c_floats, result = _block_fn(
            apply, lambda ls: optree.tree_unflatten(treedef_p, list(ls)), carry
        )
        tape = Tape(f, [p_leaves, c_floats], _still(frozen, carry_grad, c_floats), kept)
        # its floats are the graph's (dropped) outputs
        new_leaves, new_def, idx = _float_leaves(result.pop())
        new = optree.tree_unflatten(new_def, _with_floats(new_leaves, idx, tape.outputs))
        if check:
            check_carry(carry, new, layer)
        out.append(new)
        tapes.append(tape)
    return out, tapes


def _block_fn(
    apply: Callable, unflatten_params: Callable, carry: Any
) -> tuple[Callable, list, list]:
    """One block on one carry as a function of (parameter leaves, the carry's floating leaves)
    returning the output carry's floating leaves; also those input floats, and a list that receives
    the output carry.

    Cotangents of a carry are the tuple of its floating leaves' gradients (other leaves, such as an
    integer mask, pass through undifferentiated).
    """
    leaves, treedef, idx = _float_leaves(carry)
    result: list = []

    def f(p_leaves, c_floats):
        new = apply(
            unflatten_params(p_leaves),
            optree.tree_unflatten(treedef, _with_floats(leaves, idx, c_floats)),
        )
        result[:] = [new]
        new_leaves, _, new_idx = _float_leaves(new)
        return tuple(new_leaves[i] for i in new_idx)

    return f, [leaves[i] for i in idx], result


def block_vjp(
    apply: Callable,
    param_leaves: list[torch.Tensor],
    unflatten_params: Callable,
    carry: Any,
    d_floats: tuple,
    frozen: tuple = (),
    carry_grad: bool = True,
) -> tuple[list, tuple]:
    """Recompute one block on one micro-batch and pull the carry's cotangent back through it.

    Returns (gradient of each parameter leaf, cotangent of the input carry's floating leaves).
    """
    f, c_floats, _ = _block_fn(apply, unflatten_params, carry)
    _, (d_params, d_in) = pull_back(
        f, [list(param_leaves), c_floats], tuple(d_floats), _still(frozen, carry_grad, c_floats)
    )
    return d_params, tuple(d_in)


def _still(frozen: tuple, carry_grad: bool, c_floats: list) -> tuple:
    """``pull_back``'s ``still`` of (parameter leaves, carry floats): the frozen leaves, and the
    carry's floats where its cotangent is not needed."""
    return (tuple(frozen), () if carry_grad else tuple(range(len(c_floats))))


def head_vjp(
    apply: Callable,
    param_leaves: list[torch.Tensor],
    unflatten_params: Callable,
    carry: Any,
    batch: Any,
    scale: float,
    token: bool = False,
    frozen: tuple = (),
) -> tuple[Any, list, tuple]:
    """Loss of one micro-batch, and the gradients of ``scale * loss`` wrt head params and carry.

    ``token``: the head returns a ``TokenLoss``; the gradients are those of ``scale * loss.sum`` and
    the loss comes back as a ``TokenLoss`` (its sum detached)."""
    leaves, treedef, idx = _float_leaves(carry)
    counts: list = []

    def f(p_leaves, c_floats):
        c = optree.tree_unflatten(treedef, _with_floats(leaves, idx, c_floats))
        loss = check_loss(apply(unflatten_params(p_leaves), c, batch), token)
        if token:
            counts.append(loss.count)
            return (loss.sum,)
        return (loss,)

    def cotangent(outputs):
        return (torch.full_like(outputs[0], scale),)

    (loss,), (d_params, d_c) = pull_back(
        f, [list(param_leaves), [leaves[i] for i in idx]], cotangent, (frozen,)
    )
    return (TokenLoss(loss, counts[0]) if token else loss), d_params, tuple(d_c)


def embed_vjp(
    apply: Callable,
    param_leaves: list[torch.Tensor],
    unflatten_params: Callable,
    batch: Any,
    d_floats: tuple,
    frozen: tuple = (),
) -> list:
    """Recompute the embedding on one micro-batch and pull the carry's cotangent back to its
    params."""

    def f(p_leaves):
        out = optree.tree_leaves(apply(unflatten_params(p_leaves), batch))
        return tuple(x for x in out if _is_float(x))

    _, (d_params,) = pull_back(f, [list(param_leaves)], tuple(d_floats), (frozen,))
    return d_params
