"""The zarr3 arrays of the NVMe tier as tensorstore sees them: one allocated array (its handle,
shape, dtype, directory and the file of each row), a torch dtype's zarr3 name, and a zero-copy numpy
view of a tensor for tensorstore's engine (``offload.nvme``).
"""

from __future__ import annotations

import os

import numpy as np
import tensorstore as ts
import torch


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a contiguous CPU tensor; bf16 as ml_dtypes bfloat16
    (tensorstore's)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ts.bfloat16.numpy_dtype)
    return t.numpy()


def zarr_dtype(dtype: torch.dtype) -> str:
    names = {
        torch.bfloat16: "bfloat16",
        torch.float16: "float16",
        torch.float32: "float32",
        torch.float64: "float64",
        torch.uint8: "uint8",
        torch.int16: "int16",
        torch.int32: "int32",
        torch.int64: "int64",
    }
    if dtype not in names:
        raise TypeError(
            f"NvmeTier: dtype {dtype} has no zarr3 equivalent; expected one of {list(names)}"
        )
    return names[dtype]


class ZarrArray:
    """One allocated array: its tensorstore handle, shape, dtype and directory."""

    def __init__(self, handle, rows: int, numel: int, dtype: torch.dtype, directory: str):
        self.handle, self.rows, self.numel, self.dtype, self.directory = (
            handle,
            rows,
            numel,
            dtype,
            directory,
        )
        self.nbytes = numel * dtype.itemsize

    def chunk_path(self, row: int) -> str:
        return os.path.join(self.directory, "c", str(row), "0")
