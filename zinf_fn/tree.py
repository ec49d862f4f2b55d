"""optree helpers: a layer tree <-> one flat buffer plus a spec, and back as views.

The spec is pure data (key paths, shapes, offsets), so it can be compared across layers and ranks,
printed, and written into a checkpoint manifest.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch


class LeafSpec(NamedTuple):
    path: str  # dotted key path, e.g. "attn.qkv.w"
    shape: tuple[int, ...]
    offset: int  # first element in the flat buffer
    numel: int


class FlatSpec(NamedTuple):
    """How one parameter tree lies in a flat buffer: leaves in optree order, back to back."""

    treedef: Any
    leaves: tuple[LeafSpec, ...]
    numel: int

    def describe(self) -> list[tuple[str, tuple[int, ...]]]:
        """(key path, shape) of each leaf: the part of a spec that must agree across layers and
        ranks."""
        return [(leaf.path, leaf.shape) for leaf in self.leaves]


def path_str(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def flat_spec(tree: Any, where: str = "tree") -> FlatSpec:
    """The spec of ``tree``; every leaf must be a floating-point tensor."""
    paths, leaves, treedef = optree.tree_flatten_with_path(tree)
    specs, offset = [], 0
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            got = type(leaf).__name__ if not isinstance(leaf, torch.Tensor) else str(leaf.dtype)
            raise TypeError(
                f"{where}: leaf {path_str(path)!r} must be a floating-point tensor, got {got}"
            )
        n = math.prod(leaf.shape)
        specs.append(LeafSpec(path_str(path), tuple(leaf.shape), offset, n))
        offset += n
    return FlatSpec(treedef, tuple(specs), offset)


def check_same_spec(expected: FlatSpec, got: FlatSpec, where: str) -> None:
    """Raise a ValueError naming the first key path where two specs differ."""
    if expected.describe() == got.describe() and expected.treedef == got.treedef:
        return
    want, have = dict(expected.describe()), dict(got.describe())
    for path in sorted(set(want) | set(have)):
        if want.get(path) != have.get(path):
            raise ValueError(
                f"{where}: key path {path!r} differs from layer 0: expected shape "
                f"{want.get(path, 'absent')}, got {have.get(path, 'absent')}. Every "
                "block.init(gen, i) "
                "must return the same tree structure and shapes."
            )
    raise ValueError(
        f"{where}: tree structure differs from layer 0: {expected.treedef} vs {got.treedef}"
    )


def flatten_into_(tree: Any, spec: FlatSpec, out: torch.Tensor) -> torch.Tensor:
    """Copy the leaves of ``tree`` into ``out[:spec.numel]`` (consumes nothing; writes ``out``)."""
    leaves = optree.tree_leaves(tree)
    for leaf_spec, leaf in zip(spec.leaves, leaves, strict=True):
        out[leaf_spec.offset : leaf_spec.offset + leaf_spec.numel].copy_(leaf.reshape(-1))
    return out


def unflatten(flat: torch.Tensor, spec: FlatSpec) -> Any:
    """The tree whose leaves are views into ``flat`` (no copy)."""
    leaves = [flat[s.offset : s.offset + s.numel].view(s.shape) for s in spec.leaves]
    return optree.tree_unflatten(spec.treedef, leaves)


def tensor_signature(tree: Any) -> tuple:
    """(treedef, ((shape, dtype), ...)) of a pytree of tensors, for structure checks."""
    leaves, treedef = optree.tree_flatten(tree)
    return treedef, tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (type(x),) for x in leaves
    )
