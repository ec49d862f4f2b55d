"""The on-disk arrays: tensorstore zarr3 specs, the chunk layout, and zero-copy torch <-> numpy
views.

A checkpoint holds one logical global array per layer group and state kind, of shape ``(rows,
numel)``: row i is layer i of the group (one row for "embed" and "head"), ``numel`` the group's
*unpadded* flat size, so no array depends on the world size that wrote it. Chunks are ``(1,
chunk_cols)`` with ``chunk_cols`` dividing the writing world's shard size: every chunk file has
exactly one writer, so the ranks write in parallel with no read-modify-write between them, and a
reader at any world size reads only the chunks that overlap its slice. Chunks are raw little-endian
bytes, so a chunk file of the wrong size is an error; with checksums (the default) each also carries
a crc32c (a standard zarr v3 codec) and a flipped bit is an error too, at a measured cost
(``checksum_cost``, BENCHMARKS.md).
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np
import tensorstore as ts
import torch

PLAIN_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}]  # raw little-endian
CRC32C_CODECS = [*PLAIN_CODECS, {"name": "crc32c"}]  # the bytes, then their crc32c (an LE uint32)
CRC32C_BYTES = 4
# Chunk size (the choices and their figures: BENCHMARKS.md). Chunks move with O_DIRECT, several
# requests in flight per file, so fewer, larger files cost fewer opens and syncs; a checksummed
# chunk is read whole and verified on one I/O thread (chunkio), at this size still many per array.
# (Checkpoints written with 4 MiB checksummed chunks, the size before, restore as they are: a
# chunk only has to divide the shard.)
TARGET_CHUNK_BYTES = 16 << 20
ZARR_JSON_BYTES = 1 << 20  # an array's zarr.json is a few hundred bytes: a longer one is refused
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
    torch.int16: "int16",
    torch.uint8: "uint8",
}  # int16 remainders, int8 codes
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"checkpoints store {sorted(DTYPE_NAMES.values())}, got {dtype}")
    return DTYPE_NAMES[dtype]


def torch_dtype(name: str, where: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"{where}: unknown dtype {name!r}; expected one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def chunk_file_bytes(cols: int, itemsize: int, checksums: bool) -> int:
    """Bytes of one chunk file: ``cols`` elements, then their crc32c where ``checksums``."""
    return cols * itemsize + (CRC32C_BYTES if checksums else 0)


def chunk_cols(shard_numel: int, itemsize: int) -> int:
    """Columns per chunk: the largest divisor of the writer's shard size up to ~TARGET_CHUNK_BYTES.

    A divisor keeps every rank's shard a whole number of chunks (one writer per chunk file). When
    the shard size has no divisor within 16x of the target (it is prime, say), the chunk is the
    whole shard.
    """
    target = max(1, TARGET_CHUNK_BYTES // itemsize)
    if shard_numel <= target:
        return max(1, shard_numel)
    best = 1
    for d in range(1, math.isqrt(shard_numel) + 1):
        if shard_numel % d == 0:
            for c in (d, shard_numel // d):
                if best < c <= target:
                    best = c
    return best if best * 16 >= target else shard_numel


def io_context(sync: bool = True) -> ts.Context:
    """One tensorstore context per save or restore: deep I/O queues, no cache (every byte is read
    once).

    ``sync``: tensorstore fsyncs each chunk file as it is written, so flushing overlaps the writing
    instead of following it. No lock files: every chunk has a single writer by construction.
    """
    return ts.Context(
        {
            "cache_pool": {"total_bytes_limit": 0},
            "file_io_concurrency": {"limit": 64},
            "data_copy_concurrency": {"limit": max(2, os.cpu_count() or 2)},
            "file_io_sync": sync,
            "file_io_locking": {"mode": "none"},
        }
    )


def array_spec(
    path: str,
    rows: int,
    numel: int,
    dtype: torch.dtype,
    cols: int,
    attributes: dict,
    checksums: bool = False,
) -> dict:
    """The zarr3 spec of one state array, readable by any zarr v3 reader (bfloat16: the zarr
    extension)."""
    codecs = [dict(c) for c in (CRC32C_CODECS if checksums else PLAIN_CODECS)]
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": path},
        "metadata": {
            "shape": [rows, numel],
            "data_type": dtype_name(dtype),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, cols]}},
            "chunk_key_encoding": {"name": "default"},
            "fill_value": 0,
            "codecs": codecs,
            "dimension_names": ["layer", "element"],
            "attributes": attributes,
        },
    }


def zarr_metadata(spec: dict) -> dict:
    """The zarr.json tensorstore's zarr3 driver writes for ``spec`` (an ``array_spec``): the same
    keys and values (a test compares them); a restore refuses an array whose zarr.json is anything
    else."""
    meta = spec["metadata"]
    floating = TORCH_DTYPES[meta["data_type"]].is_floating_point
    return {**meta, "fill_value": 0.0 if floating else 0, "node_type": "array", "zarr_format": 3}


def write_metadata(spec: dict) -> str:
    """Create the array of ``spec`` (an ``array_spec``): its directory and its ``zarr_metadata``,
    written here directly rather than through ``ts.open(create=True)``, which a save paid for a few
    dozen times. Not fsynced; returns the file's path."""
    directory = spec["kvstore"]["path"]
    os.makedirs(directory)
    path = os.path.join(directory, "zarr.json")
    text = json.dumps(
        zarr_metadata(spec), separators=(",", ":"), sort_keys=True
    )  # dumps: the C encoder
    with open(path, "w") as f:
        f.write(text)
    return path


def open_array(path: str, context: ts.Context, write: bool = False) -> ts.TensorStore:
    # Zero chunks (fresh Adam moments) are written too: a missing chunk file then always means
    # damage.
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": path},
        "store_data_equal_to_fill_value": True,
    }
    return ts.open(spec, open=True, read=True, write=write, context=context).result()


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view sharing ``t``'s memory (a contiguous CPU tensor); bfloat16 via ml_dtypes."""
    assert t.device.type == "cpu" and t.is_contiguous(), "as_numpy needs a contiguous CPU tensor"
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def read_into_(array: ts.TensorStore, row: int, start: int, out: torch.Tensor):
    """Start reading ``array[row, start:start + len(out)]`` straight into ``out``; returns the
    future."""
    dst = ts.array(as_numpy(out), copy=False, write=True)
    return dst.write(array[row, start : start + out.numel()])


def write_from(array: ts.TensorStore, row: int, start: int, src: torch.Tensor):
    """Start writing ``src`` to ``array[row, start:start + len(src)]``, straight from its memory.

    ``src`` must not change until the returned future resolves (the chunks are then durable).
    """
    return array[row, start : start + src.numel()].write(
        as_numpy(src), can_reference_source_data_indefinitely=True
    )
