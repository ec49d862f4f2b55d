"""Checkpoints on tensorstore: save, restore at any world size, crash-safe, async, exportable."""

from .commit import latest
from .export import export
from .hf import from_hf, to_hf
from .manifest import FORMAT_VERSION, CheckpointError, read_manifest
from .peft import from_peft, to_peft
from .restore import restore
from .save import SaveHandle, save, save_async
from .weights import from_safetensors, from_state_dict

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "SaveHandle",
    "export",
    "from_hf",
    "from_peft",
    "from_safetensors",
    "from_state_dict",
    "latest",
    "read_manifest",
    "restore",
    "save",
    "save_async",
    "to_hf",
    "to_peft",
]
