"""Export a checkpoint to one consolidated safetensors file, streamed layer by layer.

    python -m checkpoints export CKPT OUT.safetensors [--dtype fp32|bf16]

One tensor per parameter per layer, named by its full key path: ``embed.tok.w``,
``blocks.3.attn.qkv.w``, ``head.lm_head.w`` (a tiled weight whole, as if it had never been tiled).
Values are the exact fp32 master weights, whatever format stores them (a remainder master is joined
from its param and remainder arrays: ``zinf_fn.state.RowFormat.decode``); ``--dtype bf16`` rounds
them to bf16 (torch's cast: the stored 16-bit copy of a bf16 run that rounds to nearest even). No
conversion step is needed before: the arrays are read with tensorstore whatever world size or
partition mode wrote them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from zinf_fn.state import BLOCKS, EMBED, HEAD, frozen_group, is_frozen_group, row_format, unit_name

from .arrays import TORCH_DTYPES, io_context
from .manifest import CheckpointError, checkpoint_formats, frozen_storage, read_manifest
from .restore import open_arrays
from .safetensors_io import Entry, StreamWriter

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def layer_name(group: str, row: int, rows: int) -> str:
    """``embed``, ``blocks.3``, ``head``: the prefix of a layer's key paths
    (``zinf_fn.state.unit_name``)."""
    return f"{group}.{row}" if rows > 1 else unit_name(group, row)


def stage_order(manifest: dict) -> list[str]:
    """The stage groups (not tile groups, not frozen groups), embed, blocks, head first."""
    tiles = manifest.get("tiles", {})
    stages = [g for g in manifest["groups"] if g not in tiles and not is_frozen_group(g)]
    known = [g for g in (EMBED, BLOCKS, HEAD) if g in stages]
    return known + sorted(set(stages) - set(known))


def _tiled_of(manifest: dict, stage: str) -> list[tuple[str, dict]]:
    return [(g, t) for g, t in manifest.get("tiles", {}).items() if t["stage"] == stage]


def _full_shape(tile: dict) -> tuple[int, ...]:
    shape = list(tile["shapes"][0])
    shape[tile["axis"]] = sum(s[tile["axis"]] for s in tile["shapes"])
    return tuple(shape)


def layer_entries(manifest: dict, stage: str, row: int, dtype: torch.dtype) -> list[Entry]:
    """The named tensors of one layer in file order: its flat buffer's leaves, then its tiled
    weights whole."""
    group = manifest["groups"][stage]
    prefix = layer_name(stage, row, group["rows"])
    tiled = _tiled_of(manifest, stage)
    frozen = manifest["groups"].get(frozen_group(stage), {"leaves": []})[
        "leaves"
    ]  # frozen leaves stored apart
    anchors = {t["path"] for _, t in tiled} | {
        leaf["path"] for leaf in frozen
    }  # zero-size stand-ins in the row
    out = [
        Entry(f"{prefix}.{leaf['path']}", tuple(leaf["shape"]), dtype)
        for leaf in [*(leaf for leaf in group["leaves"] if leaf["path"] not in anchors), *frozen]
    ]
    return out + [Entry(f"{prefix}.{t['path']}", _full_shape(t), dtype) for _, t in tiled]


def export(ckpt: str, out: str, dtype: str = "fp32") -> list[str]:
    """Write the consolidated weights of ``ckpt`` to the safetensors file ``out``; returns the
    names.

    A tiled weight is written whole, under its untiled key path. RAM: one layer's flat buffer (plus
    its cast) or one whole tiled weight, whatever the model size.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    target = EXPORT_DTYPES[dtype]
    ckpt, out = os.fspath(ckpt), os.fspath(out)
    manifest = read_manifest(ckpt)
    if frozen_storage(manifest) != "bf16":
        raise CheckpointError(
            f"checkpoint {ckpt!r}: its frozen weights are stored {frozen_storage(manifest)!r} "
            f"(Config.frozen_storage), and export reads 16-bit rows only; restore it and write the "
            f"dequantized weights with checkpoints.to_hf(state, out_dir)"
        )
    arrays = open_arrays(ckpt, manifest, io_context())
    layers = [
        (stage, row)
        for stage in stage_order(manifest)
        for row in range(manifest["groups"][stage]["rows"])
    ]
    entries = [e for stage, row in layers for e in layer_entries(manifest, stage, row, target)]
    meta = {"format": "pt", "source": "zinf-fn checkpoint", "step": manifest["step"]}
    tmp = out + ".partial"
    writer = StreamWriter(tmp, entries, meta)
    for stage, row in layers:
        flat = _read_row(arrays, manifest, stage, row)
        writer.write(flat.to(target))  # the flat buffer's leaves lie back to back, in header order
        if (
            frozen_group(stage) in manifest["groups"]
        ):  # then the frozen leaves', back to back in theirs
            writer.write(_read_row(arrays, manifest, frozen_group(stage), row).to(target))
        for gname, tile in _tiled_of(manifest, stage):
            writer.write(_assemble(arrays, manifest, gname, tile, row).to(target))
    writer.close()
    os.replace(tmp, out)
    return [e.name for e in entries]


def _read_row(arrays: dict, manifest: dict, group: str, row: int) -> torch.Tensor:
    """The exact fp32 master of one row: its master slot's arrays read whole, decoded."""
    numel = manifest["groups"][group]["numel"]
    kinds = [e["kind"] for e in manifest["arrays"] if e["group"] == group]
    fmt = row_format(
        checkpoint_formats(manifest), group, TORCH_DTYPES[manifest["param_dtype"]], kinds
    )
    rows = {}
    for kind in (
        (k for k in kinds if fmt.slot_of(k) == "master") if fmt.master != "none" else ["param"]
    ):
        array, dtype, _ = arrays[(group, kind)]
        rows[kind] = torch.empty(numel, dtype=dtype)
        array.read_into_(row, 0, rows[kind]).result()  # sync: the whole row is in its buffer
    return fmt.decode("master", rows)


def _assemble(arrays: dict, manifest: dict, gname: str, tile: dict, layer: int) -> torch.Tensor:
    """A tiled weight of one layer, whole: its tiles (each at the front of its row) joined along the
    axis."""
    shapes = tile["shapes"]
    parts = []
    for t, shape in enumerate(shapes):
        flat = _read_row(arrays, manifest, gname, layer * len(shapes) + t)
        parts.append(flat[: math.prod(shape)].view(shape))
    return torch.cat(parts, dim=tile["axis"]).contiguous()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints export", description=__doc__.splitlines()[0]
    )
    parser.add_argument("ckpt", help="checkpoint directory (one with a manifest.json)")
    parser.add_argument("out", help="output .safetensors file")
    parser.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="fp32")
    args = parser.parse_args(argv)
    names = export(args.ckpt, args.out, args.dtype)
    print(f"wrote {len(names)} tensors to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
