"""Export a checkpoint to one consolidated safetensors file, streamed layer by layer.

    python -m checkpoints.export CKPT OUT.safetensors [--dtype fp32|bf16]

One tensor per parameter per layer, named by its full key path: ``embed.tok.w``,
``blocks.3.attn.qkv.w``, ``head.lm_head.w``. Values are the fp32 master weights (``--dtype bf16``
rounds them to bf16, which is exactly the stored 16-bit copy when the run used bf16). No
conversion step is needed before: the arrays are read with tensorstore at any world size.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from .arrays import io_context, read_into_
from .manifest import read_manifest
from .restore import open_arrays
from .safetensors_io import Entry, StreamWriter

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def unit_name(group: str, row: int, rows: int) -> str:
    """``embed``, ``blocks.3``, ``head``: the prefix of a layer's key paths (as zinf_fn.store.Unit.name)."""
    return f"{group}.{row}" if group == "blocks" or rows > 1 else group


def group_order(manifest: dict) -> list[str]:
    known = [g for g in ("embed", "blocks", "head") if g in manifest["groups"]]
    return known + sorted(set(manifest["groups"]) - set(known))


def export(ckpt: str, out: str, dtype: str = "fp32") -> list[str]:
    """Write the consolidated weights of ``ckpt`` to the safetensors file ``out``; returns the names.

    RAM: one layer's flat buffer (plus its cast), whatever the model size.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    target = EXPORT_DTYPES[dtype]
    manifest = read_manifest(ckpt)
    arrays = open_arrays(ckpt, manifest, io_context())
    entries = []
    for gname in group_order(manifest):
        group = manifest["groups"][gname]
        for row in range(group["rows"]):
            prefix = unit_name(gname, row, group["rows"])
            entries += [Entry(f"{prefix}.{leaf['path']}", tuple(leaf["shape"]), target) for leaf in group["leaves"]]
    meta = {"format": "pt", "source": "zinf-fn checkpoint", "step": manifest["step"]}
    tmp = out + ".partial"
    writer = StreamWriter(tmp, entries, meta)
    for gname in group_order(manifest):
        group = manifest["groups"][gname]
        array = arrays[(gname, "master")][0]
        flat = torch.empty(group["numel"], dtype=torch.float32)
        cast = flat if target == torch.float32 else torch.empty(group["numel"], dtype=target)
        for row in range(group["rows"]):
            read_into_(array, row, 0, flat).result()   # sync: the whole layer is in flat
            if cast is not flat:
                cast.copy_(flat)
            writer.write(cast)   # leaves lie back to back in the flat buffer, in header order
    writer.close()
    os.replace(tmp, out)
    return [e.name for e in entries]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpoints.export", description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="checkpoint directory (one with a manifest.json)")
    parser.add_argument("out", help="output .safetensors file")
    parser.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="fp32")
    args = parser.parse_args(argv)
    names = export(args.ckpt, args.out, args.dtype)
    print(f"wrote {len(names)} tensors to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
