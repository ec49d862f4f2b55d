"""Hugging Face safetensors shards, written as ``save_pretrained`` names and splits them, one tensor
at a time.

    plan = plan_shards(entries, parse_size("5GB"))          # [(file name, [Entry, ...]), ...]
    writer = ShardWriter(out_dir, plan)
    for name, tensor in tensors_in_entry_order:
        writer.write(name, tensor)
    writer.close()                                          # renames into place, writes the index

The split is ``huggingface_hub.split_torch_state_dict_into_shards``' (what ``save_pretrained``
calls): tensors in order fill the current shard until the next would exceed ``max_shard_size``; a
tensor larger than the limit gets a shard of its own, and the current shard goes on after it. One
shard is ``model.safetensors`` with no index; n > 1 are ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` (``metadata.total_size``, ``metadata.total_parameters``,
``weight_map``).
"""

from __future__ import annotations

import json
import math
import os
import re

import torch

from .hf_files import INDEX, SINGLE
from .safetensors_io import Entry, StreamWriter

SIZE_UNITS = {
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_WEIGHT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a string like HF's ("500MB", "5GB": powers of 10) or "2GiB"
    (powers of 2)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size: expected a positive number of bytes, got {size}")
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B)\s*", str(size), flags=re.IGNORECASE)
    if not isinstance(size, str) or match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"max_shard_size: expected positive bytes as an int or a string such as '500MB', '5GB' "
            f"or '2GiB' (units {sorted(SIZE_UNITS)}), got {size!r}"
        )
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])


def plan_shards(entries: list[Entry], max_bytes: int) -> list[tuple[str, list[Entry]]]:
    """The shard files and their tensors, as huggingface_hub splits ``entries`` (in order) under
    ``max_bytes``."""
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    current_bytes = 0
    for entry in entries:
        if (
            entry.nbytes > max_bytes
        ):  # a tensor over the limit: a shard of its own, the current one goes on
            shards.append([entry])
            continue
        if current and current_bytes + entry.nbytes > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(entry)
        current_bytes += entry.nbytes
    if current:
        shards.append(current)
    if len(shards) == 1:
        return [(SINGLE, shards[0])]
    n = len(shards)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", shard) for i, shard in enumerate(shards)]


class ShardWriter:
    """Stream tensors into the planned shards under ``directory`` (each as ``<file>.partial`` until
    ``close``).

    ``write`` takes the tensors in the order of ``plan``'s entries within each file (the order they
    were planned in); a shard's header is written when its first tensor arrives and the file is
    finished when its last one is in, so at most two files are open at once (the current shard and
    an oversized tensor's). ``close`` renames every shard into place, writes the index (n > 1) and
    removes weight files of an earlier export that this one does not replace; ``abort`` removes the
    partials.
    """

    def __init__(
        self, directory: str, plan: list[tuple[str, list[Entry]]], metadata: dict | None = None
    ):
        self.directory, self.plan = directory, plan
        self.metadata = {
            "format": "pt",
            **(metadata or {}),
        }  # transformers refuses files without "format"
        self.file_of = {e.name: file for file, shard in plan for e in shard}
        self.entry = {e.name: e for _, shard in plan for e in shard}
        self.shard = dict(plan)
        self.pending = {file: [e.name for e in shard] for file, shard in plan}
        self.open: dict[str, StreamWriter] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        file = self.file_of[name]
        expected = self.pending[file][0] if self.pending[file] else None
        if name != expected:
            raise RuntimeError(
                f"hf shard writer: got tensor {name!r} for {file!r}, expected {expected!r} next"
            )
        if file not in self.open:
            self.open[file] = StreamWriter(self._partial(file), self.shard[file], self.metadata)
        entry = self.entry[name]
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise RuntimeError(
                f"hf shard writer: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the header "
                f"promises {entry.shape} {entry.dtype}"
            )
        self.open[file].write(tensor.detach().to("cpu").contiguous())
        self.pending[file].pop(0)
        if not self.pending[file]:
            self.open.pop(file).close()  # fsyncs the shard

    def close(self) -> list[str]:
        """Put the shards (and the index) in place; returns the file names written."""
        unfinished = {f: names for f, names in self.pending.items() if names}
        if unfinished:
            raise RuntimeError(f"hf shard writer: tensors never written: {unfinished}")
        files = [file for file, _ in self.plan]
        for file in files:
            os.replace(self._partial(file), os.path.join(self.directory, file))
        if len(files) > 1:
            entries = [e for _, shard in self.plan for e in shard]
            index = {
                "metadata": {
                    "total_size": sum(e.nbytes for e in entries),
                    "total_parameters": sum(math.prod(e.shape) for e in entries),
                },
                "weight_map": dict(self.file_of),
            }
            with open(os.path.join(self.directory, INDEX), "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
            files.append(INDEX)
        for stale in os.listdir(
            self.directory
        ):  # an earlier export's shards would shadow or confuse
            if _WEIGHT_FILES.fullmatch(stale) and stale not in files:
                os.remove(os.path.join(self.directory, stale))
        return files

    def abort(self) -> None:
        for writer in self.open.values():
            writer.abort()
        self.open.clear()
        for file, _ in self.plan:
            if os.path.exists(self._partial(file)):
                os.remove(self._partial(file))

    def _partial(self, file: str) -> str:
        return os.path.join(self.directory, file + ".partial")
