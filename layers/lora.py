"""LoRA (Hu et al., 2021) as a model transform: ``lora.apply(model, ...)`` returns a ``zf.Model``
whose targeted
linears compute PEFT's ``lora.Linear``::

    y = W x + b + (B (A x)) * alpha / rank        A: (rank, d_in), B: (d_out, rank)

``A`` and ``B`` are ordinary leaves of the block's tree, beside the linear's own (``nn.Linear``
layout kept)::

    {"attn": {"q": {"w": (d_out, d_in), "b"?: (d_out,), "lora_a": (r, d_in), "lora_b": (d_out, r)},
    ...}, ...}

Initialised as PEFT does: ``A`` by ``kaiming_uniform_(a=sqrt(5))`` (U(-1/sqrt(d_in), 1/sqrt(d_in)))
from the block's generator, drawn after the base tree (whose values are those of the untransformed
model with the same generator), ``B`` zero, so the adapted model starts equal to the base. The
returned model's ``trainable`` accepts only the LoRA leaves (and, when the model had a predicate,
only those it accepts too).

Targets are key paths of linears inside a block (``"attn.q"``); by family (HF module in brackets):

- ``layers.llama`` (Llama, Mistral, Qwen2): ``attn.q`` [q_proj], ``attn.k`` [k_proj], ``attn.v``
  [v_proj], ``attn.o`` [o_proj], ``mlp.gate`` [gate_proj], ``mlp.up`` [up_proj], ``mlp.down``
  [down_proj]; default ``("attn.q", "attn.v")``, PEFT's default for Llama.
- ``layers.llama`` with ``moe`` (Qwen3-MoE, Mixtral, OLMoE, gpt-oss): the attention targets, and
  the stacked experts ``mlp.experts.gate_up`` [experts.gate_up_proj], ``mlp.experts.down``
  [experts.down_proj], one adapter per expert (``lora_a`` (E, r, d_in), ``lora_b`` (E, d_out, r);
  ``layers.moe_lora``), what PEFT's ``target_parameters`` computes; merged per expert by
  ``merge``.
- ``layers.gpt`` (GPT-2): ``attn.qkv`` [attn.c_attn], ``attn.proj`` [attn.c_proj], ``mlp.fc``
  [mlp.c_fc], ``mlp.proj`` [mlp.c_proj]; default ``("attn.qkv",)``, PEFT's ``c_attn``.

A tiled weight (``RowTiles`` / ``ColTiles``) stays tiled: the LoRA path is an ordinary small matmul
beside the tiled one. The scale reaches ``layers.linear.apply`` through the tree: the model's block
apply first puts the float ``"lora_scale"`` into each adapted linear's dict (``bind``); stored trees
hold tensors only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from layers import gpt, llama, moe_lora
from zinf_fn import tiling
from zinf_fn.model import Model, Stage, check_trainable

LORA_LEAVES = ("lora_a", "lora_b")
_LINEAR_KEYS = {"w", "b"}
_NO_DROPOUT = (
    "layers/ compute no dropout: the engine recomputes each block in backward, so a mask drawn "
    "from "
    "torch's RNG in forward would differ from the recompute's; pass dropout=0.0"
)


@dataclass(frozen=True)
class Config:
    """What ``apply`` made of a model: ``base`` is the model's config before (a ``llama.Config``,
    ``gpt.Config``, ...; exporters read it), ``scale`` = ``alpha / rank`` (PEFT's ``scaling``, not
    rsLoRA)."""

    base: Any
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class Trainable(NamedTuple):
    """The predicate ``apply`` sets as ``Model.trainable``: the LoRA leaves of ``targets`` in every
    block (``"blocks.3.attn.q.lora_a"``), each only if ``previous`` (the model's own predicate, if
    any) accepts it."""

    targets: tuple[str, ...]
    previous: Any = None

    def __call__(self, path: str) -> bool:
        parts = path.split(".")
        ours = (
            len(parts) >= 4
            and parts[0] == "blocks"
            and parts[1].isdigit()
            and parts[-1] in LORA_LEAVES
            and ".".join(parts[2:-1]) in self.targets
        )
        if not ours or self.previous is None:
            return ours
        answer = self.previous(path)
        if not isinstance(answer, bool):
            raise TypeError(f"zf.Model.trainable({path!r}) returned {answer!r}; expected a bool")
        return answer


def apply(
    model: Model,
    rank: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    targets: tuple[str, ...] | None = None,
) -> Model:
    """``model`` with LoRA on the block linears ``targets`` (None: the family's default, see the
    module docstring); ``model.config`` becomes a ``lora.Config`` over the old one,
    ``model.trainable`` a ``Trainable``.

    Raises ``ValueError`` for a target that names no linear of the block (listing the linears there
    are), a rank outside [1, min(d_in, d_out)] of some target, alpha <= 0, dropout != 0 (see
    ``_NO_DROPOUT``), or a model LoRA was already applied to. To learn the linears' shapes it builds
    block 0's tree once, on fake tensors (no memory) when the block's init allows it.
    """
    if not isinstance(model, Model):
        raise TypeError(f"lora.apply: expected a zf.Model, got {type(model).__name__}")
    if isinstance(model.config, Config):
        raise ValueError(
            f"lora.apply: the model already has LoRA on {model.config.targets}; apply LoRA once, "
            "with every target in one call"
        )
    check_trainable(model)
    _check_numbers(rank, alpha, dropout)
    targets = _targets(model, targets)
    linears = find_linears(_block_tree(model))
    for target in targets:
        if target not in linears:
            raise ValueError(
                f"lora.apply: target {target!r} is not a linear of the model's blocks; expected "
                "some "
                f"of {sorted(linears)} (key paths inside a block)"
            )
        d_in, d_out = linears[target]
        if rank > min(d_in, d_out):
            raise ValueError(
                f"lora.apply: rank={rank} exceeds min(d_in, d_out) = {min(d_in, d_out)} of target "
                f"{target!r} (d_in={d_in}, d_out={d_out}); expected 1 <= rank <= {min(d_in, d_out)}"
            )
    cfg = Config(model.config, rank, float(alpha), float(dropout), targets)
    block = Stage(
        partial(_block_init, model.block.init, cfg), partial(_block_apply, model.block.apply, cfg)
    )
    return model._replace(block=block, config=cfg, trainable=Trainable(targets, model.trainable))


def base_config(cfg: Any) -> Any:
    """The config of the model before LoRA (``cfg.base`` for a ``lora.Config``, else ``cfg``
    itself)."""
    return cfg.base if isinstance(cfg, Config) else cfg


def bind(cfg: Config, tree: dict) -> dict:
    """A block tree of a LoRA model with ``"lora_scale": cfg.scale`` in each adapted linear's dict
    (copies along the paths; nothing changes in place): what ``layers.linear.apply`` reads. For
    calling a family's functions (``llama.block_apply``, ``llama.logits``) directly on a LoRA
    model's trees."""
    for target in cfg.targets:
        tree = _with_node(tree, target, lambda node: {**node, "lora_scale": cfg.scale})
    return tree


def merge(cfg: Config, tensors: dict[str, torch.Tensor], unit: str) -> dict[str, torch.Tensor]:
    """One unit's ``{full key path: tensor}`` (``unit``: "blocks.3", "embed", ...) with each adapted
    weight merged as PEFT's ``merge_and_unload`` does, ``W + (B @ A) * scale`` (its
    ``get_delta_weight``), and the LoRA leaves left out; other units come back as they are."""
    if not unit.startswith("blocks."):
        return tensors
    out = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[-1] not in LORA_LEAVES}
    for target in cfg.targets:
        at = f"{unit}.{target}"
        out[f"{at}.w"] = (
            tensors[f"{at}.w"] + (tensors[f"{at}.lora_b"] @ tensors[f"{at}.lora_a"]) * cfg.scale
        )
    return out


def find_linears(tree: Any, prefix: str = "") -> dict[str, tuple[int, int]]:
    """``{key path: (d_in, d_out)}`` of every linear in ``tree``: a dict of ``"w"`` (a 2-D tensor or
    a ``RowTiles`` / ``ColTiles``) and an optional ``"b"``."""
    if not isinstance(tree, dict):
        return {}
    if set(tree) <= _LINEAR_KEYS | set(LORA_LEAVES) and "w" in tree:
        shape = _weight_shape(tree["w"])
        return {prefix: (shape[1], shape[0])} if shape is not None and prefix else {}
    out = {}
    for key, value in tree.items():
        out.update(find_linears(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def lora_init(gen: torch.Generator, rank: int, d_in: int, d_out: int) -> dict:
    """``{"lora_a": (rank, d_in) kaiming_uniform_(a=sqrt(5)) from gen, "lora_b": (d_out, rank)
    zeros}``, fp32."""
    a = torch.empty(rank, d_in, device=gen.device, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # PEFT's reset_lora_parameters
    return {"lora_a": a, "lora_b": torch.zeros(d_out, rank, device=gen.device, dtype=torch.float32)}


# -- the stages ------------------------------------------------------------------------------------


def _block_init(init, cfg: Config, gen: torch.Generator, i: int) -> dict:
    tree = init(gen, i)  # first: the base leaves are the untransformed model's
    for target in cfg.targets:

        def adapted(node: dict) -> dict:
            d_in, d_out = find_linears({"x": node})["x"]
            experts = _n_experts(node["w"])
            if experts:  # stacked experts: one per expert
                return {**node, **moe_lora.init(gen, cfg.rank, experts, d_in, d_out)}
            return {**node, **lora_init(gen, cfg.rank, d_in, d_out)}

        tree = _with_node(tree, target, adapted)
    return tree


def _block_apply(apply, cfg: Config, params: dict, carry, *index: int):
    # index: the layer's, for a zf.Model(layer_index=True)
    return apply(bind(cfg, params), carry, *index)


# -- helpers ---------------------------------------------------------------------------------------


def _check_numbers(rank, alpha, dropout) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora.apply: rank must be an int >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(
            f"lora.apply: alpha must be a number > 0 (the scale is alpha / rank), got {alpha!r}"
        )
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"lora.apply: dropout must be a float in [0, 1), got {dropout!r}")
    if dropout != 0:
        raise ValueError(f"lora.apply: dropout={dropout} is not supported: {_NO_DROPOUT}")


def _targets(model: Model, targets) -> tuple[str, ...]:
    if targets is None:
        defaults = {llama.Config: ("attn.q", "attn.v"), gpt.Config: ("attn.qkv",)}
        if type(model.config) not in defaults:
            raise ValueError(
                "lora.apply: no default targets for a model with config "
                f"{type(model.config).__name__}; "
                "pass targets=(...), key paths of linears inside a block, e.g. ('attn.q', 'attn.v')"
            )
        return defaults[type(model.config)]
    if isinstance(targets, str) or not all(isinstance(t, str) for t in targets) or not targets:
        raise ValueError(
            "lora.apply: targets must be a non-empty tuple of key paths, e.g. ('attn.q', "
            "'attn.v'), "
            f"got {targets!r}"
        )
    if len(set(targets)) != len(targets):
        raise ValueError(f"lora.apply: targets repeat a name: {targets!r}")
    return tuple(targets)


def _block_tree(model: Model) -> Any:
    """Block 0's tree, on fake tensors (shapes only, no memory) when its init allows, else for
    real."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            return model.block.init(torch.Generator(), 0)
    except Exception:  # noqa: BLE001
        # an init that needs real values (e.g. .item()): build it for real
        return model.block.init(torch.Generator(), 0)


def _n_experts(w) -> int | None:
    """E of stacked experts' weight: an (E, out, in) tensor, or its E tiles (1, out, in)
    (``moe.Config.stream_experts``); None for a linear's."""
    if isinstance(w, torch.Tensor):
        return w.shape[0] if w.ndim == 3 else None
    if tiling.is_tiled(w) and w.tiles[0].ndim == 3:
        return sum(t.shape[0] for t in w.tiles)
    return None


def _weight_shape(w) -> tuple[int, int] | None:
    if isinstance(w, torch.Tensor):  # a linear (out, in), or stacked experts' (E, out, in)
        return tuple(w.shape[-2:]) if w.ndim in (2, 3) else None
    if tiling.is_tiled(w) and w.tiles[0].ndim == 3:  # streamed experts: E tiles (1, out, in)
        return tuple(w.tiles[0].shape[-2:])
    if tiling.is_tiled(w):
        shapes = [t.shape for t in w.tiles]
        if w.axis == 0:
            return sum(s[0] for s in shapes), shapes[0][1]
        return shapes[0][0], sum(s[1] for s in shapes)
    return None


def _with_node(tree: dict, path: str, change) -> dict:
    """``tree`` with the dict at dotted ``path`` replaced by ``change(it)`` (shallow copies along
    the path)."""
    key, _, rest = path.partition(".")
    return {**tree, key: _with_node(tree[key], rest, change) if rest else change(tree[key])}
