"""PEFT LoRA adapters out and in: the directory ``peft.PeftModel.from_pretrained(base, dir)`` loads.

    checkpoints.to_peft(state, "adapter_dir")            # a LoRA model's A and B (layers.lora)
    base = AutoModelForCausalLM.from_pretrained("hf_dir"); peft.PeftModel.from_pretrained(base,
    "adapter_dir") state = checkpoints.from_peft("adapter_dir", state)  # an adapter into a LoRA
    state made for its base

    adapter_dir/adapter_config.json          PEFT's LoraConfig: r, lora_alpha, target_modules, ...
    adapter_dir/adapter_model.safetensors
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight (r, d_in)
                                             ...lora_B.weight (d_out, r); metadata "zinf_fn.lora":
                                             the base's config.json and our targets (ADAPTER_FORMAT,
                                             version 1)

Names are PEFT's (``checkpoints.peft_targets``): the HF module of a target comes from the family's
name map (``layers.llama.HF_NAMES``, ``layers.gpt2_hf.HF_NAMES``), and ``target_modules`` holds the
shortest suffix of the module name that matches it alone (``q_proj``; GPT-2's ``c_attn``,
``attn.c_proj``), as PEFT matches them. GPT-2's Conv1D modules are written with ``fan_in_fan_out:
true`` (what PEFT sets for them); A and B are stored as ``nn.Linear`` s of rank r either way. A
mixture of experts' stacked experts (``mlp.experts.gate_up``, ``mlp.experts.down``) are PEFT
``target_parameters`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), each expert's A and
B side by side in one ``lora_A`` (r*E, d_in) and one ``lora_B`` (d_out, r*E), as PEFT's
``lora.ParamWrapper`` holds them.
"""

from __future__ import annotations

import json
import os

import torch

from layers import lora
from layers.lora import LORA_LEAVES
from zinf_fn.state import BLOCKS, units, view

from . import peft_targets
from .hf import family_of, gather_unit
from .hf_files import read_json
from .manifest import CheckpointError
from .peft_targets import peft_names
from .safetensors_io import Entry, Reader, StreamWriter
from .save import check_live
from .weights import _wanted

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FORMAT = (
    "zinf_fn.lora"  # the safetensors metadata key of what to_peft records; its format_version:
)
FORMAT_VERSION = 1
__all__ = ["from_peft", "peft_names", "to_peft"]


def to_peft(
    state,
    path: str,
    dtype: torch.dtype = torch.float32,
    *,
    base_model_name_or_path: str | None = None,
) -> list[str]:
    """Write the LoRA leaves of ``state`` (a model from ``layers.lora.apply``) as a PEFT adapter
    directory at ``path``; returns the file names written. ``dtype``: of the stored A and B (fp32:
    the masters bitwise). ``base_model_name_or_path``: recorded in ``adapter_config.json`` (what
    ``from_peft`` may check) and where PEFT's loaders look for the base. Memory: one gathered layer
    plus the adapter.

    Collective at world size > 1: every rank calls it; rank 0 writes. Does not consume the state.
    The base weights are not written: the adapter applies to the base model as it was imported (the
    engine stores the frozen base as its 16-bit copy: an fp32 import is rounded to ``param_dtype``).
    """
    check_live(state, "checkpoints.to_peft")
    cfg = _lora_config(state.model.config, "checkpoints.to_peft")
    adapted = peft_targets.adapted(cfg)
    store = view(state)
    store.flush()  # sync: the last step's write-behind is in the tiers
    tensors = {}
    for unit in units(store.n_layers):
        if unit.group != BLOCKS:
            continue
        gathered = gather_unit(
            store, unit
        )  # collective: every rank gathers every block, in this order
        tensors.update(_peft_tensors(adapted, gathered, unit.name, dtype))
    files, error = [], None
    if store.comm.rank == 0:
        try:
            files = _write(path, tensors, adapter_config(cfg, base_model_name_or_path), cfg)
        except Exception as e:  # noqa: BLE001 - reported to every rank after the exchange
            error = e
    # sync: every rank returns (or raises) once rank 0 has written the adapter
    failed, files = store.comm.all_gather_object(
        (f"{type(error).__name__}: {error}" if error else None, files)
    )[0]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"checkpoints.to_peft: rank 0 failed to write {path!r}: {failed}")
    return files


def from_peft(path: str, state, *, base_model_name_or_path: str | None = None):
    """Load the PEFT LoRA adapter at ``path`` into ``state``, a state of a ``layers.lora`` model
    (from ``checkpoints.from_hf(..., transform=lambda m: lora.apply(m, ...))`` or ``zf.init``) with
    the adapter's rank, alpha and targets; returns ``state``, whose A and B are now the adapter's
    (fp32 masters of the stored values) and its base weights unchanged. Each block's row is written
    whole, so the optimizer state of the blocks starts afresh (as after ``from_hf``). Collective at
    world size > 1.

    Refuses (``CheckpointError``, naming the file and the field) an adapter for another base model:
    another rank, alpha, target set, dropout, a LoRA variant the model does not compute (DoRA,
    rsLoRA, bias, per-layer patterns), tensors missing, unexpected or of other shapes, a base config
    recorded by ``to_peft`` that differs from the state's, or a ``base_model_name_or_path`` other
    than the one given.
    """
    check_live(state, "checkpoints.from_peft")
    cfg = _lora_config(state.model.config, "checkpoints.from_peft")
    store = view(state)
    wanted = _wanted(store)
    check_adapter_config(os.path.join(path, ADAPTER_CONFIG), cfg, wanted, base_model_name_or_path)
    adapted = peft_targets.adapted(cfg)
    reader = Reader(os.path.join(path, ADAPTER_WEIGHTS))
    check_adapter_weights(reader, cfg, peft_names(cfg), wanted)
    group = store.groups[BLOCKS]
    for unit in units(store.n_layers):
        if unit.group != BLOCKS:
            continue
        flat = torch.zeros(group.part.padded_numel, dtype=torch.float32)
        got = store.gather_row("master", unit)  # collective: the base leaves as they are
        flat[: got.numel()].copy_(got)
        values = _our_factors(adapted, reader, unit.name)
        for leaf in group.spec.leaves:
            full = f"{unit.name}.{leaf.path}"
            if full in values:
                flat[leaf.offset : leaf.offset + leaf.numel].copy_(values[full].reshape(-1))
        store.load_row_(unit, flat)
    return state


def _peft_tensors(adapted: dict, gathered: dict, unit: str, dtype: torch.dtype) -> dict:
    """``{PEFT tensor name: tensor in dtype}`` of the LoRA factors of one gathered block ``unit``
    (``gathered``: its full key paths)."""
    out = {}
    for ours, at in adapted.items():
        if ours.startswith(unit + "."):
            a, b = gathered[f"{ours}.lora_a"], gathered[f"{ours}.lora_b"]
            factors = peft_targets.to_peft(at, a, b)
            for leaf, tensor in zip(LORA_LEAVES, factors, strict=True):
                out[peft_targets.peft_name(at, leaf)] = tensor.to(dtype)
    return out


def _our_factors(adapted: dict, reader: Reader, unit: str) -> dict[str, torch.Tensor]:
    """``{full key path: tensor}`` of the LoRA leaves of block ``unit``, read from the adapter
    file and moved into our layout."""
    out = {}
    for ours, at in adapted.items():
        if ours.startswith(unit + "."):
            stored = [reader.get(peft_targets.peft_name(at, leaf)) for leaf in LORA_LEAVES]
            factors = peft_targets.from_peft(at, *stored)
            out.update({f"{ours}.{leaf}": t for leaf, t in zip(LORA_LEAVES, factors, strict=True)})
    return out


# -- the files
# -------------------------------------------------------------------------------------------


def adapter_config(cfg: lora.Config, base_model_name_or_path: str | None) -> dict:
    """The ``adapter_config.json`` PEFT writes for ``LoraConfig(r, lora_alpha, target_modules,
    target_parameters, lora_dropout)``."""
    family = family_of(cfg.base)
    linears = peft_targets.hf_modules(cfg.base, cfg.targets).values()
    conv1d = any(family.transposed(m + ".weight") for m in linears)
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": peft_targets.target_modules(cfg),
        "target_parameters": peft_targets.target_parameters(cfg),
        "fan_in_fan_out": conv1d,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def _write(
    path: str, tensors: dict[str, torch.Tensor], config_json: dict, cfg: lora.Config
) -> list[str]:
    os.makedirs(path, exist_ok=True)
    family = family_of(cfg.base)
    record = {
        "format_version": FORMAT_VERSION,
        "targets": list(cfg.targets),
        "base": family.to_hf(cfg.base),
    }
    entries = [Entry(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    writer = StreamWriter(
        os.path.join(path, ADAPTER_WEIGHTS),
        entries,
        {"format": "pt", ADAPTER_FORMAT: json.dumps(record, sort_keys=True)},
    )
    try:
        for entry in entries:
            writer.write(tensors[entry.name].contiguous())
        writer.close()
    except BaseException:
        writer.abort()
        raise
    with open(os.path.join(path, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        f.write(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def check_adapter_config(
    where: str, cfg: lora.Config, wanted: dict, base_model_name_or_path: str | None
) -> None:
    """Raise CheckpointError unless the adapter_config.json at ``where`` is LoRA as ``cfg`` computes
    it."""
    got = read_json(where, "the adapter_config.json of a PEFT LoRA adapter")
    expected = {
        "peft_type": "LORA",
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "use_dora": False,
        "use_rslora": False,
        "bias": "none",
        "layers_to_transform": None,
    }
    defaults = {
        "lora_dropout": 0.0,
        "use_dora": False,
        "use_rslora": False,
        "bias": "none",
        "layers_to_transform": None,
    }
    for key, want in expected.items():
        value = got.get(key, defaults.get(key))
        if value != want or isinstance(value, bool) != isinstance(want, bool):
            raise CheckpointError(
                f"{where}: {key}: expected {want!r} (this model's LoRA: rank {cfg.rank}, alpha "
                f"{cfg.alpha}, targets {cfg.targets}), got {value!r}; an adapter for another "
                "model, or lora.apply with other arguments"
            )
    for key in ("rank_pattern", "alpha_pattern"):
        if got.get(key):
            raise CheckpointError(
                f"{where}: {key}: expected none (one rank and alpha for every "
                f"module), got {got[key]!r}"
            )
    targets = peft_targets.matched_targets(got, cfg, wanted, where)
    if targets != set(cfg.targets):
        fields = {key: got.get(key) for key in ("target_modules", "target_parameters")}
        raise CheckpointError(
            f"{where}: target_modules {fields['target_modules']!r} (and "
            f"target_parameters {fields['target_parameters']!r}) adapt "
            f"{sorted(targets)}; expected this model's targets "
            f"{sorted(cfg.targets)}"
        )
    recorded = got.get("base_model_name_or_path")
    if (
        base_model_name_or_path is not None
        and recorded is not None
        and recorded != base_model_name_or_path
    ):
        raise CheckpointError(
            f"{where}: base_model_name_or_path: the adapter is for {recorded!r}, expected "
            f"{base_model_name_or_path!r}"
        )


def check_adapter_weights(
    reader: Reader, cfg: lora.Config, names: dict[str, str], wanted: dict
) -> None:
    """Raise CheckpointError unless the file holds exactly ``names``' tensors in the model's shapes
    and a base config, if ``to_peft`` recorded one, equal to the state's."""
    where = reader.path
    record = reader.metadata.get(ADAPTER_FORMAT)
    if record is not None:
        try:
            record = json.loads(record)
        except ValueError as e:
            raise CheckpointError(f"{where}: metadata {ADAPTER_FORMAT}: not JSON ({e})") from None
        _check_record(where, record, cfg)
    present = set(reader.names())
    shapes = {
        peft: peft_targets.peft_shape(ours.rsplit(".", 1)[1], wanted[ours])
        for ours, peft in names.items()
    }
    problems = [
        f"{peft}: missing (the model wants shape {shapes[peft]})"
        for peft in shapes
        if peft not in present
    ]
    problems += [
        f"{name}: not a LoRA tensor of this model" for name in sorted(present - set(shapes))
    ]
    problems += [
        f"{peft}: shape {reader.shape(peft)}, the model wants {shape}"
        for peft, shape in shapes.items()
        if peft in present and reader.shape(peft) != shape
    ]
    if problems:
        raise CheckpointError(
            f"{where}: not an adapter for this model (an adapter for another base model?):\n  "
            + "\n  ".join(problems)
        )


def _check_record(where: str, record: dict, cfg: lora.Config) -> None:
    if not isinstance(record, dict) or record.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: metadata {ADAPTER_FORMAT}: expected format_version {FORMAT_VERSION}, got "
            f"{record.get('format_version') if isinstance(record, dict) else record!r}"
        )
    ours = family_of(cfg.base).to_hf(cfg.base)
    base = record.get("base") or {}
    differ = sorted(
        k
        for k in set(ours) | set(base)
        if k not in ("dtype", "torch_dtype") and ours.get(k) != base.get(k)
    )
    if differ:
        key = differ[0]
        raise CheckpointError(
            f"{where}: the adapter was written for another base model: config field {key!r} is "
            f"{base.get(key)!r} there, {ours.get(key)!r} here (differing: {differ})"
        )


def _lora_config(cfg, what: str) -> lora.Config:
    if not isinstance(cfg, lora.Config):
        raise TypeError(
            f"{what}: expected a state of a LoRA model (layers.lora.apply(model, ...), whose "
            f"model.config is a lora.Config), got model.config of type {type(cfg).__name__}"
        )
    return cfg
