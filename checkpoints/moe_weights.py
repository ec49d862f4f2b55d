"""A checkpoint's MoE tensors read as stacked leaves, for the one-name-one-leaf importer.

The importer (``weights._from_source``) maps each source name to one leaf. A MoE file names 2E
tensors for one ``gate_up`` leaf and E for one ``down`` leaf (Qwen3-MoE, Mixtral, OLMoE), or
regroups them (gpt-oss's interleaved, input x output ``gate_up_proj``). ``ExpertWeights`` wraps a
checkpoint's tensors (``hf_files.HFWeights``, or ``mxfp4.Mxfp4Weights`` over it) so that, for every
layer, the tensors a family's ``layers.moe_names`` rules cover are replaced by one virtual name per
leaf: the leaf path under the layer's HF prefix (``model.layers.3.mlp.experts.gate_up.w``), which
a family's table in ``layers.decoder_names`` maps to the leaf (``decoder_names.moe_leaves``). Shapes
come from the headers without reading; ``get`` reads the rule's tensors when asked.
"""

from __future__ import annotations

import torch

from layers import moe_names
from layers.moe_names import Rule

from .manifest import CheckpointError
from .mxfp4 import Weights

HF_LAYER = "model.layers."
OUR_LAYER = "blocks."


class ExpertWeights:
    """``weights`` with each layer's MoE tensors read through ``rules`` as stacked leaves."""

    def __init__(self, weights: Weights, rules: tuple[Rule, ...], n_experts: int, n_layers: int):
        self.weights = weights
        self.n_experts = n_experts
        self.virtual: dict[str, tuple[int, Rule]] = {}  # virtual name -> (layer, rule)
        covered = set()
        for i in range(n_layers):
            for rule in rules:
                covered.update(self._sources(i, rule))
                self.virtual[f"{HF_LAYER}{i}.{rule.ours}"] = (i, rule)
        missing = sorted(covered - set(weights.names()))
        if missing:
            more = " ..." if len(missing) > 4 else ""
            raise CheckpointError(
                f"MoE checkpoint: tensors {missing[:4]}{more} missing "
                f"({len(missing)} in all); expected the tensors of every one "
                f"of the {n_experts} experts config.json gives, in each of the "
                f"{n_layers} layers"
            )
        self.covered = covered

    def names(self) -> list[str]:
        kept = [name for name in self.weights.names() if name not in self.covered]
        return kept + list(self.virtual)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.virtual:
            return self.weights.shape(name)
        i, rule = self.virtual[name]
        sources = self._sources(i, rule)
        return leaf_shape(rule, [tuple(self.weights.shape(n)) for n in sources], self.n_experts)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.virtual:
            return self.weights.get(name)
        i, rule = self.virtual[name]
        prefix = f"{HF_LAYER}{i}."

        def read(hf: str) -> torch.Tensor:
            return self.weights.get(prefix + hf)

        return moe_names.import_rule(rule, read, self.n_experts)

    def locate(self, name: str) -> str:
        if name not in self.virtual:
            return self.weights.locate(name)
        i, rule = self.virtual[name]
        first = self.weights.locate(self._sources(i, rule)[0])
        return f"{name!r} made from {first} and the other tensors of its rule"

    def _sources(self, i: int, rule: Rule) -> list[str]:
        return [f"{HF_LAYER}{i}.{hf}" for hf in moe_names.expanded(rule, self.n_experts)]


def leaf_shape(rule: Rule, sources: list[tuple[int, ...]], n_experts: int) -> tuple[int, ...]:
    """The shape of ``rule``'s leaf made from HF tensors of shapes ``sources`` (``expanded``'s
    order; expert 0's first for the per-expert kinds)."""
    if rule.kind in ("stack", "stack_cat"):
        first = sources[: len(rule.hf)]  # expert 0's tensors, concatenated along dim 0
        return (n_experts, sum(shape[0] for shape in first), *first[0][1:])
    (source,) = sources
    if rule.kind in ("same", "deinterleaved"):
        return source
    return (*source[:-2], source[-1], source[-2])  # transposed, deinterleaved_transposed


def export_shapes(cfg, leaf_shapes: dict[str, tuple]) -> dict[str, tuple[int, ...]]:
    """The HF name -> shape of every MoE tensor ``to_hf`` writes for ``cfg`` (a decoder Config with
    ``moe`` set), from the stacked leaves' shapes (full key path -> shape); nothing is read."""
    rules = moe_names.RULES[cfg.family]
    out = {}
    for i in range(cfg.n_layers):
        leaves = {
            rule.ours: torch.empty(leaf_shapes[f"{OUR_LAYER}{i}.{rule.ours}"], device="meta")
            for rule in rules
        }
        for name, tensor in moe_names.export_layer(rules, leaves, cfg.moe.n_experts).items():
            out[f"{HF_LAYER}{i}.{name}"] = tuple(tensor.shape)
    return out


def export_unit(cfg, tensors: dict[str, torch.Tensor], unit_name: str) -> dict[str, torch.Tensor]:
    """The HF name -> tensor of the MoE tensors of one gathered unit (full key path -> tensor);
    {} for a unit that is no block (the embed, the head)."""
    if not unit_name.startswith(OUR_LAYER):
        return {}
    rules = moe_names.RULES[cfg.family]
    i = unit_name[len(OUR_LAYER) :]
    leaves = {rule.ours: tensors[f"{unit_name}.{rule.ours}"] for rule in rules}
    exported = moe_names.export_layer(rules, leaves, cfg.moe.n_experts)
    return {f"{HF_LAYER}{i}.{name}": tensor for name, tensor in exported.items()}
