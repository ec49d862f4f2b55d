"""How each mixture-of-experts family names its MoE tensors on disk, as plain data, and the moves
both ways.

Names are relative: an HF name to its decoder layer (after ``model.layers.{i}.``), a leaf path to
its block (after ``blocks.{i}.``); the family's decoder table adds the prefixes. Our leaves are
``layers.moe``'s stacked tree under ``mlp`` (expert e = slice e along dim 0 of every expert leaf).
What transformers 5.25's ``save_pretrained`` writes (its in-memory fused ``gate_up_proj`` is split
on save):

    qwen3_moe, olmoe   mlp.gate.weight (E, D); mlp.experts.{e}.{gate,up,down}_proj.weight, nn.Linear
    layout mixtral            block_sparse_moe.gate.weight; block_sparse_moe.experts.{e}.w1 (gate),
    w3 (up), w2 (down) gpt_oss            mlp.router.weight (E, D), mlp.router.bias (E,); fused,
    input x output:
                       mlp.experts.gate_up_proj (E, D, 2I), gate and up interleaved along the last
                       dim (gate = [..., 0::2], up = [..., 1::2]), gate_up_proj_bias (E, 2I)
                       likewise, down_proj (E, I, D), down_proj_bias (E, D); self_attn.sinks (H,)

A ``Rule`` relates one HF name to one or two leaves by a ``kind`` of move; every move is a copy,
stack, slice or transpose, so import then export gives the source back bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch


class Rule(NamedTuple):
    """``kind`` of move between the HF tensor ``hf`` and the leaves ``ours``:

    same                    hf is the leaf as it is stack                   hf has ``{e}``: E
    per-expert tensors stacked along a new dim 0 make the leaf transposed              the leaf is
    hf with its last two dims swapped (input x output on disk) interleaved             ours = (gate,
    up): gate = hf[..., 0::2], up = hf[..., 1::2] interleaved_transposed  as interleaved, each then
    transposed over its last two dims
    """

    kind: str
    hf: str
    ours: tuple[str, ...]


def _per_expert(hf_layer: str, names: Mapping[str, str]) -> tuple[Rule, ...]:
    """``stack`` rules for per-expert linears: ``names`` maps our projection to its HF module
    name."""
    return tuple(Rule("stack", f"{hf_layer}.experts.{{e}}.{hf}.weight", (f"mlp.experts.{ours}.w",))
                 for ours, hf in names.items())


_SWIGLU_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
QWEN3_MOE = (Rule("same", "mlp.gate.weight", ("mlp.router.w",)), *_per_expert("mlp", _SWIGLU_NAMES))
OLMOE = QWEN3_MOE
MIXTRAL = (Rule("same", "block_sparse_moe.gate.weight", ("mlp.router.w",)),
           *_per_expert("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}))
GPT_OSS = (
    Rule("same", "mlp.router.weight", ("mlp.router.w",)),
    Rule("same", "mlp.router.bias", ("mlp.router.b",)),
    Rule("interleaved_transposed", "mlp.experts.gate_up_proj",
         ("mlp.experts.gate.w", "mlp.experts.up.w")),
    Rule("interleaved", "mlp.experts.gate_up_proj_bias",
         ("mlp.experts.gate.b", "mlp.experts.up.b")),
    Rule("transposed", "mlp.experts.down_proj", ("mlp.experts.down.w",)),
    Rule("same", "mlp.experts.down_proj_bias", ("mlp.experts.down.b",)),
    Rule("same", "self_attn.sinks", ("attn.sinks",)),
)
RULES = {"qwen3_moe": QWEN3_MOE, "olmoe": OLMOE, "mixtral": MIXTRAL, "gpt_oss": GPT_OSS}


def hf_names(rules: tuple[Rule, ...], n_experts: int) -> list[str]:
    """Every layer-relative HF name the rules cover, per-expert names expanded for ``n_experts``."""
    return [name for rule in rules for name in _expanded(rule, n_experts)]


def leaf_paths(rules: tuple[Rule, ...]) -> list[str]:
    """Every block-relative leaf path the rules fill."""
    return [path for rule in rules for path in rule.ours]


def import_layer(rules: tuple[Rule, ...], get: Callable[[str], torch.Tensor],
                 n_experts: int) -> dict:
    """``{leaf path: tensor}`` for one layer from ``get(layer-relative HF name)``; each HF tensor
    read once."""
    leaves = {}
    for rule in rules:
        leaves.update(zip(rule.ours, import_rule(rule, get, n_experts), strict=True))
    return leaves


def import_rule(rule: Rule, get: Callable[[str], torch.Tensor],
                n_experts: int) -> tuple[torch.Tensor, ...]:
    """The leaves ``rule.ours`` (in that order) made from the HF tensor(s) ``rule`` names."""
    if rule.kind == "stack":
        return (torch.stack([get(name) for name in _expanded(rule, n_experts)]),)
    source = get(rule.hf)
    if rule.kind == "same":
        return (source,)
    if rule.kind == "transposed":
        return (source.mT.contiguous(),)
    gate, up = source[..., 0::2], source[..., 1::2]
    if rule.kind == "interleaved_transposed":
        gate, up = gate.mT, up.mT
    return gate.contiguous(), up.contiguous()


def export_layer(rules: tuple[Rule, ...], leaves: Mapping[str, torch.Tensor],
                 n_experts: int) -> dict:
    """``{layer-relative HF name: tensor}`` from one layer's ``leaves`` (block-relative paths); the
    inverse of ``import_layer``. Raises ``ValueError`` naming a leaf the rules need and ``leaves``
    lacks, or a stacked leaf whose dim 0 is not ``n_experts``."""
    missing = [path for path in leaf_paths(rules) if path not in leaves]
    if missing:
        raise ValueError(f"moe_names.export_layer: leaves {missing} missing; expected every "
                         "leaf of "
                         f"{leaf_paths(rules)}")
    out = {}
    for rule in rules:
        out.update(export_rule(rule, [leaves[path] for path in rule.ours], n_experts))
    return out


def export_rule(rule: Rule, leaves: list[torch.Tensor], n_experts: int) -> dict:
    """``{HF name: tensor}`` of one rule from its leaves (in ``rule.ours``'s order)."""
    if rule.kind == "stack":
        (stacked,) = leaves
        if stacked.shape[0] != n_experts:
            raise ValueError(f"moe_names: leaf {rule.ours[0]} has {stacked.shape[0]} experts along "
                             "dim 0, "
                             f"expected n_experts={n_experts}")
        return {name: stacked[e].contiguous() for e, name in enumerate(_expanded(rule, n_experts))}
    if rule.kind == "same":
        return {rule.hf: leaves[0]}
    if rule.kind == "transposed":
        return {rule.hf: leaves[0].mT.contiguous()}
    gate, up = leaves
    if rule.kind == "interleaved_transposed":
        gate, up = gate.mT, up.mT
    fused = torch.stack((gate, up), dim=-1)  # (..., n, 2): gate at even, up at odd positions
    return {rule.hf: fused.reshape(*gate.shape[:-1], 2 * gate.shape[-1])}


def _expanded(rule: Rule, n_experts: int) -> list[str]:
    if rule.kind != "stack":
        return [rule.hf]
    return [rule.hf.format(e=e) for e in range(n_experts)]
