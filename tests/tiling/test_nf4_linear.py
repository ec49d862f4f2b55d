"""The fused linear over a frozen weight's NF4 codes (``zinf_fn.formats.nf4_linear``), against its
reference: the weight decoded (``codebook.decode_leaf``, bitsandbytes' values:
tests/optim/test_codebook.py) and torch's ``F.linear`` / ``mm``.

The weights are the same numbers; only the order of the fp32 sums differs (16 lanes, then pairwise,
against MKL's blocking), so each output may differ by the reassociation of its d_in (forward) or
d_out (dx) terms: at most ``2 * terms * 2**-24 * sum |a_i w_i|`` (each order's error is below
``terms * u`` times the sum of the terms' magnitudes, u = 2**-24, to first order). The kernel's
own paths (AVX-512, AVX2, scalar) sum in one order, so they agree bitwise, whatever the thread
count; where the kernel cannot run (another dtype, a scale not finite) the result is the twin's,
bitwise.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import one_thread

from zinf_fn.formats import codebook, nf4_kernels, nf4_linear
from zinf_fn.tiling import RowTiles, expert_linear
from zinf_fn.tiling.held import HeldTiles

SHAPES = [(64, 64), (192, 320), (128, 640), (96, 128)]
ROWS = [1, 2, 3, 4, 5, 8, 13, 16]
U = 2.0**-24


def _built(isa):
    """The kernels this CPU runs (``isa`` None) or those built for ``isa`` (``nf4_kernels.variant``:
    ``()`` the scalar path, the AVX2 flags its path)."""
    lib = nf4_kernels.library() if isa is None else nf4_kernels.variant(isa)
    assert lib is not None
    return lib


def _coded(shape, dtype, seed=0, hard=False) -> nf4_linear.CodedMatrix:
    """A random (d_out, d_in) weight rounded to ``dtype`` and stored NF4, as a tile (1, d_out,
    d_in); ``hard``: blocks of zeros, one of a single spike, one of tiny values, one constant."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.02
    if hard:
        flat = w.view(-1)
        flat[:64] = 0.0  # absmax 0
        flat[64:128] = 0.0
        flat[100] = 3.0  # one spike: the others round to the code nearest 0
        flat[128:192] *= 1e-30  # tiny scale
        flat[192:256] = -0.5  # constant: every code -1
    stored = codebook.encode_leaf("nf4", w.to(dtype))
    return nf4_linear.CodedMatrix(stored, (1, *shape), dtype)


def _bound(a: torch.Tensor, w: torch.Tensor, terms: int) -> torch.Tensor:
    """The reassociation bound of ``a @ w`` (see the module docstring), plus the smallest normal
    fp32 for products that underflow."""
    return 2 * terms * U * (a.abs() @ w.abs()) + torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hard", [False, True])
def test_the_fused_products_are_decode_then_f_linear(dtype, shape, hard):
    w = _coded(shape, dtype, hard=hard)
    dense = codebook.decode_leaf("nf4", w.stored, shape, dtype).float()  # (d_out, d_in)
    assert torch.equal(w.decoded(torch.float32), dense)
    gen = torch.Generator().manual_seed(1)
    for n in ROWS:
        x = torch.randn(n, shape[1], generator=gen)
        g = torch.randn(n, shape[0], generator=gen)
        y, dx = w.linear(x), w.grad_input(g)
        y_ref, dx_ref = torch.nn.functional.linear(x, dense), g.mm(dense)
        assert ((y - y_ref).abs() <= _bound(x, dense.T, shape[1])).all(), n
        assert ((dx - dx_ref).abs() <= _bound(g, dense, shape[0])).all(), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", [(), ("-mavx2", "-mfma")], ids=["scalar", "avx2"])
def test_the_other_paths_and_any_thread_count_give_the_vector_paths_bits(dtype, isa):
    """The portable build (no -march: the scalar loop) and the AVX2 build sum in this CPU's
    path's order (AVX-512 here)."""
    portable = nf4_kernels.variant(isa)
    assert portable is not None and nf4_kernels.library() is not None
    w = _coded((192, 320), dtype, seed=2, hard=True)
    gen = torch.Generator().manual_seed(3)
    for n in (1, 4, 7, 16):
        x, g = torch.randn(n, 320, generator=gen), torch.randn(n, 192, generator=gen)
        y, dx = w.linear(x), w.grad_input(g)
        assert torch.equal(nf4_linear.run(portable, x, w, forward=True), y)
        assert torch.equal(nf4_linear.run(portable, g, w, forward=False), dx)
        with one_thread():
            assert torch.equal(w.linear(x), y) and torch.equal(w.grad_input(g), dx)


def _no_compiler():
    return None


def test_where_the_kernel_cannot_run_the_twin_does(monkeypatch):
    """A bf16 input, a scale that is not finite, no C compiler: decode_leaf then F.linear / mm,
    bitwise."""
    w = _coded((64, 128), torch.bfloat16, seed=4)
    x = torch.randn(3, 128).to(torch.bfloat16)
    dense = codebook.decode_leaf("nf4", w.stored, (64, 128), torch.bfloat16)
    assert torch.equal(w.linear(x), torch.nn.functional.linear(x, dense))
    with monkeypatch.context() as patch:
        patch.setattr(nf4_kernels, "library", _no_compiler)
        xf, g = torch.randn(3, 128), torch.randn(3, 64)
        assert torch.equal(w.linear(xf), torch.nn.functional.linear(xf, dense.float()))
        assert torch.equal(w.grad_input(g), g.mm(dense.float()))
    stored = w.stored.clone()
    stored[:4].view(torch.float32).fill_(float("inf"))
    odd = w.on(stored)
    dense = codebook.decode_leaf("nf4", stored, (64, 128), torch.bfloat16).float()
    xf, g = torch.randn(3, 128), torch.randn(3, 64)
    bitwise = dict(rtol=0, atol=0, equal_nan=True)  # NaN where code 0 meets the inf scale
    torch.testing.assert_close(odd.linear(xf), torch.nn.functional.linear(xf, dense), **bitwise)
    torch.testing.assert_close(odd.grad_input(g), g.mm(dense), **bitwise)


def test_a_bias_is_added_after_the_sum():
    w = _coded((64, 64), torch.bfloat16, seed=5)
    x, b = torch.randn(2, 64), torch.randn(64)
    assert torch.equal(w.linear(x, b), w.linear(x) + b)


def test_an_expert_tile_lent_as_codes_takes_the_fused_products_in_autograd():
    """``tiling.expert_linear`` over a source whose tile is a ``CodedMatrix`` (what the engine
    fetches for a frozen NF4 expert): forward and dx are the fused kernel's, bitwise; the frozen
    weight gets no gradient."""
    w = _coded((128, 64), torch.bfloat16, seed=6)
    source = HeldTiles(RowTiles((w,)), torch.zeros(0))
    x = torch.randn(5, 64, requires_grad=True)
    y = expert_linear(x, source, 0)
    assert torch.equal(y, w.linear(x.detach()))
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, w.grad_input(g))


def _always(threads: int):
    """``nf4_kernels.threads`` fixed at ``threads`` whatever the product."""

    def fixed(rows: int, work: int) -> int:
        return threads

    return fixed


@pytest.mark.parametrize("threads", [2, 3])
def test_the_threads_split_of_the_outputs_changes_no_bit(monkeypatch, threads):
    """Forced onto several threads (a product of few rows runs on one, ``nf4_kernels.threads``),
    each taking a range of W's rows forward and of its blocks of columns for dx, the products are
    the one thread's, bitwise."""
    w = _coded((192, 320), torch.bfloat16, seed=7, hard=True)
    gen = torch.Generator().manual_seed(8)
    for n in (1, 2, 5, 9):
        x, g = torch.randn(n, 320, generator=gen), torch.randn(n, 192, generator=gen)
        one = w.linear(x), w.grad_input(g)
        with monkeypatch.context() as patch:
            patch.setattr(nf4_kernels, "threads", _always(threads))
            assert torch.equal(w.linear(x), one[0]) and torch.equal(w.grad_input(g), one[1])


@pytest.mark.parametrize("isa", [None, (), ("-mavx2", "-mfma")], ids=["native", "scalar", "avx2"])
def test_rows_beyond_a_group_share_a_decode_and_keep_each_rows_bits(isa):
    """More than GROUP (4) rows share one decode of W (a thread's decoded row forward, a decoded
    block for all rows backward); each row of y and dx is still the bits of that row computed
    alone, a group of 4 or fewer at a time, whose decode stays in registers."""
    lib = _built(isa)
    w = _coded((192, 320), torch.bfloat16, seed=5, hard=True)
    gen = torch.Generator().manual_seed(6)
    for n in (5, 8, 13, 32):
        x, g = torch.randn(n, 320, generator=gen), torch.randn(n, 192, generator=gen)
        y = nf4_linear.run(lib, x, w, forward=True)
        dx = nf4_linear.run(lib, g, w, forward=False)
        for r0 in range(0, n, 4):
            rows = slice(r0, r0 + 4)
            assert torch.equal(nf4_linear.run(lib, x[rows], w, forward=True), y[rows]), (n, r0)
            assert torch.equal(nf4_linear.run(lib, g[rows], w, forward=False), dx[rows]), (n, r0)


@pytest.mark.parametrize("isa", [None, (), ("-mavx2", "-mfma")], ids=["native", "scalar", "avx2"])
def test_a_range_of_ws_rows_is_those_columns_of_the_whole_product(isa):
    """``run(..., part=(r0, r1))`` (``CodedMatrix.linear_rows``): columns r0..r1 of the forward
    product, bitwise, at every row count's path and at ranges that cut the tiles (3 rows of W, a
    thread's decoded rows) anywhere; an empty range, and a backward range refused."""
    lib = _built(isa)
    w = _coded((100, 320), torch.bfloat16, seed=14, hard=True)
    gen = torch.Generator().manual_seed(15)
    for n in (1, 3, 4, 5, 13, 32):
        x = torch.randn(n, 320, generator=gen)
        y = nf4_linear.run(lib, x, w, forward=True)
        for r0, r1 in ((0, 50), (50, 100), (1, 2), (7, 64), (0, 100), (99, 100), (30, 30)):
            part = nf4_linear.run(lib, x, w, forward=True, part=(r0, r1))
            assert torch.equal(part, y[:, r0:r1]), (n, r0, r1)
    with pytest.raises(ValueError, match="rows"):
        nf4_linear.run(lib, x, w, forward=True, part=(50, 101))


@pytest.mark.parametrize("isa", [None, (), ("-mavx2", "-mfma")], ids=["native", "scalar", "avx2"])
def test_a_range_of_ws_columns_is_those_columns_of_the_whole_grad_input(isa):
    """``run(..., forward=False, part=(c0, c1))`` (``CodedMatrix.grad_input_columns``): columns
    c0..c1 of ``g @ W``, bitwise, at every row count's path (registers below 5 rows, shared decodes
    from 5, more rows than a run of W's 32) and ranges of whole blocks anywhere in W's 17 (past a
    chunk of 1024 columns too); a range that cuts a block refused."""
    lib = _built(isa)
    w = _coded((100, 1088), torch.bfloat16, seed=16, hard=True)
    gen = torch.Generator().manual_seed(17)
    for n in (1, 3, 4, 5, 13, 32, 40):
        g = torch.randn(n, 100, generator=gen)
        dx = nf4_linear.run(lib, g, w, forward=False)
        for c0, c1 in ((0, 512), (512, 1088), (64, 128), (0, 1088), (1024, 1088), (320, 320)):
            part = nf4_linear.run(lib, g, w, forward=False, part=(c0, c1))
            assert torch.equal(part, dx[:, c0:c1]), (n, c0, c1)
    coded = nf4_linear.CodedMatrix
    assert torch.equal(coded.grad_input_columns(w, g, 64, 576), coded.grad_input(w, g)[:, 64:576])
    for bad in ((0, 100), (32, 64), (0, 1152)):
        with pytest.raises(ValueError, match="columns"):
            nf4_linear.run(lib, g, w, forward=False, part=bad)


@pytest.mark.parametrize("isa", [(), ("-mavx2", "-mfma")], ids=["scalar", "avx2"])
def test_the_edges_of_the_tiled_loops_keep_the_bits(isa):
    """Where the AVX2 path's tiles end (d_out not a multiple of its 3 rows of W forward nor of its
    runs of 32 rows backward, d_in past a chunk of 1024 columns, odd rows, more rows than a batch
    of 32): the other build's bits, whichever path this CPU runs."""
    lib, other = nf4_kernels.library(), nf4_kernels.variant(isa)
    assert lib is not None and other is not None
    w = _coded((100, 1088), torch.bfloat16, seed=12, hard=True)
    gen = torch.Generator().manual_seed(13)
    for n in (3, 4, 5, 7, 33, 40):
        x, g = torch.randn(n, 1088, generator=gen), torch.randn(n, 100, generator=gen)
        for a, forward in ((x, True), (g, False)):
            mine = nf4_linear.run(lib, a, w, forward=forward)
            assert torch.equal(nf4_linear.run(other, a, w, forward=forward), mine), (n, forward)


def test_beyond_fused_rows_the_products_are_decode_then_torch_bitwise():
    """More rows than ``FUSED_ROWS``: W decoded once into this thread's reused buffer, then
    ``F.linear`` / ``mm``: the twin's bits. Up to it, the fused kernel's. The buffer a product
    reuses holds no stale weight (two weights in turn), and under autograd a product whose input
    wants a gradient decodes a weight of its own (the one autograd saves is never overwritten)."""
    lib = nf4_kernels.library()
    assert lib is not None
    a, b = _coded((192, 320), torch.bfloat16, seed=9), _coded((192, 320), torch.bfloat16, seed=10)
    gen = torch.Generator().manual_seed(11)
    for w in (a, b, a):
        dense = codebook.decode_leaf("nf4", w.stored, (192, 320), torch.bfloat16).float()
        for n in (nf4_linear.FUSED_ROWS + 1, 2 * nf4_linear.FUSED_ROWS):
            x, g = torch.randn(n, 320, generator=gen), torch.randn(n, 192, generator=gen)
            assert torch.equal(w.linear(x), torch.nn.functional.linear(x, dense))
            assert torch.equal(w.grad_input(g), g.mm(dense))
        n = nf4_linear.FUSED_ROWS
        x, g = torch.randn(n, 320, generator=gen), torch.randn(n, 192, generator=gen)
        assert torch.equal(w.linear(x), nf4_linear.run(lib, x, w, forward=True))
        assert torch.equal(w.grad_input(g), nf4_linear.run(lib, g, w, forward=False))
    x = torch.randn(2 * nf4_linear.FUSED_ROWS, 320, generator=gen, requires_grad=True)
    y = a.linear(x)
    b.linear(x.detach())  # a product in between, which would overwrite a reused buffer
    g = torch.randn_like(y)
    y.backward(g)
    dense = codebook.decode_leaf("nf4", a.stored, (192, 320), torch.bfloat16).float()
    assert torch.equal(x.grad, g.mm(dense))
