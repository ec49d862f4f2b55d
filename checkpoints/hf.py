"""Hugging Face import and export: a transformers model directory in, a TrainState out, and back.

    model, state = checkpoints.from_hf("hf_dir", zf.adamw(lr=1e-5), zf.Config(offload_params="nvme",
    ...)) ...train...
    checkpoints.to_hf(state, "out_dir")   # AutoModelForCausalLM.from_pretrained("out_dir"); in the
    dtype read

    python -m checkpoints hf import HF_DIR CKPT_DIR [--placement nvme --nvme-path DIR]
    python -m checkpoints hf export CKPT_DIR OUT_DIR [--dtype bf16] [--max-shard-size 5GB]

Families: ``model_type`` llama, mistral, qwen2, qwen3, phi3, gemma3_text, qwen3_moe, mixtral,
olmoe and gpt_oss through the decoder of
``layers.llama`` (``layers.hf_families``; sliding windows of any length), and gpt2
(``GPT2LMHeadModel``) through ``layers.gpt`` / ``layers.gpt2_hf``, its Conv1D weights transposed on
the way in and out. Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` are cut into the decoder's q, k, v
and gate, up on the way in and concatenated again on the way out
(``layers.decoder_names.fused_parts``). Tied input/output embeddings (``tie_word_embeddings``,
GPT-2's and Gemma's default) are one weight (``zf.Tie``): read from the embedding's tensor, written
once, with no ``lm_head.weight``, as ``save_pretrained`` does. Mixtures of experts (qwen3_moe,
mixtral, olmoe, gpt_oss) go through the same decoder: their per-expert tensors are read as stacked
leaves (``moe_weights.ExpertWeights``; gpt-oss's MXFP4 through ``mxfp4.Mxfp4Weights``) and written
per expert again (``moe_weights.export_unit``).
The command line is ``checkpoints/hf_cli.py``.

Memory: ``from_hf`` reads one tensor at a time into one layer's flat buffer, which is sharded and
written to the state's tiers before the next layer is read; ``to_hf`` gathers one layer at a time
(master weights, fp32) and streams it into the shard files. Neither ever holds the whole model.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

from layers import decoder_names, gpt, gpt2_hf, llama, lora, moe_config, moe_names
from zinf_fn.model import Model
from zinf_fn.state import units, view

from . import moe_weights
from .hf_files import CONFIG, HFWeights, read_config
from .hf_shards import ShardWriter, parse_size, plan_shards
from .manifest import CheckpointError
from .mxfp4 import Mxfp4Weights, quantization
from .safetensors_io import Entry
from .save import check_live
from .weights import _from_source, _wanted

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Fields of an imported config.json that to_hf drops: the old spelling of "dtype", which it writes
# anew, and the quantization it read (the export is unquantized, as every tensor to_hf writes)
_REWRITTEN = ("torch_dtype", "quantization_config")


class HFFamily(NamedTuple):
    """How one transformers model family maps onto ``layers/``: its Config, model and tensor
    names."""

    config_type: type
    from_hf: Callable[..., Any]  # (config.json dict, **overrides) -> Config
    to_hf: Callable[[Any], dict]  # Config -> config.json dict
    model: Callable[[Any], Any]  # Config -> zf.Model
    hf_names: Callable[[Any], list[str]]  # Config -> the tensor names save_pretrained writes
    hf_to_ours: Callable[[str], str]  # HF name -> engine key path
    transposed: Callable[[str], bool]  # whether HF stores the tensor transposed (Conv1D)
    fused_parts: Callable[[Any, str], tuple]  # (Config, HF name) -> ((key path, rows), ...) held


def _unfused(cfg, name: str) -> tuple:
    """No tensor of the family holds several leaves."""
    return ()


def _not_transposed(name: str) -> bool:
    return False


def _decoder_family(model_type: str) -> HFFamily:
    return HFFamily(
        llama.Config,
        llama.Config.from_hf,
        llama.Config.to_hf,
        llama.model,
        llama.hf_names,
        partial(decoder_names.hf_to_ours, family=model_type),
        _not_transposed,
        decoder_names.fused_parts,
    )


GPT2 = HFFamily(
    gpt.Config,
    gpt2_hf.config_from_hf,
    gpt2_hf.config_to_hf,
    gpt.model,
    gpt2_hf.hf_names,
    gpt2_hf.hf_to_ours,
    gpt2_hf.transposed,
    _unfused,
)
FAMILIES = {**{name: _decoder_family(name) for name in llama.FAMILIES}, "gpt2": GPT2}


def family_of(cfg) -> HFFamily:
    """The family of a model's config (``state.model.config``; a LoRA model's base config);
    TypeError for a model of no HF family."""
    cfg = lora.base_config(cfg)
    if isinstance(cfg, llama.Config):
        return FAMILIES[cfg.family]
    if isinstance(cfg, gpt.Config):
        return GPT2
    raise TypeError(
        "checkpoints.to_hf: expected a state of a layers.llama or layers.gpt model (model.config "
        "a "
        f"llama.Config or gpt.Config), got model.config of type {type(cfg).__name__}"
    )


def from_hf(
    path: str,
    optimizer,
    config=None,
    *,
    overrides: dict | None = None,
    step: int = 0,
    transform: Callable[[Model], Model] | None = None,
    seed: int = 0,
):
    """``(model, state)`` from the HF directory ``path``: ``config.json`` picks the family and
    builds the ``zf.Model`` (``overrides`` replace ``llama.Config`` fields, e.g. ``{"seq_len": 512,
    "head_tiles": 8}``), then the weights fill a fresh state as ``zf.init`` lays it out, one tensor
    at a time, from ``model.safetensors`` or the shards ``model.safetensors.index.json`` names
    (fp32, bf16 or fp16 on disk; the master weights are their exact fp32 values). The optimizer
    state starts as ``optimizer.init`` makes it, at ``step``. Collective at world size > 1: every
    rank reads each layer and keeps its shard.

    Raises ``CheckpointError`` (a ``ValueError``) naming the file, the tensor and what was expected
    for a missing config.json, an unknown or unsupported model_type or config (sliding window, MoE,
    ...), a missing shard, an index entry its shard lacks, a tensor in no shard, a tensor the model
    does not have, or one of the wrong shape (a Conv1D weight's shape as it is on disk, ``(d_in,
    d_out)``).

    ``transform``: maps the family's model to the one to train, e.g. ``lambda m: lora.apply(m,
    rank=8, alpha=16, targets=("attn.q", "attn.v"))``. The HF tensors fill the leaves they name; the
    leaves the transform adds take the values ``zf.init(transformed, seed=seed)`` gives them (each
    block's init runs once, one block at a time, so the whole model is still never in memory).
    Returns the transformed model.
    """
    hf_config = read_config(path)
    cfg = model_config(hf_config, path, overrides)
    family = FAMILIES[hf_config["model_type"]]
    weights = HFWeights(path)
    if quantization(hf_config) == "mxfp4":  # gpt-oss's packed experts, dequantized when read
        weights = Mxfp4Weights(weights)
    check_hf_names(weights, cfg, family)
    model = _transformed(transform, family.model(cfg))
    leaves = _stacked(weights, cfg)
    source = LeafSource(leaves, family, leaf_slices(leaves.names(), cfg, family))
    init_seed = None if transform is None else seed
    state = _from_source(
        list(source.slices),
        source.shape,
        source.get,
        model,
        optimizer,
        config,
        None,
        step,
        weights.where,
        source.locate,
        init_seed=init_seed,
    )
    return model, state


def _stacked(weights: HFWeights, cfg):
    """``weights`` read as the model's leaves: an MoE model's per-expert tensors as its stacked
    expert leaves (``moe_weights.ExpertWeights``), any other model's as they are."""
    if getattr(cfg, "moe", None) is None:
        return weights
    rules = moe_names.RULES[cfg.family]
    return moe_weights.ExpertWeights(weights, rules, cfg.moe.n_experts, cfg.n_layers)


def stacked_names(cfg) -> set[str]:
    """The HF names an MoE model of ``cfg`` writes from stacked expert leaves (per-expert tensors,
    the router), which no one-leaf name map covers; empty for any other model."""
    if getattr(cfg, "moe", None) is None:
        return set()
    templates = decoder_names.moe_hf_names(cfg)
    return {name.format(i=i) for i in range(cfg.n_layers) for name in templates}


class LeafSlice(NamedTuple):
    """Where one leaf of the model lies in an HF directory: the tensor, and its rows there
    (fused)."""

    name: str  # the HF tensor
    start: int = 0  # the leaf's first row in it
    rows: int | None = None  # its rows; None: the whole tensor


def leaf_slices(names: list[str], cfg, family: HFFamily) -> dict[str, LeafSlice]:
    """The engine's key path -> its ``LeafSlice`` for every HF tensor of ``names``: a fused tensor
    gives each of its parts the rows ``family.fused_parts`` says, in order."""
    out = {}
    for name in names:
        parts = family.fused_parts(cfg, name)
        if not parts:
            out[family.hf_to_ours(name)] = LeafSlice(name)
        start = 0
        for path, rows in parts:
            out[path] = LeafSlice(name, start, rows)
            start += rows
    return out


class LeafSource(NamedTuple):
    """The HF tensors of a directory by the engine's key paths: a Conv1D weight transposed (it is
    (d_in, d_out) on disk), a fused tensor's part its rows."""

    weights: HFWeights
    family: HFFamily
    slices: dict[str, LeafSlice]

    def shape(self, path: str) -> tuple:
        """The leaf's shape; a fused tensor whose rows are not its parts' gives its own (then a
        shape error names it)."""
        part = self.slices[path]
        shape = tuple(self.weights.shape(part.name))
        if self.family.transposed(part.name):
            return tuple(reversed(shape))
        if part.rows is None:
            return shape
        total = sum(s.rows for s in self.slices.values() if s.name == part.name)
        return shape if shape[0] != total else (part.rows, *shape[1:])

    def get(self, path: str):
        part = self.slices[path]
        tensor = self.weights.get(part.name)
        if self.family.transposed(part.name):
            return tensor.t()
        return tensor if part.rows is None else tensor[part.start : part.start + part.rows]

    def locate(self, path: str) -> str:
        return self.weights.locate(self.slices[path].name)


def _transformed(transform, model: Model) -> Model:
    if transform is None:
        return model
    out = transform(model)
    if not isinstance(out, Model):
        raise TypeError(
            "checkpoints.from_hf: transform must return a zf.Model (e.g. lambda m: "
            f"lora.apply(m, ...)), got {type(out).__name__}"
        )
    return out


def model_config(hf_config: dict, directory: str, overrides: dict | None = None):
    """The ``llama.Config`` / ``gpt.Config`` of a config.json dict; errors name
    ``directory/config.json`` and the field."""
    where = os.path.join(directory, CONFIG)
    family = hf_config.get("model_type")
    try:  # refused by field name before the model_type: dense-first MoE, MLA, quantizations
        moe_config.refuse_unsupported(hf_config)
        quantization(hf_config)
    except (CheckpointError, ValueError) as e:
        raise CheckpointError(f"{where}: {str(e).removeprefix(CONFIG + ': ')}") from None
    if family not in FAMILIES:
        raise CheckpointError(
            f"{where}: model_type: expected one of {tuple(FAMILIES)}, got {family!r}"
        )
    try:
        return FAMILIES[family].from_hf(hf_config, **(overrides or {}))
    except (TypeError, ValueError) as e:
        message = str(e)
        message = (
            where + message[len(CONFIG) :] if message.startswith(CONFIG) else f"{where}: {message}"
        )
        raise CheckpointError(message) from None


def check_hf_names(weights: HFWeights, cfg, family: HFFamily) -> None:
    """Every tensor ``cfg``'s model has is in some shard, and no shard has a tensor it does not
    have."""
    expected = family.hf_names(cfg)
    present = set(weights.names())
    missing = [name for name in expected if name not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{weights.where!r}: tensor {missing[0]!r}{more} is in no shard; expected all "
            f"{len(expected)} tensors of the {_name(cfg)} model its config.json describes"
        )
    unexpected = sorted(present - set(expected))
    if unexpected:
        biases = f" (tie_word_embeddings {cfg.tie_embeddings})"
        if isinstance(cfg, llama.Config):
            biases = f" (biases: qkv {cfg.qkv_bias}, o {cfg.o_bias}, mlp {cfg.mlp_bias})"
        raise CheckpointError(
            f"{weights.locate(unexpected[0])}: not a parameter of the {_name(cfg)} model its "
            f"config.json describes{biases}; expected only the names of {_name(cfg)}'s hf_names"
        )


def to_hf(
    state,
    path: str,
    dtype: torch.dtype | str | None = None,
    *,
    max_shard_size: int | str = "5GB",
    hf_config: dict | None = None,
    merge_lora: bool = True,
) -> list[str]:
    """Write ``state``'s exact master weights as an HF directory at ``path``; returns the file names
    written.

    ``config.json`` is the family's config of ``state.model.config`` (a ``layers.llama`` or
    ``layers.gpt`` model; GPT-2's Conv1D weights are transposed back, a tied head writes no
    ``lm_head.weight``), written over ``hf_config`` when given (the imported config.json: token ids,
    architectures and other fields the engine does not model are kept). The master is exact in every
    format (a remainder master is joined from the param and remainder rows,
    ``StateView.gather_row``). Weights are cast to ``dtype`` (bf16, fp16 or fp32; fp32 is the master
    bitwise; None: the dtype of the checkpoint ``from_hf`` read, ``model.config.hf_dtype``, so that
    an fp32 import comes back fp32, and bf16 for a model that did not come from one) and split into
    shards as ``save_pretrained(max_shard_size=...)`` splits them (int bytes, or "500MB" / "5GB" /
    "2GiB"; note transformers >= 5 itself defaults to "50GB"), with ``model.safetensors.index.json``
    when there is more than one. Memory: one layer, gathered.

    A LoRA model writes its base's tensors: adapted weights merged as ``merge_and_unload`` does
    (``merge_lora``, the default), or as they are (the base a ``to_peft`` adapter applies to); LoRA
    leaves never (docs/lora.md).

    Collective at world size > 1: every rank calls it; each layer is gathered from every rank's
    shard and rank 0 writes every file (the others write nothing). It returns on every rank once
    rank 0 is done, and raises on every rank if rank 0 failed. Does not consume the state.
    """
    check_live(state, "checkpoints.to_hf")
    cfg = lora.base_config(state.model.config)
    merged = (
        state.model.config if merge_lora and isinstance(state.model.config, lora.Config) else None
    )
    family = family_of(cfg)
    dtype = export_dtype(default_dtype(cfg) if dtype is None else dtype)
    config_json = export_config(
        cfg, dtype, hf_config
    )  # first: raises for a model the family cannot express
    store = view(state)
    store.flush()  # sync: the last step's write-behind is in the tiers
    wanted = _wanted(store)
    stacked = moe_weights.export_shapes(cfg, wanted) if getattr(cfg, "moe", None) else {}
    entries = [
        Entry(
            name,
            stacked[name]
            if name in stacked
            else _disk_shape(family, name, [wanted[p] for p in _held(cfg, family, name)]),
            dtype,
        )
        for name in family.hf_names(cfg)
    ]
    error, files = _write_units(
        store,
        path,
        entries,
        parse_size(max_shard_size),
        Export(cfg, family, dtype, merged, frozenset(stacked)),
        config_json,
    )
    return _rank0_outcome(store, path, error, files)


def _rank0_outcome(store, path: str, error: BaseException | None, files: list[str]) -> list[str]:
    """Rank 0's file list on every rank, or its error raised on every rank (``error``: this rank's
    own)."""
    # sync: every rank returns (or raises) once rank 0 has written everything, with rank 0's file
    # list
    failed, files = store.comm.all_gather_object(
        (f"{type(error).__name__}: {error}" if error else None, files)
    )[0]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"checkpoints.to_hf: rank 0 failed to write {path!r}: {failed}")
    return files


class Export(NamedTuple):
    """What ``to_hf`` writes a model as."""

    cfg: Any  # the family's config (a LoRA model's base)
    family: Any  # the family's module (name maps)
    dtype: torch.dtype  # the dtype of the written tensors
    merged: Any  # the ``lora.Config`` whose adapters are merged in, or None
    stacked: frozenset = frozenset()  # the HF names written from stacked MoE leaves


def _write_units(
    store, path: str, entries: list, max_shard_bytes: int, export: Export, config_json: dict
):
    """Gather every unit (collective, in scan order) and, on rank 0, write the shards and
    config.json. Returns (rank 0's first error or None, the files written): an error is held, not
    raised, while the other ranks are still gathering."""
    cfg = export.cfg
    merged = export.merged
    writer, error, files = None, None, []
    if store.comm.rank == 0:
        writer = ShardWriter(path, plan_shards(entries, max_shard_bytes))
        error = _attempt(writer, os.makedirs, path, 0o777, True)
    for unit in units(cfg.n_layers):
        tensors = gather_unit(
            store, unit
        )  # collective: every rank gathers every unit, in this order
        tensors = lora.merge(merged, tensors, unit.name) if merged is not None else tensors
        if writer is not None and error is None:
            error = _attempt(writer, _write_unit, writer, tensors, entries, unit.name, export)
    if writer is not None and error is None:
        error = _attempt(writer, _finish, writer, path, config_json, files)
    return error, files


def export_config(cfg, dtype: torch.dtype, hf_config: dict | None) -> dict:
    """The config.json to_hf writes: ``hf_config``'s fields, then the family's of ``cfg``, then
    ``dtype``."""
    config_json = {k: v for k, v in (hf_config or {}).items() if k not in _REWRITTEN}
    config_json.update(family_of(cfg).to_hf(cfg), dtype=_DTYPE_NAMES[dtype])
    return config_json


def default_dtype(cfg) -> torch.dtype:
    """The dtype ``to_hf`` writes when not told: that of the weights ``cfg`` was read with, else
    bf16."""
    by_name = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
    return by_name.get(cfg.hf_dtype, torch.bfloat16)


def export_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype of ``EXPORT_DTYPES`` from itself or its short name ("bf16", "fp16", "fp32")."""
    out = EXPORT_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if out not in _DTYPE_NAMES:
        raise ValueError(
            f"checkpoints.to_hf: dtype must be one of {sorted(EXPORT_DTYPES)} or torch.float32 / "
            f"torch.bfloat16 / torch.float16, got {dtype!r}"
        )
    return out


def gather_unit(store, unit) -> dict[str, torch.Tensor]:
    """Full key path -> fp32 CPU master tensor of one unit, tiled weights whole
    (``StateView.gather_unit``). Collective (an allgather). ``store``: the state's
    ``zinf_fn.state.view``."""
    return {f"{unit.name}.{path}": t for path, t in store.gather_unit("master", unit).items()}


def _write_unit(
    writer: ShardWriter, tensors: dict, entries: list[Entry], unit_name: str, export: Export
) -> None:
    experts = {}
    if getattr(export.cfg, "moe", None) is not None:  # stacked leaves -> per-expert tensors
        experts = moe_weights.export_unit(export.cfg, tensors, unit_name)
    for entry in entries:  # in planned order: the HF names of this unit
        if entry.name in experts:
            writer.write(entry.name, experts[entry.name].to(export.dtype))
            continue
        if entry.name in export.stacked:
            continue
        paths = _held(export.cfg, export.family, entry.name)
        if paths[0].startswith(unit_name + "."):
            tensor = torch.cat([tensors[p] for p in paths]) if len(paths) > 1 else tensors[paths[0]]
            tensor = tensor.t().contiguous() if export.family.transposed(entry.name) else tensor
            writer.write(entry.name, tensor.to(export.dtype))


def _held(cfg, family: HFFamily, name: str) -> list[str]:
    """The key paths of the leaves the HF tensor ``name`` holds, in row order (several: fused)."""
    return [path for path, _ in family.fused_parts(cfg, name)] or [family.hf_to_ours(name)]


def _disk_shape(family: HFFamily, name: str, shapes: list[tuple]) -> tuple:
    """The shape on disk of the tensor of leaves ``shapes``: transposed (Conv1D), or their rows
    stacked."""
    if family.transposed(name):
        return tuple(reversed(shapes[0]))
    return (sum(shape[0] for shape in shapes), *shapes[0][1:])


def _name(cfg) -> str:
    return cfg.family if isinstance(cfg, llama.Config) else "gpt2"


def _write_config(path: str, config_json: dict) -> str:
    with open(os.path.join(path, CONFIG), "w", encoding="utf-8") as f:
        f.write(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    return CONFIG


def _finish(writer: ShardWriter, path: str, config_json: dict, files: list) -> None:
    files.extend(writer.close())
    files.append(_write_config(path, config_json))


def _attempt(writer: ShardWriter, write, *args) -> BaseException | None:
    """``write(*args)``; on failure remove the partial shards and return the error (reported to
    every rank)."""
    try:
        write(*args)
    except Exception as e:  # noqa: BLE001
        # the other ranks are still gathering: report after the loop
        writer.abort()
        return e
    return None


if __name__ == "__main__":
    from .hf_cli import main

    sys.exit(main())
