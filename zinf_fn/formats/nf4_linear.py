"""A linear over a frozen weight as its stored NF4 codes: the weight is never decoded into a buffer.

A frozen weight stored NF4 (``Config(frozen_storage="nf4")``, ``formats.codebook``) is its fp32
absmax scales, a block of 64 elements each, then its codes, two a byte. Where such a weight is a
matrix whose rows are whole blocks (``computes_leaf``: a frozen expert's tile, ``tiling.experts``,
``lent``; a frozen linear of a block whose model takes it so, ``zf.Model.takes_lent``, ``lend``),
the fetcher lends its bytes as they are (``GroupPolicy.lent_leaves``) and the op computes from them
(``CodedMatrix.linear`` / ``grad_input``; ``tiling.lent`` under autograd): on the CPU in fp32 by the
fused C kernels of ``formats.nf4_kernels``, which read each code once and make no fp32 weight,
up to ``FUSED_ROWS`` rows; beyond them, elsewhere (or without a compiler, or in another dtype) by
the torch twin, ``decode_leaf`` then ``F.linear``: the same weights (bitwise ``decode_leaf``'s
values), summed in another order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import optree
import torch
import torch.nn.functional as F

from ..model import Model, Stage
from . import nf4_kernels
from .codebook import FROZEN_BLOCK, Decode, decode_leaf, decode_leaf_, encode_leaf, frozen_code

ROUNDED = (torch.float32, torch.bfloat16)  # the parameter dtypes the kernels round the weights to
# rows up to which a product runs the fused kernels; more rows decode W into a reused buffer and
# run torch's ``F.linear`` / ``mm``, whose multiply-adds cost less than the kernels' once a decode
# (~0.3 ns a weight, once a product) is repaid: ``python benchmarks/nf4_rows.py --quick`` on an
# AVX2 core (Zen 3, MKL), forward + backward, CPU ms fused / decoded, 1536 x 2048: 128 rows 38.2 /
# 44.8, 192 rows 59.4 / 55.3, 512 rows 157 / 100; every shape it times turns at 192 rows. (Not
# measured on AVX-512, whose kernels run one row of W at a time: ``nf4_blocks``.)
FUSED_ROWS = 128


@dataclasses.dataclass(frozen=True)
class CodedMatrix:
    """A weight of ``shape`` (a matrix, or a tile ``(1, d_out, d_in)`` of stacked ones) lent as its
    stored NF4 bytes ``stored`` (uint8: the fp32 scales then the codes, ``codebook.encode_leaf``),
    its values rounded to ``dtype`` (the parameters' 16-bit dtype) as ``decode_leaf`` returns them.
    The matrix it computes with is ``(prod(shape[:-1]), shape[-1])``. Not a tuple: a tree that
    holds one (a block's lent linear weight, ``lend``) sees it as one leaf."""

    stored: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    # ``grad_input_columns``' columns start and end at multiples of it: W's blocks
    column_block: ClassVar[int] = FROZEN_BLOCK

    @property
    def matrix(self) -> tuple[int, int]:
        """(d_out, d_in) of the matrix the products use."""
        return math.prod(self.shape[:-1]), self.shape[-1]

    @staticmethod
    def of(w: torch.Tensor, dtype: torch.dtype) -> CodedMatrix:
        """``w`` (a matrix, or a tile of stacked ones) as the fetcher lends it: its values rounded
        to the parameters' ``dtype`` and encoded as its row holds them (``codebook.encode_leaf``:
        the scales, then the codes)."""
        return CodedMatrix(encode_leaf("nf4", w.detach().to(dtype)), tuple(w.shape), dtype)

    def on(self, stored: torch.Tensor) -> CodedMatrix:
        """The same weight over ``stored`` (equal bytes: a refetched row's)."""
        return dataclasses.replace(self, stored=stored)

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, W, b)``: x (n, d_in) -> (n, d_out), W this weight decoded."""
        y = _fused(x, self, forward=True)
        if y is None:
            return F.linear(x, self._twin_weight(x), b)
        return y if b is None else y.add_(b)

    def grad_input(self, g: torch.Tensor) -> torch.Tensor:
        """``g @ W``: the gradient (n, d_in) of a linear's input from its output's g (n, d_out)."""
        dx = _fused(g, self, forward=False)
        return g.mm(self._twin_weight(g)) if dx is None else dx

    def linear_rows(self, x: torch.Tensor, r0: int, r1: int) -> torch.Tensor | None:
        """Columns r0..r1 of ``F.linear(x, W)``, ``(n, r1 - r0)``: the product with W's rows r0..r1
        by the fused kernels, each column bitwise the whole product's; None where they do not run
        it (``linear`` then)."""
        return _fused(x, self, forward=True, part=(r0, r1))

    def grad_input_columns(self, g: torch.Tensor, c0: int, c1: int) -> torch.Tensor | None:
        """Columns c0..c1 of ``grad_input(g)``, ``(n, c1 - c0)`` (c0 and c1 multiples of 64, W's
        blocks): the product with W's columns c0..c1 by the fused kernels on this thread, each
        column bitwise the whole product's; None where they do not run it (``grad_input``
        then)."""
        return _fused(g, self, forward=False, part=(c0, c1))

    def one_thread(self, rows: int) -> bool:
        """Whether its products with ``rows`` rows of an fp32 input on the CPU run on one thread:
        the fused kernels take them (``_kernels``, not the twin's BLAS product), at few rows
        (``nf4_kernels.ONE_THREAD_ROWS``, where ``nf4_kernels.threads`` gives them one); so two at
        once take two cores (``tiling.two_at_once``)."""
        lib = _kernels(self, rows, torch.device("cpu"), torch.float32)
        return lib is not None and rows <= nf4_kernels.ONE_THREAD_ROWS

    def decoded(self, dtype: torch.dtype) -> torch.Tensor:
        """The twin's weight: (d_out, d_in) of ``dtype``, ``decode_leaf``'s values (decoded
        straight into ``dtype`` in one pass where the C kernel can)."""
        return self._decode_into(torch.empty(self.matrix, dtype=dtype, device=self.stored.device))

    def _twin_weight(self, a: torch.Tensor) -> torch.Tensor:
        """The twin's weight for a product with ``a``: decoded into this thread's scratch buffer
        (``_scratch``: a fresh one's pages fault in at ~1 GB/s, longer than the decode) where
        autograd keeps no reference to it, else a weight of its own."""
        if torch.is_grad_enabled() and a.requires_grad:
            return self.decoded(a.dtype)
        return self._decode_into(_scratch(self.matrix, a.dtype, self.stored.device))

    def _decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (d_out, d_in) filled with ``decode_leaf``'s values: by the C kernel in one pass
        where it can, else the torch twin's, cast."""
        if not decode_leaf_("nf4", self.stored, out, self.dtype):
            out.copy_(decode_leaf("nf4", self.stored, self.matrix, self.dtype))
        return out


class LentLeaves(NamedTuple):
    """The leaves of a block's tree that the fetcher hands as their stored NF4 bytes (the frozen
    row's ``GroupPolicy.lent_leaves``, a uint8 view each): their indices among the tree's leaves
    and the matrices' shapes, all rounded to ``dtype``; ``lend`` makes them ``CodedMatrix`` s."""

    leaves: tuple[tuple[int, tuple[int, ...]], ...]
    dtype: torch.dtype


def lend(model: Model, lent: LentLeaves | None) -> Model:
    """``model`` whose block's apply finds a ``CodedMatrix`` at each leaf of ``lent`` (the bytes the
    fetcher put there), made inside the apply: a block recorded for a later pull-back
    (``scan.tape``) then makes it again on the refetched layer's bytes. ``model`` itself where
    ``lent`` is None."""
    if lent is None:
        return model
    return model._replace(block=Stage(model.block.init, lent_apply(model.block.apply, lent)))


def lent_apply(apply: Callable[..., Any], lent: LentLeaves) -> Callable[..., Any]:
    """``apply(params, *args)`` finding a ``CodedMatrix`` at each leaf of ``lent`` of ``params``,
    where the caller puts the bytes (``lend``'s, the planner's timing of a block)."""
    return functools.partial(_apply_lent, apply, lent)


def _apply_lent(apply, lent: LentLeaves, params, *args):
    """``apply(params, *args)`` with each leaf of ``lent`` made a ``CodedMatrix`` of its bytes."""
    leaves, treedef = optree.tree_flatten(params)
    for j, shape in lent.leaves:
        leaves[j] = CodedMatrix(leaves[j], shape, lent.dtype)
    return apply(optree.tree_unflatten(treedef, leaves), *args)


def encode_lent(params: Any, lent: LentLeaves) -> Any:
    """``params`` (a block's tree of values) with each leaf of ``lent`` as the bytes the fetcher
    lends (its values rounded to ``lent.dtype``, encoded: ``codebook.encode_leaf``), for
    ``lent_apply``."""
    leaves, treedef = optree.tree_flatten(params)
    for j, _shape in lent.leaves:
        leaves[j] = CodedMatrix.of(leaves[j], lent.dtype).stored
    return optree.tree_unflatten(treedef, leaves)


_SCRATCH = threading.local()


def _scratch(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (d_out, d_in) buffer of ``dtype`` on ``device`` for the twin's weight, this thread's,
    reused by its next product (grown to the largest weight it has held: one expert's matrix, a few
    MB, at most)."""
    numel = shape[0] * shape[1]
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or (buf.dtype, buf.device) != (dtype, device) or buf.numel() < numel:
        buf = _SCRATCH.buf = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def computes(decode: Decode | None, device: torch.device, compute: torch.dtype) -> bool:
    """Whether a row stored as ``decode`` says is computed from as it is stored, on ``device`` in
    ``compute`` dtype: one leaf (``computes_leaf``)."""
    if decode is None or len(decode.codes) != 1:
        return False
    return computes_leaf(decode.codes[0], decode.values.leaves[0].shape, device, compute)


def lends_block_leaf(
    takes_lent: Callable[[str], bool] | None,
    path: str,
    code: str,
    shape: tuple[int, ...],
    device: torch.device,
    compute: torch.dtype,
) -> bool:
    """Whether a frozen leaf of a block (full key path ``path``, stored as ``code``) is lent to its
    op as its codes (``GroupPolicy.lent_leaves``): a matrix the model's block takes so
    (``Model.takes_lent``) that the fused kernels compute from (``computes_leaf``)."""
    named = takes_lent is not None and takes_lent(path)
    return named and len(shape) == 2 and computes_leaf(code, shape, device, compute)


def computes_leaf(
    code: str, shape: tuple[int, ...], device: torch.device, compute: torch.dtype
) -> bool:
    """Whether a leaf of ``shape`` stored as ``code`` is computed from as it is stored, on
    ``device`` in ``compute`` dtype: NF4 codes of a matrix (or a stack of them) whose rows are whole
    blocks of 64, for the fused kernel (on the CPU, in fp32; elsewhere the fetcher decodes it, off
    the compute stream, better than the op's twin could)."""
    if device.type != "cpu" or compute != torch.float32 or code != "nf4":
        return False
    return len(shape) >= 2 and shape[-1] % FROZEN_BLOCK == 0


def lent(decode: Decode, row: torch.Tensor) -> CodedMatrix:
    """The weight that the uint8 ``row`` (a gathered row of a group ``computes`` accepts) holds."""
    stored = decode.stored.leaves[0]
    values = decode.values.leaves[0]
    whole = stored.offset == 0 and stored.numel == row.numel()  # a tile's row: its one leaf
    # no view where none is needed: each tensor call lets go of the interpreter's lock (``_stored``)
    codes = row if whole else row[stored.offset : stored.offset + stored.numel]
    return CodedMatrix(codes, values.shape, decode.dtype)


def _fused(
    a: torch.Tensor, w: CodedMatrix, forward: bool, part: tuple[int, int] | None = None
) -> torch.Tensor | None:
    """The fused kernel's product of ``a`` ((n, d_in) forward, (n, d_out) for ``grad_input``) and
    ``w`` (its columns ``part`` only, where given: ``run``); None where it does not run
    (``_kernels``, or a scale not finite): the caller runs the twin."""
    lib = _kernels(w, a.shape[0], a.device, a.dtype)
    return None if lib is None else run(lib, a, w, forward, part)


def _kernels(w: CodedMatrix, n: int, device: torch.device, dtype: torch.dtype):
    """The fused kernels (``nf4_kernels.library``) where they compute a product of ``w`` with ``n``
    rows of a ``dtype`` input on ``device``; None where the twin does: many rows, no compiler, not
    fp32 on the CPU, a dtype they do not round to, W's rows not whole blocks."""
    if n > FUSED_ROWS:  # many rows: decoding W once and BLAS's product cost less
        return None
    lib = nf4_kernels.library()
    cpu = device.type == "cpu" and w.stored.device.type == "cpu"
    if lib is None or not cpu or dtype != torch.float32 or w.dtype not in ROUNDED:
        return None
    if w.matrix[1] % FROZEN_BLOCK:  # a block across rows: the kernels take whole-block rows
        return None
    return lib


def run(
    lib, a: torch.Tensor, w: CodedMatrix, forward: bool, part: tuple[int, int] | None = None
) -> torch.Tensor | None:
    """``a @ W^T`` (``forward``) or ``a @ W`` by the kernels of ``lib`` (``nf4_kernels.library``,
    or ``portable``: the scalar path); None where a scale is not finite. ``part`` (p0, p1): the
    product's columns p0..p1 alone, ``(n, p1 - p0)``: W's rows p0..p1 forward, W's columns
    backward (whole blocks of 64, on this thread), each column the sum the whole product's has
    (the kernels compute each output alone, in one order)."""
    d_out, d_in = w.matrix
    width = d_out if forward else d_in
    p0, p1 = (0, width) if part is None else part
    whole_blocks = forward or (p0 % FROZEN_BLOCK == 0 and p1 % FROZEN_BLOCK == 0)
    if not (0 <= p0 <= p1 <= width and whole_blocks):
        side = "rows" if forward else "columns (whole blocks of 64)"
        raise ValueError(f"nf4_linear.run: part {part} of a product over W's {width} {side}")
    a = a.contiguous()
    n = a.shape[0]
    out = torch.empty(n, p1 - p0, dtype=torch.float32)
    if n == 0 or p0 == p1:
        return out
    if forward:
        bad = _forward(lib, a, w, (p0, p1), out)
    else:
        bad = _grad_input(lib, a, w, None if part is None else (p0, p1), out)
    return None if bad else out


def _forward(lib, x: torch.Tensor, w: CodedMatrix, rows: tuple[int, int], y: torch.Tensor) -> int:
    """``y`` = x @ W[r0:r1]^T by ``nf4_forward`` over W's rows from r0 (their scales and codes);
    nonzero where a scale is not finite."""
    d_in, (r0, r1), n = w.matrix[1], rows, x.shape[0]
    codes, scales = _stored(w, r0)
    threads = nf4_kernels.threads(n, n * (r1 - r0) * d_in)
    ptrs = (x.data_ptr(), codes, scales, frozen_code("nf4").data_ptr())
    return lib.nf4_forward(n, r1 - r0, d_in, *ptrs, _rounds(w), y.data_ptr(), threads)


def _grad_input(lib, g: torch.Tensor, w: CodedMatrix, cols, dx: torch.Tensor) -> int:
    """``dx`` = g @ W[:, c0:c1] by ``nf4_grad_input`` (``cols`` None: every column, on its
    threads) or ``nf4_grad_input_part`` (W's blocks c0 / 64 .. c1 / 64, on this thread); nonzero
    where a scale is not finite."""
    (d_out, d_in), n = w.matrix, g.shape[0]
    codes, scales = _stored(w, 0)
    ptrs = (g.data_ptr(), codes, scales, frozen_code("nf4").data_ptr())
    if cols is None:
        threads = nf4_kernels.threads(n, n * d_out * d_in)
        return lib.nf4_grad_input(n, d_out, d_in, *ptrs, _rounds(w), dx.data_ptr(), threads)
    k0, k1 = cols[0] // FROZEN_BLOCK, cols[1] // FROZEN_BLOCK
    return lib.nf4_grad_input_part(n, d_out, d_in, *ptrs, _rounds(w), dx.data_ptr(), k0, k1)


def _stored(w: CodedMatrix, r0: int) -> tuple[int, int]:
    """The addresses of the codes and of the fp32 scales of W's rows from ``r0`` in its stored
    bytes (the scales, then the codes: ``codebook.encode_leaf``), by their byte offsets: no view is
    made, since each tensor call lets go of the interpreter's lock and waits to take it back while
    the side thread and the engine's threads run Python (four a product, thousands a 30B step)."""
    (d_out, d_in), base = w.matrix, w.stored.data_ptr()
    if base % 4:
        raise ValueError(f"nf4_linear: W's stored bytes start at {base:#x}, not 4-byte aligned")
    per_row = d_in // FROZEN_BLOCK
    scales = base + 4 * r0 * per_row
    codes = base + 4 * (d_out * per_row) + r0 * per_row * FROZEN_BLOCK // 2
    return codes, scales


def _rounds(w: CodedMatrix) -> int:
    """The kernels' ``rb``: 1 where the weights round to bfloat16 (the parameters' dtype)."""
    return int(w.dtype == torch.bfloat16)
