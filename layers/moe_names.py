"""Each mixture-of-experts family's tensor names on disk, as plain data, and the moves both ways.

Names are relative: an HF name to its decoder layer (after ``model.layers.{i}.``), a leaf path to
its block (after ``blocks.{i}.``); the family's decoder table adds the prefixes. Our leaves are
``layers.moe``'s stacked tree under ``mlp`` (expert e = slice e along dim 0 of every expert leaf,
``gate_up`` gate rows first). What transformers 5.25's ``save_pretrained`` writes (Qwen3-MoE,
Mixtral and OLMoE hold a fused ``gate_up_proj`` in memory and split it per expert on save):

    qwen3_moe, olmoe  mlp.gate.weight (E, D);
                      mlp.experts.{e}.gate_proj.weight, up_proj (I, D), down_proj (D, I)
    mixtral           block_sparse_moe.gate.weight (E, D);
                      block_sparse_moe.experts.{e}.w1.weight (gate), w3 (up), w2 (down)
    gpt_oss           mlp.router.weight (E, D), mlp.router.bias (E,); fused, input x output:
                      mlp.experts.gate_up_proj (E, D, 2I), gate and up interleaved along the
                      last dim (gate = [..., 0::2], up = [..., 1::2]); gate_up_proj_bias (E, 2I)
                      likewise; down_proj (E, I, D); down_proj_bias (E, D); self_attn.sinks (H,)

A ``Rule`` fills one leaf from one or two HF names by a ``kind`` of move; every move is a copy,
stack, concatenation, slice or transpose, so import then export gives the source back bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch


class Rule(NamedTuple):
    """``kind`` of move between the HF tensors ``hf`` and the leaf ``ours``:

    same                      hf[0] is the leaf as it is
    stack                     hf[0] has ``{e}``: E per-expert tensors stacked along a new dim 0
    stack_cat                 as stack, each expert's tensors of hf (gate, up) concatenated on dim 0
    transposed                the leaf is hf[0] with its last two dims swapped (input x output)
    deinterleaved             hf[0]'s last dim alternates gate, up: the leaf has gates, then ups
    deinterleaved_transposed  as deinterleaved, then the last two dims swapped
    """

    kind: str
    hf: tuple[str, ...]
    ours: str


def _per_expert(hf_layer: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """The ``stack_cat`` and ``stack`` rules of per-expert linears ``gate``, ``up``, ``down``."""

    def name(linear: str) -> str:
        return f"{hf_layer}.experts.{{e}}.{linear}.weight"

    return (
        Rule("stack_cat", (name(gate), name(up)), "mlp.experts.gate_up.w"),
        Rule("stack", (name(down),), "mlp.experts.down.w"),
    )


QWEN3_MOE = (
    Rule("same", ("mlp.gate.weight",), "mlp.router.w"),
    *_per_expert("mlp", "gate_proj", "up_proj", "down_proj"),
)
OLMOE = QWEN3_MOE
MIXTRAL = (
    Rule("same", ("block_sparse_moe.gate.weight",), "mlp.router.w"),
    *_per_expert("block_sparse_moe", "w1", "w3", "w2"),
)
GPT_OSS = (
    Rule("same", ("mlp.router.weight",), "mlp.router.w"),
    Rule("same", ("mlp.router.bias",), "mlp.router.b"),
    Rule("deinterleaved_transposed", ("mlp.experts.gate_up_proj",), "mlp.experts.gate_up.w"),
    Rule("deinterleaved", ("mlp.experts.gate_up_proj_bias",), "mlp.experts.gate_up.b"),
    Rule("transposed", ("mlp.experts.down_proj",), "mlp.experts.down.w"),
    Rule("same", ("mlp.experts.down_proj_bias",), "mlp.experts.down.b"),
    Rule("same", ("self_attn.sinks",), "attn.sinks"),
)
RULES = {"qwen3_moe": QWEN3_MOE, "olmoe": OLMOE, "mixtral": MIXTRAL, "gpt_oss": GPT_OSS}


def hf_names(rules: tuple[Rule, ...], n_experts: int) -> list[str]:
    """Every layer-relative HF name the rules cover, per-expert names expanded for ``n_experts``."""
    return [name for rule in rules for name in expanded(rule, n_experts)]


def leaf_paths(rules: tuple[Rule, ...]) -> list[str]:
    """Every block-relative leaf path the rules fill."""
    return [rule.ours for rule in rules]


def expanded(rule: Rule, n_experts: int) -> list[str]:
    """The HF names of ``rule``: per-expert ones for every expert (expert-major)."""
    if rule.kind not in ("stack", "stack_cat"):
        return list(rule.hf)
    return [template.format(e=e) for e in range(n_experts) for template in rule.hf]


def import_layer(
    rules: tuple[Rule, ...], get: Callable[[str], torch.Tensor], n_experts: int
) -> dict:
    """``{leaf path: tensor}`` for one layer from ``get(layer-relative HF name)``."""
    return {rule.ours: import_rule(rule, get, n_experts) for rule in rules}


def import_rule(rule: Rule, get: Callable[[str], torch.Tensor], n_experts: int) -> torch.Tensor:
    """The leaf ``rule.ours`` made from the HF tensor(s) ``rule`` names, each read once."""
    if rule.kind in ("stack", "stack_cat"):
        per_expert = [torch.cat([get(t.format(e=e)) for t in rule.hf]) for e in range(n_experts)]
        return torch.stack(per_expert)  # (E, ...): a single tensor's cat is a copy of it
    (name,) = rule.hf
    source = get(name)
    if rule.kind == "same":
        return source
    if rule.kind == "transposed":
        return source.mT.contiguous()
    grouped = torch.cat((source[..., 0::2], source[..., 1::2]), dim=-1)  # gates, then ups
    if rule.kind == "deinterleaved_transposed":
        grouped = grouped.mT
    return grouped.contiguous()


def export_layer(
    rules: tuple[Rule, ...], leaves: Mapping[str, torch.Tensor], n_experts: int
) -> dict:
    """``{layer-relative HF name: tensor}`` from one layer's ``leaves`` (block-relative paths); the
    inverse of ``import_layer``. Raises ``ValueError`` naming a leaf the rules need and ``leaves``
    lacks, or a stacked leaf whose dim 0 is not ``n_experts``."""
    missing = [path for path in leaf_paths(rules) if path not in leaves]
    if missing:
        raise ValueError(
            f"moe_names.export_layer: leaves {missing} missing; expected every "
            f"leaf of {leaf_paths(rules)}"
        )
    out = {}
    for rule in rules:
        out.update(export_rule(rule, leaves[rule.ours], n_experts))
    return out


def export_rule(rule: Rule, leaf: torch.Tensor, n_experts: int) -> dict:
    """``{HF name: tensor}`` of one rule from its leaf."""
    if rule.kind in ("stack", "stack_cat"):
        if leaf.shape[0] != n_experts:
            raise ValueError(
                f"moe_names: leaf {rule.ours} has {leaf.shape[0]} experts along "
                f"dim 0, expected n_experts={n_experts}"
            )
        parts = [part for e in range(n_experts) for part in leaf[e].chunk(len(rule.hf))]
        return {
            name: part.contiguous()
            for name, part in zip(expanded(rule, n_experts), parts, strict=True)
        }
    (name,) = rule.hf
    if rule.kind == "same":
        return {name: leaf}
    if rule.kind == "transposed":
        return {name: leaf.mT.contiguous()}
    if rule.kind == "deinterleaved_transposed":
        leaf = leaf.mT
    gate, up = leaf.chunk(2, dim=-1)
    fused = torch.stack((gate, up), dim=-1)  # (..., n, 2): gate at even, up at odd positions
    return {name: fused.reshape(*gate.shape[:-1], 2 * gate.shape[-1])}
