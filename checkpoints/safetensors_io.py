"""The safetensors format, streamed: write tensors one after another, read one tensor at a time.

    [8 bytes: little-endian u64 header length N][N bytes: JSON header][data]
    header: {"<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
    "__metadata__": {..}}

The ``safetensors`` package needs every tensor in memory at once to write a file; a model that lives
on NVMe must go out one layer at a time, so the header is computed first (from the manifest) and the
data follows row by row. Files written here are read by the ``safetensors`` package and vice versa.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import torch

from .manifest import CheckpointError
from .schema import Int, List, Map, Obj, SchemaError, Str, check

# U8: gpt-oss's MXFP4 blocks and scales (checkpoints.mxfp4), read only
ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.uint8: "U8",
}
TORCH_OF = {v: k for k, v in ST_DTYPES.items()}
_NUMPY_OF = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "BF16": np.int16,
    "U8": np.uint8,
}


class Entry:
    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class StreamWriter:
    """Write a safetensors file whose tensors (``entries``, in order) arrive as consecutive byte
    runs."""

    def __init__(self, path: str, entries: list[Entry], metadata: dict[str, str] | None = None):
        header, offset = {}, 0
        for e in entries:
            header[e.name] = {
                "dtype": ST_DTYPES[e.dtype],
                "shape": list(e.shape),
                "data_offsets": [offset, offset + e.nbytes],
            }
            offset += e.nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (
            -len(blob) % 8
        )  # the data starts 8-byte aligned, as the reference writer does
        self.total = offset
        self.written = 0
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, data: torch.Tensor) -> None:
        """Append the bytes of a contiguous CPU tensor (one or several consecutive entries)."""
        raw = data.contiguous().view(torch.uint8).numpy()
        self._file.write(memoryview(raw))
        self.written += raw.nbytes

    def abort(self) -> None:
        """Close the file unfinished (the caller removes it)."""
        self._file.close()

    def close(self) -> None:
        if self.written != self.total:
            self._file.close()
            raise RuntimeError(
                f"safetensors writer: wrote {self.written} data bytes, the header promises "
                f"{self.total}"
            )
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit on the JSON header
TENSOR_INFO = Obj(
    {
        "dtype": Str(choices=sorted(TORCH_OF)),
        "shape": List(Int(0), max_len=32),
        "data_offsets": List(Int(0), min_len=2, max_len=2),
    }
)


class Reader:
    """Read tensors of a safetensors file one at a time (no whole-file load).

    The file is untrusted: its header length must fit in the file, every entry must be well formed,
    and each tensor's byte range must lie in the data section, hold exactly its shape x dtype, and
    overlap no other; else CheckpointError naming the file, the tensor and the field.
    """

    def __init__(self, path: str):
        self.path = path = os.fspath(path)  # errors name the path itself, not PosixPath(...)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(
                    f"{path!r} is not a safetensors file: shorter than its 8-byte header length"
                )
            (n,) = struct.unpack("<Q", raw_len)
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{path!r} is not a safetensors file: its header claims {n} bytes, the file "
                    f"has {size - 8} after the length (and a header may have {MAX_HEADER_BYTES})"
                )
            try:
                header = json.loads(f.read(n))
            except (ValueError, RecursionError) as e:
                raise CheckpointError(
                    f"{path!r} is not a safetensors file: bad header ({e})"
                ) from None
        if not isinstance(header, dict):
            raise CheckpointError(
                f"{path!r}: the safetensors header is {type(header).__name__}, expected an object"
            )
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self.data_start = 8 + n
        self._check(size - self.data_start)

    def _check(self, data_bytes: int) -> None:
        try:
            check(Map(Str(max_len=1 << 16), Str(max_len=1 << 20)), self.metadata, "__metadata__")
            check(Map(Str(max_len=1 << 16), TENSOR_INFO), self.header, "")
        except SchemaError as e:
            raise CheckpointError(f"{self.path!r}: safetensors header field {e}") from None
        end_of_last = 0
        for name, info in sorted(self.header.items(), key=lambda item: item[1]["data_offsets"]):
            begin, end = info["data_offsets"]
            want = math.prod(info["shape"]) * TORCH_OF[info["dtype"]].itemsize
            if not begin <= end <= data_bytes or end - begin != want or begin < end_of_last:
                raise CheckpointError(
                    f"{self.path!r}: tensor {name!r}: data_offsets {info['data_offsets']} must "
                    f"span {want} bytes "
                    f"({info['dtype']} of shape {info['shape']}) within the {data_bytes}-byte data "
                    "section, after "
                    f"the previous tensor's end ({end_of_last})"
                )
            end_of_last = end

    def names(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        info = self.header[name]
        code = info["dtype"]
        begin, end = info["data_offsets"]
        np_dtype = np.dtype(_NUMPY_OF[code])
        arr = np.fromfile(
            self.path,
            dtype=np_dtype,
            count=(end - begin) // np_dtype.itemsize,
            offset=self.data_start + begin,
        )
        t = torch.from_numpy(arr)
        if code == "BF16":
            t = t.view(torch.bfloat16)
        return t.reshape(info["shape"])
