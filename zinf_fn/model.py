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

import torch


class Stage(NamedTuple):
    """One stage of a model: ``init`` builds its parameter tree, ``apply`` runs it."""

    init: Callable[..., Any]
    apply: Callable[..., Any]

    @staticmethod
    def from_module(make_block: Callable[[int], torch.nn.Module],
                    forward: Callable[[torch.nn.Module, Any], Any] | None = None) -> Stage:
        """A block Stage from a factory of ``nn.Module`` s (layer index -> module), e.g. transformers'
        ``lambda i: LlamaDecoderLayer(cfg, i)``. No hook, no patching: the module is only ever called
        through ``torch.func.functional_call``.

        ``init(gen, i)`` builds ``make_block(i)`` on the CPU with torch's global RNG seeded from ``gen``
        (forked, so the caller's RNG is untouched: the same seed gives the same model) and returns
        ``{name: parameter}`` with the module's own names (``"self_attn.q_proj.weight"``); the module
        is then dropped. ``apply(params, carry)`` calls one template of the block, built once on the
        ``meta`` device (it holds no memory), with ``params`` in place of its parameters, as
        ``forward(module, carry) -> carry`` (default: ``module(carry)``). The template is
        ``make_block(0)``, so the forward may depend on its layer only through its parameters. The
        blocks may hold no buffers (they would be state the engine neither stores nor moves): compute
        such values in the embed stage and pass them along in the carry.
        """
        return _module_stage(make_block, forward or _call_module)


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


def _call_module(module: torch.nn.Module, carry):
    return module(carry)


class _Forward(torch.nn.Module):
    """The template block and the user's ``forward``: what ``functional_call`` calls."""

    def __init__(self, block: torch.nn.Module, forward: Callable):
        super().__init__()
        self.block = block
        self.call = forward

    def forward(self, carry):
        return self.call(self.block, carry)


def _built(make_block: Callable, i: int) -> torch.nn.Module:
    module = make_block(i)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"Stage.from_module: make_block({i}) returned {type(module).__name__}, expected an nn.Module")
    buffers = [name for name, _ in module.named_buffers()]
    if buffers:
        raise TypeError(f"Stage.from_module: block {i} ({type(module).__name__}) holds buffers {buffers}; a block "
                        "may hold parameters only: compute such values in the embed stage and carry them")
    return module


def _module_stage(make_block: Callable, forward: Callable) -> Stage:
    template: list[_Forward] = []

    def init(gen: torch.Generator, i: int) -> dict:
        seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = _built(make_block, i)
        return {name: p.detach() for name, p in module.named_parameters()}

    def apply(params: dict, carry):
        if not template:
            with torch.device("meta"):
                template.append(_Forward(_built(make_block, 0), forward))
        named = {f"block.{name}": value for name, value in params.items()}
        return torch.func.functional_call(template[0], named, (carry,), strict=True)

    return Stage(init, apply)
