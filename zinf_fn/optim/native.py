"""Build and call the C kernels of the compressed AdamW update (``optim.native_source``).

The library is built on first use with the system C compiler (``$CC``, else ``cc``): a plain C file
against no headers but libc's, so it builds in about a second, from a clean clone, with no torch headers.
It is cached under ``$ZINF_FN_CACHE`` (default ``~/.cache/zinf_fn``)/native/<hash of the source, the
flags and this CPU's feature flags>, written to a temporary name and renamed, so concurrent processes
never load a half-written library. ``library()`` is None where no compiler works; the updater then runs
``optim.compressed``'s ``torch.compile`` twins (same results, slower).

The pointers passed are the tensors' own (contiguous, on the CPU): the kernels write in place.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from .native_source import SOURCE

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno")
_P, _I64, _I32, _U32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32


def _cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


def _build(out: Path, compiler: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp, "adamw.c"), Path(tmp, out.name)
        src.write_text(SOURCE)
        subprocess.run([compiler, *FLAGS, str(src), "-o", str(lib), "-lm"], check=True, capture_output=True)
        os.replace(lib, out)   # atomic: another process sees no library or a whole one


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels (built or loaded once per process), or None where they cannot be built."""
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256("\n".join((SOURCE, compiler, *FLAGS, _cpu_flags())).encode()).hexdigest()[:16]
    root = Path(os.environ.get("ZINF_FN_CACHE", Path.home() / ".cache" / "zinf_fn"))
    path = root / "native" / digest / "libzinf_adamw.so"
    try:
        if not path.exists():
            _build(path, compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError):
        return None
    lib.adamw_int8.argtypes = [_I64, *[_P] * 14, _I32]
    lib.adamw_bf16.argtypes = [_I64, *[_P] * 7, _U32, _I64, _P, _P, _I32]
    lib.remainder_join.argtypes = lib.remainder_split.argtypes = [_I64, _P, _P, _P, _I32]
    lib.ties_away.argtypes = [_I64, _P, _P, _I32]
    for fn in (lib.adamw_int8, lib.adamw_bf16, lib.remainder_join, lib.remainder_split, lib.ties_away):
        fn.restype = None
    return lib


def ptr(t: torch.Tensor | None) -> int | None:
    """The data pointer of a contiguous CPU tensor (None passes NULL)."""
    if t is None:
        return None
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"native kernels take contiguous CPU tensors, got {t.device} "
                         f"contiguous={t.is_contiguous()} of shape {tuple(t.shape)}")
    return t.data_ptr()


KEYS = 0x3F81   # 16-bit prefixes of |y| <= 1.0 (0x3F80 is 1.0's), as native_source's KEYS


def code_luts(bounds_m: torch.Tensor, bounds_v: torch.Tensor) -> torch.Tensor:
    """uint8 (2 * 2 * KEYS + 4,): per map (m's, then v's), per 16-bit prefix k of y in [-1, 1] (|y|'s
    prefixes, then the negative ones), the number of midpoints (``bounds``, 256 with the +inf pad) below
    the prefix's smallest value; 4 zero bytes at the end (the kernel gathers 4 bytes at a time).
    The maps' codes are at least 1.4 % apart and a prefix spans at most 0.8 %, so one more comparison
    finds the nearest code (checked here)."""
    keys = torch.arange(KEYS, dtype=torch.int64)
    positive = torch.stack([keys << 16, (keys << 16) | 0xFFFF])                  # (smallest, largest) bits
    negative = torch.stack([((keys | 0x8000) << 16) | 0xFFFF, (keys | 0x8000) << 16])
    as_f32 = lambda b: ((b ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.float32)
    lo, hi = (as_f32(torch.cat([positive[k], negative[k]])) for k in (0, 1))
    rows = []
    for bounds in (bounds_m, bounds_v):
        mids = bounds[:-1]
        below = torch.bucketize(lo, mids)                        # midpoints < the prefix's smallest value
        within = torch.bucketize(hi, mids, right=True) - below   # midpoints in [smallest, largest]
        assert int(within.max()) <= 1, "a 16-bit prefix holds two midpoints"
        rows.append(below.to(torch.uint8))
    return torch.cat([*rows, torch.zeros(4, dtype=torch.uint8)])
