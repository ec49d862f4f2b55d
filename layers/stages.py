"""The one way a model module of ``layers/`` becomes a ``zf.Model``: its stage functions bound to
its config."""

from __future__ import annotations

from functools import partial
from types import ModuleType
from typing import NamedTuple

from layers.batch import count_targets
from zinf_fn.model import Model, Stage, Tie

TIED_HEAD = (Tie("tok.w", "lm_head.w"),)  # the tied head: lm_head.w is the token embedding


class BlockLinears(NamedTuple):
    """``zf.Model.takes_lent``: the weights of a block's linears (key paths inside a block,
    ``"attn.q.w"``), which its apply passes to ``layers.linear.apply`` only, so that the engine may
    hand them as their stored codes (``tiling.LentWeight``)."""

    paths: frozenset[str]

    def __call__(self, path: str) -> bool:
        """Whether full key path ``path`` (``"blocks.3.attn.q.w"``) is one of them."""
        stage, _, rest = path.partition(".")
        return stage == "blocks" and rest.partition(".")[2] in self.paths


def bound_model(cfg, module: ModuleType, tie_embeddings: bool, layer_index: bool = False) -> Model:
    """``module``'s ``embed_init``/``embed_apply``, ``block_init``/``block_apply`` and
    ``head_init``/ ``head_apply``, each with ``cfg`` bound first, as the three stages of
    ``cfg.n_layers`` blocks; ``tie_embeddings``: the head reads the token embedding as its
    ``lm_head.w`` (``TIED_HEAD``). A config with ``token_loss`` gets a head that returns
    ``zf.TokenLoss`` and declares ``batch.count_targets``. ``layer_index``: ``block_apply`` takes
    the layer's index last (``zf.Model(layer_index=True)``). The weights ``module.LINEARS`` names
    (key paths inside a block) are the model's ``takes_lent`` (``BlockLinears``)."""

    def stage(name: str) -> Stage:
        return Stage(
            partial(getattr(module, f"{name}_init"), cfg),
            partial(getattr(module, f"{name}_apply"), cfg),
        )

    return Model(
        embed=stage("embed"),
        block=stage("block"),
        head=stage("head"),
        n_layers=cfg.n_layers,
        config=cfg,
        ties=TIED_HEAD if tie_embeddings else (),
        layer_index=layer_index,
        count_targets=count_targets if getattr(cfg, "token_loss", False) else None,
        takes_lent=BlockLinears(frozenset(module.LINEARS)),
    )
