"""The checkpoint manifest: one JSON file that says what every array is, written last (the commit
record).

    {"format": "zinf-fn-checkpoint", "format_version": 2, "step": 5, "world_size": 2,
     "n_layers": 3, "param_dtype": "bfloat16",
     "formats": {"master": {"format": "MasterFormat", "kind": "remainder", "version": 1},
                 "moments": {"format": "MomentsFormat", "kind": "bf16", "block": 256, ...},
                 "compressed": ["blocks"], "param_rounding": "ties_away"},
     "groups": {"blocks": {"rows": 3, "numel": 12704, "treedef": "...",
                           "leaves": [{"path": "attn.qkv.w", "shape": [96, 32], "offset": 0,
                           "numel": 3072}, ...]},
                ...},
     "arrays": [{"name": "blocks/adam_m", "group": "blocks", "kind": "opt.0", "dtype": "bfloat16",
                 "shape": [3, 12704], "chunk_cols": 12704, "description": "Adam first moment m
                 (bf16)"}, ...],
     "tiles": {"blocks:mlp.fc.w": {"stage": "blocks", "path": "mlp.fc.w", "axis": 0,
                                   "shapes": [[43, 32], [43, 32], [42, 32]]}, ...},
     "optimizer": {"name": "adamw", "lr": 0.003, ...}, "optimizer_state": ["adam_m", "adam_v"],
     "config": {...zf.Config.describe()...}, "rng": null, "extra": {...}, "save_id": "...",
     "ties": [{"embed": "tok.w", "head": "lm_head.w"}]}

Leaf ``path``s are relative to a layer: the full key path of a weight is ``<unit>.<path>`` with unit
``embed``, ``blocks.<i>`` or ``head`` (``blocks.3.attn.qkv.w``). A tiled weight (``zinf_fn.tiling``)
is a zero-size anchor leaf in its stage's group and a group of its own (directory
``blocks--mlp.fc.w``), one row per tile, each tile at the front of its row. A tied weight
(``zf.Tie``, listed in ``ties``) is saved once, as the embed leaf; the head group has no leaf for
it. ``ties`` is absent only from some format version 1 checkpoints (written before ties were listed:
an untied model).

Format version 2 stores every state kind as the engine keeps it
(``zinf_fn.state.StateView.stored_as``: a remainder master's int16 "remainder" rows, compressed
moments in their dtype, and any kind a format adds, such as int8 scales "opt.<i>.absmax" of one
element per block) and names the formats in ``formats`` (``zinf_fn.state.Formats``). Version 1 (no
``formats``) stored fp32 masters and moments only: it reads as those formats.
"""

from __future__ import annotations

import json
import os
import time

import torch

from zinf_fn.state import BLOCKS, Formats, StoredRows, parse_formats, view

from .arrays import chunk_cols, dtype_name
from .manifest_schema import FORMAT, FORMAT_VERSION, MANIFEST_SCHEMA
from .rows import disk_name, per_element
from .schema import SchemaError, check, is_int, load_json, short_repr

MANIFEST = "manifest.json"

# Names of optimizer state leaves on disk, by optimizer: readable by anyone who opens the directory.
STATE_NAMES = {
    "adamw": (("adam_m", "Adam first moment m"), ("adam_v", "Adam second moment v")),
    "sgd": (("momentum", "SGD momentum buffer"),),
}
KIND_DESCRIPTIONS = {
    "param": "stored 16-bit parameter copy (what the forward pass gathers)",
    "master": "fp32 master weights (the optimizer's copy)",
    "remainder": "low 16 bits of the fp32 master (int16); the bf16 param copy is its high half",
}
DTYPE_NOTES = {"float32": "fp32", "bfloat16": "bf16", "uint8": "8-bit codes"}
SUFFIX_NOTES = {"absmax": "the fp32 scale (absmax) of each block"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: missing, incomplete, corrupt, or from a newer
    format."""


def optimizer_state_names(hyperparams: dict | None, n_leaves: int) -> list[tuple[str, str]]:
    """(disk name, description without the dtype) of each optimizer state leaf ``opt.<i>``."""
    known = STATE_NAMES.get((hyperparams or {}).get("name"), ())
    if len(known) == n_leaves:
        return list(known)
    return [(f"opt.{i}", f"optimizer state leaf {i}") for i in range(n_leaves)]


def kind_name(kind: str, dtype: torch.dtype, names: list[tuple[str, str]]) -> tuple[str, str]:
    """(disk name, description) of a state kind's arrays: "param", "master", "remainder", the
    optimizer leaf's name ("adam_m (fp32)"), and for a row a format adds to a leaf ("opt.0.absmax")
    "adam_m.absmax"."""
    if kind in KIND_DESCRIPTIONS:
        return kind, KIND_DESCRIPTIONS[kind]
    _, leaf, *suffix = kind.split(".")
    disk, base = names[int(leaf)]
    if suffix:
        return f"{disk}.{suffix[0]}", f"{base}: {SUFFIX_NOTES.get(suffix[0], suffix[0])}"
    return disk, f"{base} ({DTYPE_NOTES.get(dtype_name(dtype), dtype_name(dtype))})"


def array_entries(
    stored: StoredRows,
    shapes: dict[str, tuple[int, int, int]],
    hyperparams: dict | None,
    n_opt_leaves: int,
) -> list[dict]:
    """One entry per saved array: every group x every kind ``stored`` keeps of it (param, master or
    remainder, the optimizer leaves and what their format adds). Grads are scratch.

    ``shapes``: group name -> (rows, the writer's shard size), in the store's group order. A kind
    has the unit's real elements as columns (``StoredRows.unit_numel``: the blocks holding them for
    int8 scales), a chunk dividing the writer's shard of them (``shard / per_element``).
    """
    names = optimizer_state_names(hyperparams, n_opt_leaves)
    entries = []
    for gname, (rows, shard_numel) in shapes.items():
        for kind in stored.kinds(gname):
            dtype, per = stored.dtype(kind, gname), per_element(stored, kind, gname)
            disk, desc = kind_name(kind, dtype, names)
            entries.append(
                {
                    "name": f"{disk_name(gname)}/{disk}",
                    "group": gname,
                    "kind": kind,
                    "dtype": dtype_name(dtype),
                    "shape": [rows, stored.unit_numel(kind, gname)],
                    "chunk_cols": chunk_cols(shard_numel // per, dtype.itemsize),
                    "description": desc,
                }
            )
    return entries


def formats_entry(formats: Formats) -> dict:
    return {
        "master": formats.master,
        "moments": formats.moments,
        "compressed": list(formats.compressed),
        "param_rounding": formats.param_rounding,
    }


def checkpoint_formats(manifest: dict) -> Formats:
    """The ``Formats`` a (schema-checked) manifest's arrays are stored in: its ``formats``, or for
    format version 1 fp32 masters and moments (the 16-bit copy rounded as its config says)."""
    f = manifest.get("formats")
    if f is None:
        return Formats.fp32(manifest["config"].get("param_rounding") or "nearest_even")
    return Formats(f["master"], f["moments"], tuple(f["compressed"]), f["param_rounding"])


def frozen_storage(manifest: dict) -> str:
    """How the checkpoint stores its frozen 2-D weights (``zf.Config.frozen_storage``; absent:
    "bf16", as before)."""
    return manifest["config"].get("frozen_storage", "bf16")


def group_entry(group) -> dict:
    leaves = [
        {"path": leaf.path, "shape": list(leaf.shape), "offset": leaf.offset, "numel": leaf.numel}
        for leaf in group.spec.leaves
    ]
    return {
        "rows": group.rows,
        "numel": group.spec.numel,
        "treedef": str(group.spec.treedef),
        "leaves": leaves,
    }


def tile_entries(layout) -> dict:
    """How each tiled weight is cut: its group holds tile t of layer i in row ``i * len(shapes) +
    t``."""
    return {
        leaf.group: {
            "stage": leaf.stage,
            "path": leaf.path,
            "axis": leaf.axis,
            "shapes": [list(s) for s in leaf.shapes],
        }
        for leaves in layout.leaves.values()
        for leaf in leaves
    }


def tie_entries(ties) -> list[dict]:
    """The model's tied weights: the head reads embed leaf ``embed`` as its ``head`` path."""
    return [{"embed": tie.embed, "head": tie.head} for tie in ties]


def build_manifest(state, save_id: str, extra: dict | None, checksums: bool = False) -> dict:
    store = view(state)  # the groups, dtypes and tiles of the state's engine
    stored, comm = store.stored_as(), store.comm
    hyper = state.optimizer.hyperparams
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": state.step,
        "world_size": comm.world_size,
        "n_layers": state.model.n_layers,
        "param_dtype": dtype_name(store.param_dtype),
        "formats": formats_entry(stored.formats),
        "groups": {name: group_entry(group) for name, group in store.groups.items()},
        "tiles": tile_entries(store.tiles),
        "ties": tie_entries(store.ties),
        "arrays": array_entries(
            stored,
            {name: (g.rows, g.part.shard_numel) for name, g in store.groups.items()},
            hyper,
            store.n_opt_leaves,
        ),
        "optimizer": hyper,
        "optimizer_state": [name for name, _ in optimizer_state_names(hyper, store.n_opt_leaves)],
        "config": state.config.describe(),
        "checksums": checksums,  # crc32c per chunk
        "rng": None,  # the engine draws no random numbers during a step; init is seeded per unit
        "extra": extra,
        "save_id": save_id,
        "created_unix": time.time(),
        "torch_version": torch.__version__,
    }


def write_json_(path: str, obj: dict, sync: bool = True) -> None:
    """Write ``obj`` as JSON to ``path``, and fsync it unless ``sync`` is False."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        if sync:
            f.flush()
            os.fsync(
                f.fileno()
            )  # sync: durable before anything that depends on it (the commit rename)


def write_manifest_(directory: str, manifest: dict, sync: bool = True) -> None:
    """Write ``manifest.json`` into ``directory``: the last file of a save, its commit record
    (fsynced unless ``sync`` is False)."""
    write_json_(os.path.join(directory, MANIFEST), manifest, sync=sync)


MAX_MANIFEST_BYTES = (
    16 << 20
)  # a manifest is kilobytes; a larger file is refused before it is parsed
TIES_FROM_VERSION = 2  # ``ties`` required from this version on (``formats`` too: _check_formats)


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at ``path``, checked against ``MANIFEST_SCHEMA`` (every
    field's type and range; no field unknown) before anything else is opened; CheckpointError naming
    the field."""
    path = os.fspath(path)
    file = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}: not a directory")
    try:
        manifest = load_json(file, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path!r} is not a complete checkpoint: {MANIFEST} is missing "
            "(an interrupted save never gets one; use checkpoints.latest(root))"
        ) from None
    except OSError as e:  # ELOOP: a symlink, EISDIR, EACCES
        raise CheckpointError(
            f"checkpoint {path!r}: {MANIFEST} cannot be read as a regular file: {e.strerror or e}"
        ) from None
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} is not valid JSON ({e})") from None
    _validate(manifest, path)
    return manifest


def _validate(manifest, path: str) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(
            f"checkpoint {path!r}: {MANIFEST} has format {got!r}, expected {FORMAT!r}"
        )
    version = manifest.get("format_version")
    if is_int(version) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path!r} has format_version {version}, newer than this library reads "
            f"({FORMAT_VERSION}); upgrade zinf-fn to restore it"
        )
    if is_int(version) and version < 1:
        raise CheckpointError(
            f"checkpoint {path!r} has format_version {version}; this library reads "
            f"versions 1 to {FORMAT_VERSION}"
        )
    try:
        check(MANIFEST_SCHEMA, manifest)
    except SchemaError as e:
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} field {e}") from None
    if "ties" not in manifest and manifest["format_version"] >= TIES_FROM_VERSION:
        version = manifest["format_version"]
        raise CheckpointError(
            f"checkpoint {path!r}: {MANIFEST} field ties: expected a list "
            f"(format version {version} writes it, [] for an untied model), "
            "got nothing"
        )
    _check_formats(manifest, path)


def _check_formats(manifest: dict, path: str) -> None:
    """Format version 2 names its formats, each one this code knows
    (``zinf_fn.state.parse_formats``: the format, its fields and version); version 1 has none."""
    where = f"checkpoint {path!r}: {MANIFEST} field formats"
    formats, version = manifest.get("formats"), manifest["format_version"]
    if (formats is None) != (version < 2):
        want = (
            "nothing (format version 1 has no formats)"
            if version < 2
            else "the formats of the arrays (format version 2 names them)"
        )
        raise CheckpointError(f"{where}: expected {want}, got {short_repr(formats)}")
    if formats is not None:
        try:
            parse_formats(formats["master"], formats["moments"])
        except ValueError as e:
            raise CheckpointError(f"{where}.{e}") from None


def check_structure(manifest: dict, specs: dict, n_opt_leaves: int, path: str) -> None:
    """Raise a CheckpointError listing every key path whose shape or place differs between
    checkpoint and model.

    ``specs``: group name -> (rows, FlatSpec) of the model being restored.
    """
    problems = []
    for gname in sorted(set(manifest["groups"]) | set(specs)):
        saved, model = manifest["groups"].get(gname), specs.get(gname)
        if saved is None or model is None:
            problems.append(
                f"{gname}: {'absent' if saved is None else 'present'} in the checkpoint, "
                f"{'absent' if model is None else 'present'} in the model"
            )
            continue
        rows, spec = model
        if saved["rows"] != rows:
            problems.append(f"{gname}: the checkpoint has {saved['rows']} layers, the model {rows}")
        problems += _leaf_problems(gname, saved["leaves"], spec)
    if len(manifest["optimizer_state"]) != n_opt_leaves:
        problems.append(
            f"optimizer state: the checkpoint holds {manifest['optimizer_state']}, the optimizer "
            f"keeps {n_opt_leaves} state leaves"
        )
    if problems:
        raise CheckpointError(
            f"checkpoint {path!r} does not fit this model:\n  " + "\n  ".join(problems)
        )


def _leaf_problems(gname: str, saved_leaves: list[dict], spec) -> list[str]:
    prefix = f"{BLOCKS}.*" if gname == BLOCKS else gname
    saved = {leaf["path"]: (tuple(leaf["shape"]), leaf["offset"]) for leaf in saved_leaves}
    model = {leaf.path: (tuple(leaf.shape), leaf.offset) for leaf in spec.leaves}
    out = []
    for path in sorted(set(saved) | set(model)):
        a, b = saved.get(path), model.get(path)
        if a is None or b is None:
            out.append(
                f"{prefix}.{path}: {'absent' if a is None else f'shape {a[0]}'} in the checkpoint, "
                f"{'absent' if b is None else f'shape {b[0]}'} in the model"
            )
        elif a[0] != b[0]:
            out.append(f"{prefix}.{path}: shape {a[0]} in the checkpoint, {b[0]} in the model")
        elif a[1] != b[1]:
            out.append(
                f"{prefix}.{path}: at flat offset {a[1]} in the checkpoint, {b[1]} in the model"
            )
    return out
