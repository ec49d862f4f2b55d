"""What a restore checks before it reads a byte of array data: the checkpoint is untrusted input.

``read_manifest`` has already checked every field's type and range (``manifest.MANIFEST_SCHEMA``).
Here the manifest is held to the model being restored, field by field: the groups, their leaves and
tree structure, the tiles, the optimizer state names and every array entry must be exactly what this
code would have written for this model (``chunk_cols`` only has to divide the writer's shard size),
so an array's ``name`` is never a path the model did not produce. Every path then read stays inside
the checkpoint: the directory is resolved once, each array directory must resolve to itself under it
(no ``..``, no symlinked component), ``c`` and ``c/<row>`` must be real directories, every chunk
file a regular file (never a symlink) of exactly the size its codecs imply, and each ``zarr.json``
must be the one ``arrays.zarr_metadata`` makes for its entry, key for key. ``latest`` and retention
never follow a symlink either (``commit.checkpoints_in``).
"""

from __future__ import annotations

import os
import stat

from zinf_fn.state import StateView, StoredRows

from .arrays import TORCH_DTYPES, ZARR_JSON_BYTES, array_spec, chunk_file_bytes, zarr_metadata
from .manifest import (
    MANIFEST,
    CheckpointError,
    array_entries,
    check_structure,
    checkpoint_formats,
    frozen_storage,
    group_entry,
    optimizer_state_names,
    tie_entries,
    tile_entries,
)
from .rows import per_element
from .schema import MISSING, join, load_json, short_repr

NO_SUCH_FIELD = type("NoSuchField", (), {"__repr__": lambda self: "no such field"})()
# an array entry's fields but chunk_cols, compared in this order: the most telling difference is
# named first
ENTRY_FIELDS = ("name", "group", "kind", "dtype", "shape", "description")


def check_fits(manifest: dict, store: StateView, path: str, hyperparams: dict | None) -> StoredRows:
    """Raise CheckpointError unless every field of ``manifest`` is what a save of the model of
    ``store`` (a state's ``zinf_fn.state.view``) would have written (at the manifest's world size,
    partition mode, param dtype, formats and checksums), its optimizer's hyperparameters named as
    ``hyperparams`` (the restoring optimizer's) name them. Returns the rows the checkpoint stores,
    as this rank would hold them (``StateView.stored_as`` its formats)."""
    layout = store.tiles
    where = f"checkpoint {path!r}: {MANIFEST} field "
    _check_frozen_storage(manifest, store, where)
    check_structure(
        manifest, {n: (g.rows, g.spec) for n, g in store.groups.items()}, store.n_opt_leaves, path
    )
    check_optimizer(manifest["optimizer"], hyperparams, where)
    if manifest["n_layers"] != store.n_layers:
        raise CheckpointError(
            f"{where}n_layers: expected {store.n_layers} (the model's layers), "
            f"got {manifest['n_layers']}"
        )
    for name, group in store.groups.items():
        _same(f"{where}groups.{name}.", group_entry(group), manifest["groups"][name])
    _same(f"{where}tiles.", tile_entries(layout), manifest["tiles"])
    _same(
        f"{where}ties", tie_entries(store.ties), manifest.get("ties", [])
    )  # absent: an untied model
    names = [disk for disk, _ in optimizer_state_names(manifest["optimizer"], store.n_opt_leaves)]
    _same(f"{where}optimizer_state", names, manifest["optimizer_state"])
    saved = saved_rows(manifest, store, where)
    _check_arrays(manifest, store, saved, where)
    return saved


def check_optimizer(saved: dict | None, hyperparams: dict | None, where: str) -> None:
    """The saved hyperparameters name exactly the restoring optimizer's (their values may differ: a
    new learning rate), so no field of ``optimizer`` is one this optimizer does not know."""
    if saved is None or hyperparams is None:
        return
    unknown, missing = sorted(set(saved) - set(hyperparams)), sorted(set(hyperparams) - set(saved))
    if unknown or missing:
        name = hyperparams.get("name")
        raise CheckpointError(
            f"{where}optimizer: expected the hyperparameters of {name!r} "
            f"{sorted(hyperparams)}; unknown {unknown}, missing {missing}"
        )


def _check_frozen_storage(manifest: dict, store: StateView, where: str) -> None:
    """A quantized frozen base (``zf.Config.frozen_storage``) restores only as it is stored: the
    same storage and the same param dtype (its row holds the codes and the 16-bit leaves' bytes;
    nothing converts them)."""
    saved = frozen_storage(manifest)
    if saved != store.frozen.codes.storage:
        raise CheckpointError(
            f"{where}config.frozen_storage: the checkpoint stores its frozen weights as {saved!r}, "
            f"this state as {store.frozen.codes.storage!r}; restore it with "
            f"zf.Config(frozen_storage={saved!r}) (a stored base is not converted)"
        )
    if saved != "bf16" and TORCH_DTYPES[manifest["param_dtype"]] != store.param_dtype:
        raise CheckpointError(
            f"{where}param_dtype: a checkpoint whose frozen weights are stored {saved!r} restores "
            f"in its own param_dtype ({manifest['param_dtype']}: its frozen row holds their "
            "bytes), "
            f"this state's is {store.param_dtype}; pass zf.Config(param_dtype=torch."
            f"{manifest['param_dtype']})"
        )


def saved_rows(manifest: dict, store: StateView, where: str) -> StoredRows:
    """The rows a state of ``store``'s model keeps in the checkpoint's formats and param dtype."""
    try:
        return store.stored_as(checkpoint_formats(manifest), TORCH_DTYPES[manifest["param_dtype"]])
    except ValueError as e:  # formats this engine does not store, or a config they make invalid
        raise CheckpointError(
            f"{where}formats: this engine cannot hold a state in the checkpoint's formats with "
            f"param_dtype {manifest['param_dtype']}: {e}"
        ) from None


def writer_shard_numel(manifest: dict, saved: StoredRows, group: str) -> int:
    """Elements per rank-row of ``group`` in the save that wrote ``manifest`` (``saved``: its rows,
    ``check_fits``'s): its world size's shards, whole int8 blocks where the group is int8."""
    mode = manifest["config"].get("partition", "allgather")
    return saved.shard_numel(group, manifest["world_size"] if mode == "allgather" else 1)


def _check_arrays(manifest: dict, store, saved: StoredRows, where: str) -> None:
    shapes = {n: (g.rows, writer_shard_numel(manifest, saved, n)) for n, g in store.groups.items()}
    expected = array_entries(saved, shapes, manifest["optimizer"], store.n_opt_leaves)
    got = manifest["arrays"]
    if len(got) != len(expected):
        names = [e["name"] for e in expected]
        extra = [e["name"] for e in got if e["name"] not in names][:1]
        raise CheckpointError(
            f"{where}arrays: expected {len(expected)} arrays (each group's state kinds as its "
            f"format stores them), got {len(got)}"
            + (f"; {extra[0]!r} is not one of them" if extra else "")
        )
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        for key in ENTRY_FIELDS:  # the schema has checked that these are all of its fields
            _same(f"{where}arrays[{i}].{key}", want[key], have[key])
        shard = shapes[want["group"]][1] // per_element(saved, want["kind"], want["group"])
        if shard % have["chunk_cols"]:
            raise CheckpointError(
                f"{where}arrays[{i}].chunk_cols: expected a positive int dividing {shard} (the "
                f"writer's shard size of group {want['group']!r}), got {have['chunk_cols']}"
            )


def _same(field: str, want, got) -> None:
    """Raise CheckpointError naming the first place where ``got`` differs from ``want`` (``field``:
    the place of the whole, e.g. ``manifest.json field arrays[3]``)."""
    found = first_difference(want, got)
    if found is not None:
        where, a, b = found
        raise CheckpointError(f"{field}{where}: expected {short_repr(a)}, got {short_repr(b)}")


def first_difference(want, got, where: str = ""):
    """(path, wanted, got) of the first difference of two JSON values, or None where they are equal.
    Types count: ``true`` is not ``1``, ``1`` is not ``1.0`` and ``-0.0`` is not ``0.0``, though
    Python's ``==`` says they are."""
    if type(want) is not type(got):
        return where, want, got
    if isinstance(want, dict):
        for k in sorted(set(want) | set(got), key=str):
            if k not in got or k not in want:
                return join(where, k), want.get(k, NO_SUCH_FIELD), got.get(k, MISSING)
            found = first_difference(want[k], got[k], join(where, k))
            if found is not None:
                return found
        return None
    if isinstance(want, list):
        if len(want) != len(got):
            return where, want, got
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            found = first_difference(a, b, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    same = (
        repr(want) == repr(got) if isinstance(want, float) else want == got
    )  # repr: -0.0 is not 0.0
    return None if same else (where, want, got)


def array_dir(root: str, entry: dict) -> str:
    """The directory of a (model-checked) array entry: ``root/<name>``, refused unless it resolves
    to exactly that path under the resolved ``root`` (no ``..``, no symlinked component) and is a
    directory."""
    real_root = os.path.realpath(root)
    directory = os.path.normpath(os.path.join(real_root, entry["name"]))
    inside = directory.startswith(real_root + os.sep)
    if not inside or os.path.realpath(directory) != directory:
        raise CheckpointError(
            f"checkpoint {root!r}: array {entry['name']!r} resolves outside the checkpoint or "
            "through a symlink; a checkpoint holds only its own directories and files"
        )
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"checkpoint {root!r} is incomplete: array {entry['name']!r} listed in the "
            "manifest is missing"
        )
    return directory


def check_zarr_json(directory: str, entry: dict, checksums: bool, root: str) -> dict:
    """The array's zarr.json, refused unless it is exactly what a save writes for ``entry``."""
    file = os.path.join(directory, "zarr.json")
    attributes = {"zinf_fn": {k: entry[k] for k in ("group", "kind", "description")}}
    want = zarr_metadata(
        array_spec(
            directory,
            *entry["shape"],
            TORCH_DTYPES[entry["dtype"]],
            entry["chunk_cols"],
            attributes,
            checksums,
        )
    )
    try:
        got = load_json(file, ZARR_JSON_BYTES)
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {root!r} is incomplete: array {entry['name']!r} listed in the "
            "manifest is missing (no zarr.json)"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {root!r}: array {entry['name']!r}: zarr.json cannot be read as a JSON "
            f"file: {getattr(e, 'strerror', None) or e}"
        ) from None
    try:
        _same(f"{entry['name']}/zarr.json field ", want, got)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {root!r}: array {e}") from None
    return got


def check_chunk_files(
    directory: str, entry: dict, checksums: bool, root: str, rows: int | None = None
) -> None:
    """Every chunk file of the array (of its first ``rows`` rows; all by default) present, a regular
    file of the size its codecs give, in real directories: ``c/<row>/<c>`` holds ``chunk_cols``
    elements (plus a crc32c)."""
    all_rows, numel = entry["shape"]
    rows = all_rows if rows is None else min(rows, all_rows)
    cols = entry["chunk_cols"]
    size = chunk_file_bytes(cols, TORCH_DTYPES[entry["dtype"]].itemsize, checksums)
    label = f"{root}/{entry['name']}"
    missing = []
    if numel and not _is_real_dir(os.path.join(directory, "c"), label):
        missing.append("c")
    for row in range(rows) if not missing else ():
        row_dir = os.path.join(directory, "c", str(row))
        if not _is_real_dir(row_dir, label):
            missing += [f"c/{row}/{c}" for c in range(-(-numel // cols))]
            continue
        for c in range(-(-numel // cols)):
            try:
                st = os.lstat(os.path.join(row_dir, str(c)))
            except FileNotFoundError:
                missing.append(f"c/{row}/{c}")
                continue
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(
                    f"checkpoint array {label!r}: c/{row}/{c} is not a regular file (a symlink or "
                    "a directory); a checkpoint holds only regular files"
                )
            if st.st_size != size:
                raise CheckpointError(
                    f"checkpoint array {label!r}, row {row}, is corrupt: chunk file 'c/{row}/{c}' "
                    f"has {st.st_size} bytes, expected {size}"
                )
    if missing:
        raise CheckpointError(
            f"checkpoint {root!r} is truncated: array {entry['name']!r} is missing "
            f"{len(missing)} chunk file(s), e.g. {missing[:3]}"
        )


def _is_real_dir(path: str, label: str) -> bool:
    """True for a directory, False for nothing there; CheckpointError for a symlink or a file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(
            f"checkpoint array {label!r}: {os.path.basename(path)!r} is not a directory (a "
            "symlink or a file); a checkpoint holds only its own directories"
        )
    return True
