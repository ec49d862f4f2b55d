"""Reading a Hugging Face model directory: ``config.json`` and its safetensors weights, one tensor
at a time.

    HF_DIR/config.json                        the model's transformers config
    HF_DIR/model.safetensors                  every tensor in one file, or
    HF_DIR/model.safetensors.index.json       {"metadata": {...}, "weight_map": {tensor name: shard
    file}} HF_DIR/model-00001-of-00003.safetensors   ... the shards the index names

The directory is input from elsewhere and treated as such: JSON files are read bounded, shard names
must be plain file names inside the directory, each shard's header is read (and validated, see
``safetensors_io.Reader``) exactly once, and a tensor is read only when asked for. Every problem is
a ``CheckpointError`` (a ``ValueError``) naming the file, the tensor and what was expected.
"""

from __future__ import annotations

import os

import torch

from .manifest import CheckpointError
from .safetensors_io import Reader
from .schema import Map, SchemaError, Str, check, load_json

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20
# Buffers older transformers releases saved beside the weights; they are recomputed, never loaded.
NON_PARAMETERS = ("rotary_emb.inv_freq",)


def read_json(path: str, what: str) -> dict:
    """The JSON object in ``path`` (``what`` names it in errors); CheckpointError if absent or not
    an object."""
    try:
        value = load_json(path, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{path!r}: no such file; expected {what}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path!r}: cannot be read as {what}: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{path!r}: expected {what} (a JSON object), got a {type(value).__name__}"
        )
    return value


def read_config(directory: str) -> dict:
    """``directory/config.json`` as a dict."""
    return read_json(
        os.path.join(directory, CONFIG), "the transformers config.json that save_pretrained writes"
    )


class HFWeights:
    """The tensors of an HF directory by name: ``names()``, ``shape(name)``, ``get(name)`` (read on
    demand, in the dtype stored: fp32, bf16 or fp16) and ``locate(name)`` (where it lives, for error
    messages).

    ``where`` is the file that lists the tensors: the index, or the single ``model.safetensors``.
    """

    def __init__(self, directory: str):
        self.directory = directory
        index, single = os.path.join(directory, INDEX), os.path.join(directory, SINGLE)
        if os.path.isfile(index):
            self.where = index
            weight_map = self._read_index(index)
        elif os.path.isfile(single):
            self.where, weight_map = single, None
        else:
            raise CheckpointError(
                f"{directory!r}: neither {SINGLE} nor {INDEX}; expected the safetensors weights "
                "transformers' save_pretrained writes (PyTorch .bin files are not read)"
            )
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
        self.readers = {f: self._open(f, weight_map) for f in files}  # every header read once, here
        if weight_map is None:
            weight_map = dict.fromkeys(self.readers[SINGLE].names(), SINGLE)
        self._check_index(weight_map)
        self.file_of = {
            name: f for name, f in weight_map.items() if not name.endswith(NON_PARAMETERS)
        }

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.readers[self.file_of[name]].shape(name)

    def get(self, name: str) -> torch.Tensor:
        return self.readers[self.file_of[name]].get(name)

    def locate(self, name: str) -> str:
        return f"tensor {name!r} of {os.path.join(self.directory, self.file_of[name])!r}"

    def _read_index(self, index: str) -> dict[str, str]:
        content = read_json(
            index, "a safetensors index {'metadata': {...}, 'weight_map': {tensor: file}}"
        )
        try:
            check(
                Map(Str(max_len=1 << 16), Str(max_len=255)), content.get("weight_map"), "weight_map"
            )
        except SchemaError as e:
            raise CheckpointError(f"{index!r}: {e}") from None
        for name, file in content["weight_map"].items():
            if (
                os.path.basename(file) != file
                or file in (".", "..")
                or not file.endswith(".safetensors")
            ):
                raise CheckpointError(
                    f"{index!r}: weight_map[{name!r}] is {file!r}; expected the name of a "
                    ".safetensors file in the same directory (no path)"
                )
        return content["weight_map"]

    def _open(self, file: str, weight_map: dict | None) -> Reader:
        path = os.path.join(self.directory, file)
        if not os.path.isfile(path):
            held = sorted(n for n, f in (weight_map or {}).items() if f == file)
            raise CheckpointError(
                f"{self.where!r} names shard {file!r} (for tensors {held[:3]}"
                f"{' ...' if len(held) > 3 else ''}), but {path!r} does not exist; expected "
                "every shard the index names beside it"
            )
        return Reader(path)

    def _check_index(self, weight_map: dict[str, str]) -> None:
        for name, file in weight_map.items():
            if name not in self.readers[file].header:
                raise CheckpointError(
                    f"{self.where!r} puts tensor {name!r} in {file!r}, but that shard has no "
                    f"such tensor; expected it among the {len(self.readers[file].header)} "
                    f"tensors of {os.path.join(self.directory, file)!r}"
                )
