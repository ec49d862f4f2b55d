"""The functional model contract: three stages and a layer count.

A model is data, not a module: each stage is an ``init``/``apply`` pair of pure functions over
optree pytrees of tensors.

    embed.init(gen) -> tree        embed.apply(params, batch) -> carry
    block.init(gen, i) -> tree     block.apply(params, carry) -> carry   (same tree structure for every i)
    head.init(gen) -> tree         head.apply(params, carry, batch) -> scalar loss

The plain loop every runtime in this package must equal::

    carry = embed.apply(pe, batch)
    for i in range(n_layers):
        carry = block.apply(pb[i], carry)
    loss = head.apply(ph, carry, batch)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class Stage(NamedTuple):
    """One stage of a model: ``init`` builds its parameter tree, ``apply`` runs it."""

    init: Callable[..., Any]
    apply: Callable[..., Any]


class Model(NamedTuple):
    """``embed`` -> ``n_layers`` x ``block`` -> ``head`` (which returns the scalar loss).

    ``config``: what the model was built from (a ``layers.llama.Config``, a ``layers.gpt.Config``), for
    exporters such as ``checkpoints.to_hf``; the engine never reads it.
    """

    embed: Stage
    block: Stage
    head: Stage
    n_layers: int
    config: Any = None


def plain_loss(model: Model, params: dict, batch: Any):
    """The plain loop over full parameter trees ``{"embed", "blocks": [...], "head"}``: the slow twin."""
    carry = model.embed.apply(params["embed"], batch)
    for layer_params in params["blocks"]:
        carry = model.block.apply(layer_params, carry)
    return model.head.apply(params["head"], carry, batch)
