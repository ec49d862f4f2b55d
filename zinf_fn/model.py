"""The functional model contract: three stages and a layer count.

A model is data, not a module: each stage is an ``init``/``apply`` pair of pure functions over
optree pytrees of tensors.

    embed.init(gen) -> tree        embed.apply(params, batch) -> carry
    block.init(gen, i) -> tree     block.apply(params, carry) -> carry
                                   (the same tree structure for every i)
                                   block.apply(params, carry, i) -> carry
                                   (with Model(layer_index=True))
    head.init(gen) -> tree         head.apply(params, carry, batch) -> scalar loss,
                                   or TokenLoss(sum, count)

A tree's leaves are tensors, or tiles (``zinf_fn.tiling``): a ``RowTiles`` / ``ColTiles`` node
makes each tile a fetch unit, and a tile may be a ``tiling.Deferred`` (its shape and a ``make()``
that returns it): ``zf.init`` learns the layout from the shapes and makes each deferred tile only
when it writes that tile's row, so an init that declares its large weights so never holds them
whole (``layers.moe`` with ``stream_experts``: one expert at a time). Outside the engine,
``tiling.materialize(tree)`` makes them.

A head that returns ``TokenLoss`` (a masked loss: targets -100 count for nothing) declares
``Model.count_targets``; the engine then weighs every micro-batch and rank by its target tokens, so
the step's loss and gradient are the mean over all target tokens of the global batch
(``token_mean``).

The plain loop every runtime in this package must equal::

    carry = embed.apply(pe, batch)
    for i in range(n_layers):
        carry = block_apply(model, i)(pb[i], carry)   # block.apply(pb[i], carry[, i])
    loss = token_mean(head.apply(with_ties(ties, ph, pe), carry, batch))   # plain_loss

Tied weights (``Model.ties``): ``Tie(embed="tok.w", head="lm_head.w")`` says that the head reads the
embedding's leaf ``tok.w`` as its ``lm_head.w``. The weight belongs to the embed stage:
``head.init`` leaves it out, the engine stores, offloads and updates it once (in the embed's row),
fetches it along with the head, and its gradient is the sum of both uses. ``with_ties`` puts it into
the head's tree.
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
    def from_module(
        make_block: Callable[[int], torch.nn.Module],
        forward: Callable[[torch.nn.Module, Any], Any] | None = None,
    ) -> Stage:
        """A block Stage from a factory of ``nn.Module`` s (layer index -> module), e.g.
        transformers' ``lambda i: LlamaDecoderLayer(cfg, i)``. No hook, no patching: the module is
        only ever called through ``torch.func.functional_call``.

        ``init(gen, i)`` builds ``make_block(i)`` on the CPU with torch's global RNG seeded from
        ``gen`` (forked, so the caller's RNG is untouched: the same seed gives the same model) and
        returns ``{name: parameter}`` with the module's own names (``"self_attn.q_proj.weight"``);
        the module is then dropped. ``apply(params, carry)`` calls one template of the block, built
        once on the ``meta`` device (it holds no memory), with ``params`` in place of its
        parameters, as ``forward(module, carry) -> carry`` (default: ``module(carry)``). The
        template is ``make_block(0)``, so the forward may depend on its layer only through its
        parameters. The blocks may hold no buffers (they would be state the engine neither stores
        nor moves): compute such values in the embed stage and pass them along in the carry.
        """
        return _module_stage(make_block, forward or _call_module)


class Tie(NamedTuple):
    """One weight shared by the embed and head stages: the embed tree's leaf at key path ``embed``
    (dotted, e.g. ``"tok.w"``) is what ``head.apply`` finds at key path ``head`` (e.g.
    ``"lm_head.w"``, through dicts only). ``head.init`` must not return the ``head`` path: the
    weight is the embedding's."""

    embed: str
    head: str


class TokenLoss(NamedTuple):
    """A head's masked loss as a sum and its token count: ``sum`` a 0-d float tensor (the summed
    per-token losses of one micro-batch), ``count`` a 0-d integer tensor (its target tokens, those
    != -100).

    The step's loss is ``sum over micro-batches and ranks of sum / sum of count``; the plain twin of
    one batch is ``token_mean(head.apply(...))``."""

    sum: torch.Tensor
    count: torch.Tensor


def token_mean(loss: Any) -> torch.Tensor:
    """``loss.sum / loss.count`` for a ``TokenLoss``; a scalar loss as it is."""
    return loss.sum / loss.count if isinstance(loss, TokenLoss) else loss


class Model(NamedTuple):
    """``embed`` -> ``n_layers`` x ``block`` -> ``head`` (which returns the scalar loss).

    ``config``: what the model was built from (a ``layers.llama.Config``, a ``layers.gpt.Config``),
    for exporters such as ``checkpoints.to_hf``; the engine never reads it. ``ties``: the weights
    the head shares with the embedding (``Tie``), e.g. ``(Tie("tok.w", "lm_head.w"),)`` for a GPT-2
    style head.

    ``trainable``: which leaves training may change, a predicate on full key paths
    (``"blocks.3.attn.q.lora_a"``, ``"embed.tok.w"``, ``"head.norm.w"``, the same paths as the
    optimizer's weight-decay ``mask``); None (the default): every leaf. ``is_trainable(model,
    path)`` is the one answer to "is this leaf trainable?". ``layers.lora.apply`` sets it to accept
    only the LoRA leaves. The engine (``zinf_fn.formats.frozen``) stores a frozen leaf as its 16-bit
    param copy only (no master, no optimizer state, no gradient), computes no gradient for it and
    never writes it after init. The blocks share one layout: the predicate must answer the same for
    a leaf in every block (``zf.init`` raises otherwise).

    ``layer_index``: whether ``block.apply`` takes the layer's index as a third argument,
    ``block.apply(params, carry, i)`` with ``i`` a Python int in ``range(n_layers)``, for a block
    whose computation depends on its layer (a sliding-window or a full-attention layer, a rope of
    its own) while its tree has the same structure in every layer. The index is static: the scan
    knows it before the step starts, as it knows the fetch order. ``block_apply(model, i)`` is the
    one answer to "how is block i applied?".

    ``count_targets``: ``batch -> 0-d integer tensor``, the target tokens of a micro-batch, for a
    head that returns ``TokenLoss`` (the same count it returns). The engine counts them before the
    head runs, so that every gradient, a tile's included, is scaled by 1 / (target tokens of the
    global batch) once.

    ``takes_lent``: which frozen leaves of the blocks ``block.apply`` can take as a
    ``tiling.LentWeight`` (the weight's stored NF4 codes, which the op computes from, never
    decoded; ``zinf_fn.formats.nf4_linear``) in place of a tensor of their values: a predicate on
    full key paths (``"blocks.3.attn.q.w"``); None (the default): none. A weight the apply passes to
    ``tiling.linear`` only (``layers.linear.apply`` does) may be named; the engine lends a named
    leaf where it is frozen, stored as NF4 codes of whole blocks and computed in fp32 on the CPU
    (``Config.frozen_storage``), and hands its values everywhere else.
    """

    embed: Stage
    block: Stage
    head: Stage
    n_layers: int
    config: Any = None
    ties: tuple[Tie, ...] = ()
    trainable: Callable[[str], bool] | None = None
    count_targets: Callable[[Any], torch.Tensor] | None = None
    layer_index: bool = False
    takes_lent: Callable[[str], bool] | None = None


def block_apply(model: Model, i: int) -> Callable[[Any, Any], Any]:
    """Block ``i``'s apply as a function of ``(params, carry)``: ``model.block.apply`` itself, or,
    for a model with ``layer_index``, ``block.apply`` called with ``i`` as its third argument."""
    if not model.layer_index:
        return model.block.apply
    return _LayerApply(model.block.apply, i)


class _LayerApply(NamedTuple):
    """``apply(params, carry, index)`` as a function of ``(params, carry)``."""

    apply: Callable[..., Any]
    index: int

    def __call__(self, params: Any, carry: Any) -> Any:
        return self.apply(params, carry, self.index)


def is_trainable(model: Model, path: str) -> bool:
    """Whether training may change the leaf at full key path ``path``
    (``"blocks.3.attn.q.lora_a"``): ``model.trainable(path)``, or True when ``model.trainable`` is
    None. Raises ``TypeError`` for a predicate that is not callable or returns something other than
    a bool (naming the path)."""
    check_trainable(model)
    if model.trainable is None:
        return True
    answer = model.trainable(path)
    if not isinstance(answer, bool):
        raise TypeError(
            f"zf.Model.trainable({path!r}) returned {answer!r} ({type(answer).__name__}); expected "
            "a "
            "bool: True for a leaf training changes, False for a frozen one"
        )
    return answer


def check_trainable(model: Model) -> None:
    """Raise ``TypeError`` unless ``model.trainable`` is None or a callable of one key path."""
    if model.trainable is not None and not callable(model.trainable):
        raise TypeError(
            "zf.Model.trainable must be None (every leaf trains) or a predicate on key paths, "
            "e.g. "
            f"trainable=lambda path: path.endswith('.lora_a'); got {model.trainable!r} "
            f"({type(model.trainable).__name__})"
        )


def plain_loss(model: Model, params: dict, batch: Any) -> torch.Tensor:
    """The plain loop over full parameter trees ``{"embed", "blocks": [...], "head"}``: the slow
    twin. Its loss is the scalar a step on ``batch`` reports: a ``TokenLoss`` head's token mean
    (``token_mean``), whatever the micro-batches and ranks.

    A tied weight is read from ``params["embed"]`` (a copy of it in ``params["head"]`` is ignored),
    so autograd sums the gradients of both uses into the embed leaf."""
    carry = model.embed.apply(params["embed"], batch)
    for i, layer_params in enumerate(params["blocks"]):
        carry = block_apply(model, i)(layer_params, carry)
    head = with_ties(model.ties, params["head"], params["embed"])
    return token_mean(model.head.apply(head, carry, batch))


def tied_leaf(tree: Any, path: str, where: str = "embed tree"):
    """The leaf of ``tree`` at dotted key path ``path`` (dict keys, or list indices)."""
    node = tree
    for part in path.split("."):
        try:
            node = node[int(part)] if isinstance(node, (list, tuple)) else node[part]
        except (KeyError, IndexError, TypeError, ValueError):
            raise ValueError(
                f"zf.Tie: the {where} has no leaf at key path {path!r} (stopped at {part!r})"
            ) from None
    return node


def with_ties(ties: tuple[Tie, ...], head_tree: Any, embed_tree: Any) -> Any:
    """``head_tree`` with each tied leaf of ``embed_tree`` put in at its head path (dicts on the
    path are copied, nothing is changed in place)."""
    return insert_ties(ties, head_tree, [tied_leaf(embed_tree, t.embed) for t in ties])


def insert_ties(ties: tuple[Tie, ...], head_tree: Any, values: list) -> Any:
    """``head_tree`` with ``values[j]`` at ``ties[j].head`` (a shallow copy along each path)."""
    if not ties:
        return head_tree
    out = dict(head_tree)
    for tie, value in zip(ties, values, strict=True):
        *parents, last = tie.head.split(".")
        node = out
        for part in parents:
            node[part] = dict(node.get(part, {}))
            node = node[part]
        node[last] = value
    return out


def check_ties(model: Model, embed_tree: Any, head_tree: Any) -> None:
    """Raise a ValueError unless every tie names a tensor leaf of the embed tree and a free head
    path."""
    if not isinstance(model.ties, tuple) or not all(isinstance(t, Tie) for t in model.ties):
        raise TypeError(f"zf.Model.ties must be a tuple of zf.Tie, got {model.ties!r}")
    if model.ties and not isinstance(head_tree, dict):
        raise ValueError(
            f"zf.Model.ties: a tied head's tree must be a dict, got {type(head_tree).__name__}"
        )
    for tie in model.ties:
        leaf = tied_leaf(embed_tree, tie.embed)
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(
                f"zf.Tie({tie.embed!r}, {tie.head!r}): the embed leaf must be an untiled tensor, "
                f"got {type(leaf).__name__}"
            )
        try:
            tied_leaf(head_tree, tie.head, "head tree")
        except ValueError:
            continue
        raise ValueError(
            f"zf.Tie({tie.embed!r}, {tie.head!r}): head.init returned {tie.head!r}, expected it "
            "absent: a tied weight belongs to the embedding (leave it out of "
            "head.init)"
        )


def packed_head(model: Model) -> Model:
    """The engine's view of a tied model: ``head.apply((own tree, [tied leaves]), carry, batch)``.

    The head's own leaves come first in the packed tree's leaf order, so their indices are those of
    the head's own tree (what ``zinf_fn.tiling`` binds by); the tied leaves follow, in ``ties``
    order."""
    if not model.ties:
        return model
    apply = model.head.apply

    def tied_apply(packed, carry, batch):
        own, tied = packed
        return apply(insert_ties(model.ties, own, list(tied)), carry, batch)

    return model._replace(head=Stage(model.head.init, tied_apply))


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
        raise TypeError(
            f"Stage.from_module: make_block({i}) returned {type(module).__name__}, expected an "
            "nn.Module"
        )
    buffers = [name for name, _ in module.named_buffers()]
    if buffers:
        raise TypeError(
            f"Stage.from_module: block {i} ({type(module).__name__}) holds buffers {buffers}; a "
            "block "
            "may hold parameters only: compute such values in the embed stage and "
            "carry them"
        )
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
