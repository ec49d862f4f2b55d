"""The compressed AdamW update (``optim.compressed.adamw_piece_``) against the plain-torch reference
of tests/compressed_reference.py, op by op, and against bitsandbytes' CPU ``AdamW8bit``.

The reference rounds every operation to fp32 as the kernels do, so the kernels must equal it bitwise
(its correctly rounded sqrt is explained there).
"""

from __future__ import annotations

import pytest
import torch
from compressed_reference import HYPER, ref_dequantize, ref_quantize, ref_update

import zinf_fn as zf
from zinf_fn.formats import codebook
from zinf_fn.optim import DecaySpans, formats
from zinf_fn.optim import compressed as C
from zinf_fn.optim.pieces import Compressed, update_piece_
from zinf_fn.optim.remainder import join, to_bf16_ties_away


# -- helpers
# ----------------------------------------------------------------------------------------------
def _data(n, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), [
        torch.randn(n, generator=gen) * 0.1 for _ in range(steps)
    ]


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(_bits(x), _bits(y))


def _master(kind, p):
    return C.init_master(formats.MasterFormat(kind), p.clone())


def _fp32(master):
    return join(*master) if isinstance(master, C.RemainderMaster) else master


@pytest.mark.parametrize("moments", ["int8", "bf16"])
@pytest.mark.parametrize("master", ["fp32", "remainder"])
@pytest.mark.parametrize("decay", [None, DecaySpans(((100, 700), (1500, 2048)), 2048)])
def test_update_equals_the_plain_torch_reference_bitwise(moments, master, decay):
    n, steps = 2048, 4
    p0, grads = _data(n, steps)
    ours = _master(master, p0)
    copy16 = torch.empty(n, dtype=torch.bfloat16) if master == "fp32" else None
    mom = C.init_moments(formats.MomentsFormat(moments), n)
    ref_p, ref_m = (
        _fp32(_master(master, p0)).clone(),
        C.init_moments(formats.MomentsFormat(moments), n),
    )
    decayed = C.decay_mask(decay, n)
    decayed = torch.ones(n, dtype=torch.bool) if decayed is None else decayed
    for step, g in enumerate(grads):
        lr = 1e-2 * (0.8**step)
        C.adamw_piece_(
            g,
            ours,
            mom,
            HYPER,
            step,
            lr,
            element_offset=512,
            unit_seed=7,
            copy16=copy16,
            decay=decay,
        )
        ref_p, ref_m = ref_update(g, ref_p, ref_m, step, lr, decayed, offset=512, unit_seed=7)
        _same(mom, ref_m)
        assert torch.equal(_bits(_fp32(ours)), _bits(ref_p))
        copy = copy16 if master == "fp32" else ours.param
        assert torch.equal(_bits(copy), _bits(to_bf16_ties_away(ref_p)))


def test_remainder_with_fp32_moments_is_the_fp32_master_with_ties_away_copies():
    """fp32 moments run torch's fused AdamW: the remainder master gives the fp32 master's bits, and
    the fp32 master's update is ``zf.adamw``'s."""
    import zinf_fn as zf

    n = 1000
    p0, grads = _data(n, 5)
    decay = DecaySpans(((0, 300),), n)
    rem, master, copy16 = _master("remainder", p0), p0.clone(), torch.empty(n, dtype=torch.bfloat16)
    m1, m2 = (C.init_moments(formats.MomentsFormat("fp32"), n) for _ in range(2))
    opt, plain, state = (
        zf.adamw(lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1),
        p0.clone(),
        None,
    )
    state = opt.init(plain)
    for step, g in enumerate(grads):
        C.adamw_piece_(g, rem, m1, HYPER, step, 1e-2, decay=decay)
        C.adamw_piece_(g, master, m2, HYPER, step, 1e-2, copy16=copy16, decay=decay)
        opt.update(g.clone(), state, plain, step, decay)
        assert torch.equal(_bits(join(*rem)), _bits(master)) and torch.equal(
            _bits(master), _bits(plain)
        )
        assert torch.equal(_bits(rem.param), _bits(copy16))


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_zero_gradients_leave_parameters_unchanged(moments, master):
    n = 4096
    p0, _ = _data(n, 0)
    ours = _master(master, p0)
    mom = C.init_moments(formats.MomentsFormat(moments), n)
    hyper = HYPER._replace(weight_decay=0.0)
    for step in range(3):
        C.adamw_piece_(torch.zeros(n), ours, mom, hyper, step, 1e-2, unit_seed=3)
    assert torch.equal(_bits(_fp32(ours)), _bits(p0))


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_pieces_of_any_block_multiple_give_the_same_bits(moments):
    """A row updated whole, or in pieces of 256 k elements cut at other places: the same bits (what
    makes placements, world sizes and piece sizes agree)."""
    n = 256 * 24
    p0, grads = _data(n, 3, seed=1)
    decay = DecaySpans(((1000, 4000),), n)
    results = []
    for cuts in (
        [0, n],
        [0, 256 * 5, 256 * 6, 256 * 17, n],
        [0, 256 * 12, n],
        list(range(0, n + 1, 256 * 4)),
    ):
        master, mom = _master("remainder", p0), C.init_moments(formats.MomentsFormat(moments), n)
        for step, g in enumerate(grads):
            for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
                m_piece = _piece(mom, lo, hi)
                C.adamw_piece_(
                    g[lo:hi],
                    C.RemainderMaster(master.param[lo:hi], master.remainder[lo:hi]),
                    m_piece,
                    HYPER,
                    step,
                    1e-2,
                    element_offset=lo,
                    unit_seed=11,
                    decay=decay.slice(lo, hi),
                )
        results.append((master, mom))
    for master, mom in results[1:]:
        _same(master, results[0][0])
        _same(mom, results[0][1])


def _piece(mom, lo, hi):
    if isinstance(mom, C.Int8Moments):
        return C.Int8Moments(
            mom.m_codes[lo:hi],
            mom.m_absmax[lo // 256 : hi // 256],
            mom.v_codes[lo:hi],
            mom.v_absmax[lo // 256 : hi // 256],
        )
    return type(mom)(*(x[lo:hi] for x in mom))


def test_int8_pieces_must_start_on_a_block():
    n = 512
    mom = C.init_moments(formats.MomentsFormat("int8"), n)
    with pytest.raises(
        AssertionError,
        match="multiples of 256 elements; got a piece of 512 elements at element 128",
    ):
        C.adamw_piece_(torch.zeros(n), torch.zeros(n), mom, HYPER, 0, 1e-2, element_offset=128)


@pytest.mark.parametrize("cols", [32, 1024, 4097])
def test_int8_agrees_with_bitsandbytes_adamw8bit(cols):
    """bitsandbytes' optimizer test protocol: 50 steps on a 1024 x cols tensor, parameters ~ 0.1
    randn, gradients ~ 0.01 randn, the two brought back together every 10 steps (its params and
    states copied into ours: the same maps and blocks); at every step the mean absolute (relative)
    parameter error within 6e-5 (6e-4). They differ in rounding only: our m update is a lerp, its a
    mul-add, and its C quantizer misses the nearest code on ~3 % of v's elements (ours is exact: the
    reference test); the errors stay ~1e-6 (~1e-4 relative), while a wrong map, block or bias
    correction moves parameters by ~lr = 1e-3."""
    import bitsandbytes as bnb  # a dev dependency: the reference, never skipped

    gen = torch.Generator().manual_seed(cols)
    p0 = torch.randn(1024, cols, generator=gen) * 0.1
    ref = torch.nn.Parameter(p0.clone())
    ref_opt = bnb.optim.AdamW8bit([ref], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    hyper = C.AdamWHyper(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    ours, mom = p0.clone().view(-1), C.init_moments(formats.MomentsFormat("int8"), p0.numel())
    for step in range(50):
        g = torch.randn(1024, cols, generator=gen) * 0.01
        ref.grad = g.clone()
        ref_opt.step()
        C.adamw_piece_(g.view(-1), ours, mom, hyper, step, 1e-3)
        err = (ours.view_as(p0) - ref.detach()).abs_()  # in place: 4M elements a step at 4097
        assert err.mean() <= 6e-5
        assert err.div_(ref.detach().abs().add_(1e-9)).mean() <= 6e-4
        if step % 10 == 0 and step > 0:
            state = ref_opt.state[ref]
            ours.copy_(ref.detach().view(-1))
            for x, name in zip(mom, ("state1", "absmax1", "state2", "absmax2"), strict=True):
                x.copy_(state[name].view(-1))


@pytest.mark.parametrize("moments", ["int8", "bf16"])
def test_the_torch_compile_twin_equals_the_reference_where_no_compiler_builds_the_kernels(
    moments, monkeypatch
):
    """Without a C compiler the update runs ``compressed``'s ``torch.compile``d twins: the same
    bits."""
    monkeypatch.setattr(C.native, "library", lambda: None)
    n = 1024
    p0, grads = _data(n, 2, seed=5)
    ours, mom = _master("remainder", p0), C.init_moments(formats.MomentsFormat(moments), n)
    ref_p, ref_m = join(*ours).clone(), C.init_moments(formats.MomentsFormat(moments), n)
    decayed = torch.ones(n, dtype=torch.bool)
    for step, g in enumerate(grads):
        C.adamw_piece_(g, ours, mom, HYPER, step, 1e-2, element_offset=256, unit_seed=2)
        ref_p, ref_m = ref_update(g, ref_p, ref_m, step, 1e-2, decayed, offset=256, unit_seed=2)
        _same(mom, ref_m)
        assert torch.equal(_bits(join(*ours)), _bits(ref_p))


def _hard_values(signed: bool) -> torch.Tensor:
    """Blocks of 256 whose absmax is 1 (each block starts with 1.0, so the scale is exact): every
    midpoint of the map, its fp32 neighbours, both signs, ±0, ±1, values around the tables' shared
    low prefix (2^-23) and random ones; the nearest code must be ``torch.bucketize``'s at each."""
    mids = codebook.bounds(formats.dynamic_map(signed))[:-1]
    inf = torch.tensor(float("inf"))
    near = torch.cat([mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf)])
    tiny = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0**-23, 2.0**-23 * 1.01, 1e-30, 5e-8])
    values = torch.cat(
        [near, -near, tiny, -tiny, torch.randn(2000, generator=torch.Generator().manual_seed(3))]
    )
    per_block = 255
    values = (
        torch.cat([values, torch.zeros(-values.numel() % per_block)])
        .view(-1, per_block)
        .clamp(-1, 1)
    )
    return torch.cat([torch.ones(values.shape[0], 1), values], dim=1).reshape(-1)


@pytest.mark.parametrize("signed", [True, False], ids=["m", "v"])
def test_quantize_is_the_nearest_code_at_every_midpoint(signed):
    """``compressed.quantize`` (the update's encode) against the reference's ``bucketize`` at the
    values where a table lookup could go wrong; ``dequantize`` reads the codes back as the update
    does."""
    x = _hard_values(signed)
    code = formats.dynamic_map(signed)
    codes, absmax = C.quantize(x, signed)
    ref_codes, ref_absmax = ref_quantize(x, code)
    assert torch.equal(codes, ref_codes) and torch.equal(absmax, ref_absmax)
    assert torch.equal(
        _bits(C.dequantize(codes, absmax, signed)), _bits(ref_dequantize(codes, absmax, code))
    )


# the paths of other CPUs, by the instruction sets left out: AVX-512 without VBMI (the moments
# decoded by gathers), AVX2, scalar
PORTABLE = {
    "avx512_gather": ("-mno-avx512vbmi",),
    "avx2": ("-mno-avx512f",),
    "scalar": ("-mno-avx512f", "-mno-avx2"),
}


@pytest.mark.parametrize("without", PORTABLE.values(), ids=PORTABLE.keys())
def test_the_portable_loops_equal_the_avx512_ones(monkeypatch, without):
    """The kernels built for the paths other CPUs run (``PORTABLE``) give the same bits, for the
    update of every master and the quantizer."""
    portable = C.native.load((*C.native.FLAGS, *without))
    assert portable is not None and C.native.library() is not None
    n = 4096
    p0, grads = _data(n, 3, seed=9)
    decay = DecaySpans(((300, 2000),), n)
    results = []
    for lib in (C.native.library(), portable):
        monkeypatch.setattr(C.native, "library", lambda lib=lib: lib)
        out = [C.quantize(_hard_values(True), True), C.quantize(_hard_values(False), False)]
        for master in ("fp32", "remainder"):
            ours, mom = _master(master, p0), C.init_moments(formats.MomentsFormat("int8"), n)
            copy16 = torch.empty(n, dtype=torch.bfloat16) if master == "fp32" else None
            for step, g in enumerate(grads):
                C.adamw_piece_(g, ours, mom, HYPER, step, 1e-2, copy16=copy16, decay=decay)
            out += [ours, mom, copy16 if copy16 is not None else ours.param]
        results.append(out)
    for a, b in zip(*results, strict=True):
        _same(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,))


@pytest.mark.parametrize("moments", ["int8", "bf16"])
@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_a_gradient_in_spans_gives_the_bits_of_the_gathered_gradient(moments, master):
    """A piece's gradient as leaf spans (long ones read where they lie, cut to their whole blocks;
    short ones, gaps and the blocks a span covers in part gathered) updates the piece bit for bit as
    the one tensor they make, zeros in the gaps (the kernels' results do not depend on where runs of
    whole blocks are cut: test_pieces_of_any_block_multiple_give_the_same_bits)."""
    n, lo = 256 * 1024, 4096
    p0, (g,) = _data(n, 1, seed=3)
    cuts = [(0, 70_000), (70_400, 170_400), (170_400, 170_700), (171_000, 250_000)]
    gathered = torch.zeros(n)
    for a, b in cuts:
        gathered[a:b] = g[a:b]
    spans = [(a, g[a:b].clone()) for a, b in cuts]
    decay = DecaySpans(((0, 50_000), (100_000, n + lo)), n + lo)
    opt = zf.adamw(lr=1e-2, moments=moments)
    where = Compressed(element_offset=lo, unit_seed=5, moments=moments)
    results = []
    for grad_spans in (spans, [(0, gathered)]):
        state, mom = _master(master, p0), C.init_moments(formats.MomentsFormat(moments), n)
        for step in range(2):
            update_piece_(opt, grad_spans, state, tuple(mom), step, decay, lo, where)
        results.append((state, mom))
    _same(results[0][1], results[1][1])
    _same([_fp32(results[0][0])], [_fp32(results[1][0])])
