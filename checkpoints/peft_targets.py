"""Which PEFT tensor holds each LoRA leaf, and the moves between PEFT's layout and ours.

A linear (``attn.q``, GPT-2's ``attn.qkv``, ...) is a PEFT ``target_modules`` entry: its A and B are
``lora.Linear``'s, stored as they are::

    blocks.3.attn.q.lora_a   base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (r, in)

Stacked experts (``mlp.experts.gate_up``, ``mlp.experts.down`` of Qwen3-MoE, Mixtral, OLMoE and
gpt-oss) are PEFT ``target_parameters``: transformers 5.25 holds every family's experts in one
``mlp.experts`` module with the 3-D parameters ``gate_up_proj`` and ``down_proj``, and PEFT wraps
each adapted parameter in a ``lora.ParamWrapper`` whose factors sit side by side in two
``nn.Linear`` s (``layers.moe_lora``: (r*E, in) and (out, r*E))::

    blocks.3.mlp.experts.down.lora_a   ...model.layers.3.mlp.experts.lora_A.weight (r*E, I)

When both are adapted, PEFT nests the wrappers: it wraps the parameters in the order the experts
module declares them (``gate_up_proj``, then ``down_proj``), each new wrapper holding the last as
its ``base_layer``, so ``gate_up``'s factors are named
``...mlp.experts.base_layer.lora_A.weight`` and ``down``'s ``...mlp.experts.lora_A.weight`` (what
``PeftModel.save_pretrained`` writes, checked by tests/models/test_moe_families.py against PEFT's
own files).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from layers import lora, moe_lora, moe_names
from zinf_fn.state import BLOCKS

from .hf import family_of, stacked_names
from .manifest import CheckpointError

PREFIX = "base_model.model."
PEFT_LEAF = {"lora_a": "lora_A", "lora_b": "lora_B"}
HF_LAYER = "model.layers."
# our expert target -> transformers' parameter of it in every MoE family, in the order the experts
# module declares them: the order PEFT wraps them in (module docstring)
EXPERT_PARAMETERS = {
    "mlp.experts.gate_up": "mlp.experts.gate_up_proj",
    "mlp.experts.down": "mlp.experts.down_proj",
}


class Adapted(NamedTuple):
    """One adapted linear of one block: where PEFT keeps its A and B, and in which layout."""

    module: str  # PEFT's module of the factors after PREFIX: model.layers.3.self_attn.q_proj
    n_experts: int  # 0: a linear (A and B as they are); E: stacked experts (moe_lora's layout)
    interleaved: bool  # the HF tensor alternates gate and up outputs (gpt-oss's gate_up_proj)


def adapted(cfg: lora.Config) -> dict[str, Adapted]:
    """``{"blocks.{i}.{target}": Adapted}`` of every target in every block. Raises
    ``CheckpointError`` for a target PEFT cannot adapt alone: one that lives in a fused HF tensor
    with other leaves (Phi-3's q, k, v in one ``qkv_proj``) or a mixture of experts' router."""
    modules = hf_modules(cfg.base, cfg.targets)
    out = {ours: Adapted(module, 0, False) for ours, module in modules.items()}
    out.update(_experts(cfg))
    found = {ours.split(".", 2)[2] for ours in out}
    alone = [t for t in cfg.targets if t not in found]
    router = [t for t in alone if t == "mlp.router"]
    if router:
        raise CheckpointError(
            f"LoRA targets {router}: a mixture of experts' router has no PEFT "
            "adapter form to_peft writes; expected attention targets (attn.q, "
            "attn.k, attn.v, attn.o) or the experts (mlp.experts.gate_up, "
            "mlp.experts.down), or merge the adapters into the weights instead "
            "(checkpoints.to_hf(state, dir, merge_lora=True))"
        )
    if alone:
        model_type = family_of(cfg.base).to_hf(cfg.base)["model_type"]
        raise CheckpointError(
            f"LoRA targets {alone}: the {model_type} model holds them in a "
            "fused HF tensor with other leaves, which a PEFT adapter adapts "
            "whole; expected targets with a module of their own (e.g. attn.o, "
            "mlp.down), or merge the adapters into the weights instead "
            "(checkpoints.to_hf(state, dir, merge_lora=True))"
        )
    return out


def peft_names(cfg: lora.Config) -> dict[str, str]:
    """``{our key path: PEFT tensor name}`` of every LoRA leaf: ``blocks.3.attn.q.lora_a`` ->
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``; raises as ``adapted``."""
    return {
        f"{ours}.{leaf}": peft_name(at, leaf)
        for ours, at in adapted(cfg).items()
        for leaf in PEFT_LEAF
    }


def peft_name(at: Adapted, leaf: str) -> str:
    """PEFT's tensor name of our LoRA leaf ``leaf`` ("lora_a" / "lora_b") of ``at``."""
    return f"{PREFIX}{at.module}.{PEFT_LEAF[leaf]}.weight"


def hf_modules(base, targets: tuple[str, ...]) -> dict[str, str]:
    """``{"blocks.{i}.{target}": HF module name}`` of every linear of ``targets`` in the model of
    config ``base`` (``model.layers.3.self_attn.q_proj``), through the family's name map."""
    family = family_of(base)
    out = {}
    experts = stacked_names(base)  # an MoE model's experts and router: no LoRA module here
    for name in family.hf_names(base):
        fused = family.fused_parts(base, name)  # a fused tensor: no module of its own
        if name.endswith(".weight") and not fused and name not in experts:
            ours = family.hf_to_ours(name)[: -len(".w")]
            parts = ours.split(".")
            if parts[0] == BLOCKS and ".".join(parts[2:]) in targets:
                out[ours] = name[: -len(".weight")]
    return out


def _experts(cfg: lora.Config) -> dict[str, Adapted]:
    """``adapted``'s entries of the expert targets (none for a dense model)."""
    base = cfg.base
    chosen = [t for t in EXPERT_PARAMETERS if t in cfg.targets]
    if getattr(base, "moe", None) is None or not chosen:
        return {}
    kinds = {rule.ours: rule.kind for rule in moe_names.RULES[base.family]}
    out = {}
    for i in range(base.n_layers):
        for k, target in enumerate(chosen):
            wrappers_around = len(chosen) - 1 - k  # later wrappers hold this one as base_layer
            experts = EXPERT_PARAMETERS[target].rsplit(".", 1)[0]  # the module: mlp.experts
            module = f"{HF_LAYER}{i}.{experts}" + ".base_layer" * wrappers_around
            interleaved = kinds[f"{target}.w"].startswith("deinterleaved")
            out[f"{BLOCKS}.{i}.{target}"] = Adapted(module, base.moe.n_experts, interleaved)
    return out


# -- adapter_config.json's targets ---------------------------------------------------------------


def target_modules(cfg: lora.Config) -> list[str]:
    """PEFT's ``target_modules``: per linear target, the shortest dotted suffix of its module names
    that PEFT's suffix match (``name == s or name.endswith("." + s)``) finds on exactly that
    target's modules."""
    family, base = family_of(cfg.base), cfg.base
    modules = {name.rsplit(".", 1)[0] for name in family.hf_names(base)}
    linears = hf_modules(base, cfg.targets)
    out = []
    for target in cfg.targets:
        mine = {m for ours, m in linears.items() if ours.split(".", 2)[2] == target}
        if not mine:
            continue  # an expert target: target_parameters
        parts = next(iter(mine)).split(".")
        for k in range(1, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if {m for m in modules if m == suffix or m.endswith("." + suffix)} == mine:
                out.append(suffix)
                break
    return sorted(out)


def target_parameters(cfg: lora.Config) -> list[str] | None:
    """PEFT's ``target_parameters``: the transformers parameters of the expert targets (None for
    none, as PEFT writes a config without them)."""
    chosen = sorted(EXPERT_PARAMETERS[t] for t in EXPERT_PARAMETERS if t in cfg.targets)
    return chosen or None


def matched_targets(config_json: dict, cfg: lora.Config, wanted: dict, where: str) -> set[str]:
    """Our targets an ``adapter_config.json``'s ``target_modules`` (a list of suffixes or a regex,
    matched among the blocks' linears: the 2-D ``.w`` leaves of ``wanted``) and
    ``target_parameters`` (suffixes of the experts' parameters, as PEFT matches them) select."""
    field = config_json.get("target_modules")
    linears = tuple(
        sorted(
            {
                p[: -len(".w")].split(".", 2)[2]
                for p, shape in wanted.items()
                if p.startswith(BLOCKS + ".") and p.endswith(".w") and len(shape) == 2
            }
        )
    )
    modules = hf_modules(cfg.base, linears)
    if isinstance(field, str):
        hit = {ours for ours, m in modules.items() if re.fullmatch(field, m)}
    elif field is None or _strings(field):
        hit = {ours for ours, m in modules.items() for s in field or [] if _suffix(m, s)}
    else:
        raise CheckpointError(
            f"{where}: target_modules: expected a list of module names or a regex, got {field!r}"
        )
    params = config_json.get("target_parameters") or []
    if not _strings(params):
        raise CheckpointError(
            f"{where}: target_parameters: expected a list of parameter names "
            f"(mlp.experts.gate_up_proj, mlp.experts.down_proj), got {params!r}"
        )
    if getattr(cfg.base, "moe", None) is not None:
        hit |= {
            f"{BLOCKS}.{i}.{t}"
            for i in range(cfg.base.n_layers)
            for t, name in EXPERT_PARAMETERS.items()
            if any(_suffix(f"{HF_LAYER}{i}.{name}", s) for s in params)
        }
    return {ours.split(".", 2)[2] for ours in hit}


def _suffix(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(s, str) for s in value)


# -- the factors' layouts ------------------------------------------------------------------------


def to_peft(at: Adapted, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our A and B of one adapted linear -> PEFT's ``lora_A.weight`` and ``lora_B.weight``."""
    if not at.n_experts:
        return a, b
    return moe_lora.to_peft(a, b, interleaved=at.interleaved)


def from_peft(at: Adapted, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ``lora_A.weight`` and ``lora_B.weight`` of one adapted linear -> our A and B; the
    inverse of ``to_peft`` (bitwise)."""
    if not at.n_experts:
        return a, b
    return moe_lora.from_peft(a, b, at.n_experts, interleaved=at.interleaved)


def peft_shape(leaf: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape PEFT stores our LoRA leaf ``leaf`` ("lora_a" / "lora_b") of ``shape`` in: a
    linear's as it is; stacked experts' (E, r, in) as (r*E, in), (E, out, r) as (out, r*E)."""
    shape = tuple(shape)
    if len(shape) == 2:
        return shape
    n_experts, rows, cols = shape
    return (n_experts * rows, cols) if leaf == "lora_a" else (rows, cols * n_experts)
