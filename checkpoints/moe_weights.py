"""A checkpoint's MoE tensors read as stacked leaves, for the one-name-one-leaf importer.

The importer (``weights._from_source``) maps each source name to one leaf. A MoE file names E
tensors per expert leaf (Qwen3-MoE, Mixtral, OLMoE) or one tensor for two leaves (gpt-oss's
interleaved ``gate_up_proj``). ``ExpertWeights`` wraps a checkpoint's tensors
(``hf_files.HFWeights``, or ``mxfp4.Mxfp4Weights`` over it) so that, for every layer, the tensors a
family's ``layers.moe_names`` rules cover are replaced by one virtual name per leaf, the leaf path
under the layer's HF prefix (``model.layers.3.mlp.experts.gate.w``); ``name_pairs`` gives the
(virtual name, engine key path) entries a family's name table adds for them. Shapes come from the
headers without reading; ``get`` reads the rule's tensors when asked (gpt-oss's gate and up share
one read).
"""

from __future__ import annotations

import torch

from layers import moe_names
from layers.moe_names import Rule

from .manifest import CheckpointError
from .mxfp4 import Weights

HF_LAYER = "model.layers."
OUR_LAYER = "blocks."


def name_pairs(rules: tuple[Rule, ...]) -> list[tuple[str, str]]:
    """(virtual HF-side name, engine key path) of each leaf the rules fill; ``{i}``: the layer."""
    return [(f"{HF_LAYER}{{i}}.{leaf}", f"{OUR_LAYER}{{i}}.{leaf}")
            for leaf in moe_names.leaf_paths(rules)]


class ExpertWeights:
    """``weights`` with each layer's MoE tensors read through ``rules`` as stacked leaves."""

    def __init__(self, weights: Weights, rules: tuple[Rule, ...], n_experts: int, n_layers: int):
        self.weights = weights
        self.rules = rules
        self.n_experts = n_experts
        self.virtual: dict[str, tuple[int, Rule, int]] = {}   # name -> (layer, rule, leaf position)
        covered = set()
        for i in range(n_layers):
            for rule in rules:
                covered.update(self._sources(i, rule))
                for j, leaf in enumerate(rule.ours):
                    self.virtual[f"{HF_LAYER}{i}.{leaf}"] = (i, rule, j)
        present = set(weights.names())
        missing = sorted(covered - present)
        if missing:
            more = " ..." if len(missing) > 4 else ""
            raise CheckpointError(f"MoE checkpoint: tensors {missing[:4]}{more} missing "
                                  f"({len(missing)} in all); expected the tensors of every one "
                                  f"of the {n_experts} experts config.json gives, in each of the "
                                  f"{n_layers} layers")
        self.covered = covered
        self._last: tuple[tuple[int, Rule], tuple[torch.Tensor, ...]] | None = None

    def names(self) -> list[str]:
        kept = [name for name in self.weights.names() if name not in self.covered]
        return kept + list(self.virtual)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.virtual:
            return self.weights.shape(name)
        i, rule, _ = self.virtual[name]
        source = tuple(self.weights.shape(self._sources(i, rule)[0]))
        return leaf_shape(rule, source, self.n_experts)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.virtual:
            return self.weights.get(name)
        i, rule, j = self.virtual[name]
        if self._last is None or self._last[0] != (i, rule):   # gate then up: one read of gate_up
            prefix = f"{HF_LAYER}{i}."
            def read(hf: str) -> torch.Tensor:
                return self.weights.get(prefix + hf)

            leaves = moe_names.import_rule(rule, read, self.n_experts)
            self._last = ((i, rule), leaves)
        return self._last[1][j]

    def locate(self, name: str) -> str:
        if name not in self.virtual:
            return self.weights.locate(name)
        i, rule, _ = self.virtual[name]
        first = self.weights.locate(self._sources(i, rule)[0])
        return f"{name!r} made from {first} and the other tensors of its rule"

    def _sources(self, i: int, rule: Rule) -> list[str]:
        return [f"{HF_LAYER}{i}.{hf}" for hf in moe_names.hf_names((rule,), self.n_experts)]


def leaf_shape(rule: Rule, source: tuple[int, ...], n_experts: int) -> tuple[int, ...]:
    """The shape of ``rule``'s leaves made from HF tensors of shape ``source`` (one expert's for
    ``stack``)."""
    if rule.kind == "stack":
        return (n_experts, *source)
    if rule.kind == "same":
        return source
    if rule.kind == "transposed":
        return (*source[:-2], source[-1], source[-2])
    half = (*source[:-1], source[-1] // 2)
    if rule.kind == "interleaved_transposed":
        return (*half[:-2], half[-1], half[-2])
    return half
