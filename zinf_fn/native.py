"""Build and load a C kernel library from its source with the system C compiler, cached on disk.

A library is a plain C file against no headers but libc's and libm's, so it builds in about a
second from a clean clone, with no torch headers. It is cached under ``$ZINF_FN_CACHE`` (default
``~/.cache/zinf_fn``)/native/<hash of the source, the compiler, the flags and this CPU's feature
flags>, written to a temporary name and renamed, so concurrent processes never load a half-written
library. ``build`` returns None where no compiler works: each caller then runs its torch twin (the
same results, slower).

The pointers passed to a kernel are the tensors' own (``ptr``: contiguous, on the CPU).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-ffp-contract=off",
    "-fno-math-errno",
)

# C helpers every library's source includes after its headers (<stdint.h>, <string.h>): a float's
# bits and back, and the bits of fp32 ``u`` rounded to bfloat16 as torch's cast rounds a finite
# value (to nearest, ties to even; the low half zeroed)
BITS = r"""
static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static inline uint32_t bf16_nearest(uint32_t u) {
    return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}
"""


def cpu_flags() -> str:
    """This CPU's feature flags (``/proc/cpuinfo``), part of a library's cache key."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


def _compile(out: Path, source: str, compiler: str, flags: tuple[str, ...]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp, out.stem + ".c"), Path(tmp, out.name)
        src.write_text(source)
        subprocess.run(
            [compiler, *flags, str(src), "-o", str(lib), "-lm"], check=True, capture_output=True
        )
        os.replace(lib, out)  # atomic: another process sees no library or a whole one


def build(name: str, source: str, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The library ``lib<name>.so`` of C ``source`` built with ``flags``, once per source,
    compiler, flags and CPU (then loaded from the cache); None where it cannot be built."""
    compiler = os.environ.get("CC", "cc")
    key = "\n".join((source, compiler, *flags, cpu_flags()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(os.environ.get("ZINF_FN_CACHE", Path.home() / ".cache" / "zinf_fn"))
    path = root / "native" / digest / f"lib{name}.so"
    try:
        if not path.exists():
            _compile(path, source, compiler, flags)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError):
        return None


def ptr(t: torch.Tensor | None) -> int | None:
    """The data pointer of a contiguous CPU tensor (None passes NULL)."""
    if t is None:
        return None
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"native kernels take contiguous CPU tensors, got {t.device} "
            f"contiguous={t.is_contiguous()} of shape {tuple(t.shape)}"
        )
    return t.data_ptr()
