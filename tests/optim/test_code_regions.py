"""The int8 encode's arithmetic path (``optim.code_regions``): its count of midpoints equals
``torch.bucketize``'s wherever it answers, its tables' check rejects tables that would miscount,
and the AVX-512 kernel that runs it writes the nearest-code table's codes."""

import pytest
import torch

from zinf_fn.formats import codebook
from zinf_fn.native import cpu_flags
from zinf_fn.optim import code_regions, formats
from zinf_fn.optim import compressed as C

MAPS = {"m": True, "v": False}


def _map(signed: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    code = formats.dynamic_map(signed)
    return code, codebook.bounds(code), int((code < 0).sum())


def _neighbours(x: torch.Tensor, ulps: int) -> torch.Tensor:
    """Every fp32 value within ``ulps`` of each of ``x`` (>= 0), x included."""
    bits = x.view(torch.int32).long()[:, None] + torch.arange(-ulps, ulps + 1)
    return bits.clamp(min=0).to(torch.int32).view(torch.float32).reshape(-1)


def _hard(bounds: torch.Tensor, zero: int, tables: torch.Tensor) -> torch.Tensor:
    """Values in [0, 2) where a count could go wrong: around every midpoint above 0, every
    region's upper midpoint and every binade's edge (64 fp32 steps either side), 0, the smallest
    values, and log-uniform ones from 1e-12 to 2."""
    mids = bounds[zero:-1]
    edges = torch.tensor([2.0**e for e in range(-40, 1)])
    enter = code_regions.fields(tables)["enter"]
    gen = torch.Generator().manual_seed(0)
    spread = 10 ** (torch.rand(1_000_000, generator=gen) * 12.3 - 12)
    near = _neighbours(torch.cat([mids[mids.isfinite()], enter[enter.isfinite()], edges]), 64)
    small = torch.tensor([0.0, 1e-45, 1e-38, 2.0**-126, 1.0, 1.5, 1.9999999])
    return torch.cat([near, small, spread]).clamp(max=1.9999999)


@pytest.mark.parametrize("signed", MAPS.values(), ids=MAPS.keys())
def test_the_count_is_bucketizes_wherever_it_answers(signed):
    """For every hard value, ``fast_count`` is the number of midpoints in (0, a) unless it says the
    value is near a midpoint; it says so of few (the table's share of the kernel's work)."""
    code, bounds, zero = _map(signed)
    tables = code_regions.region_tables(code, bounds)
    a = _hard(bounds, zero, tables)
    count, near = code_regions.fast_count(a, tables)
    want = torch.bucketize(a, bounds[:-1]) - zero
    assert bool((count == want)[~near].all())
    # the log-uniform values (the last million): near a midpoint about 1 in 2,000 (2 x NEAR)
    assert float(near[-1_000_000:].float().mean()) < 1e-3


@pytest.mark.parametrize("signed", MAPS.values(), ids=MAPS.keys())
def test_tables_that_would_miscount_are_refused(signed):
    """The check at build refuses a region whose spacing is off by 0.1 %, or a region's upper
    midpoint moved into the binade of the next one's."""
    code, bounds, _ = _map(signed)
    tables = code_regions.region_tables(code, bounds)
    fields = code_regions.fields(tables)
    mids, starts, ends = code_regions.layout(code, bounds)
    inv = fields["inv"]
    steep = tables.clone()
    code_regions.fields(steep)["inv"][:] = inv * torch.where(inv > 0, 1.001, 1.0)
    with pytest.raises(AssertionError, match="miscounts"):
        code_regions.check(steep, mids, starts, ends)
    shifted = tables.clone()
    enter = code_regions.fields(shifted)["enter"]
    enter[2] = enter[3]  # two upper midpoints in one binade
    with pytest.raises(AssertionError, match="binade"):
        code_regions.check(shifted, mids, starts, ends)


def _every_value_in(lo: float, hi: float) -> torch.Tensor:
    """Every fp32 value in [lo, hi), lo and hi >= 0."""
    a, b = (torch.tensor(v).view(torch.int32).item() for v in (lo, hi))
    return torch.arange(a, b, dtype=torch.int32).view(torch.float32)


def _table_only():
    """A build that looks every code up in the nearest-code table: without AVX-512 where this CPU
    has it (its build encodes arithmetically), else the scalar build (AVX2 reads the table by its
    own loads)."""
    native = C.native
    avx512 = "avx512f" in cpu_flags().split()
    lib = native.load((*native.FLAGS, "-mno-avx512f", *(() if avx512 else ("-mno-avx2",))))
    assert lib is not None and native.library() is not None
    return lib


def _both(monkeypatch, x: torch.Tensor, signed: bool) -> tuple:
    """``C.quantize(x, signed)`` by this CPU's kernel, then by ``_table_only``'s."""
    got, table_only = C.quantize(x, signed), _table_only()
    monkeypatch.setattr(C.native, "library", lambda: table_only)
    return got, C.quantize(x, signed)


@pytest.mark.parametrize("signed", MAPS.values(), ids=MAPS.keys())
def test_odd_blocks_take_the_tables_codes(monkeypatch, signed):
    """Blocks whose scaled values leave [-1, 1] or are not numbers (an infinite or NaN moment makes
    its block's scale 0 or 1e38): the kernel's codes are the table's."""
    nan, inf = float("nan"), float("inf")
    odd = [inf, -inf, nan, -nan, 3.0, -3.0, 1e-45, -1e-45, 0.0, -0.0, 0.5, -0.25]
    gen = torch.Generator().manual_seed(4)
    blocks = []
    for lead in ([inf], [nan], [-inf, nan], [1e30], []):
        tail = torch.randn(256 - len(lead) - len(odd), generator=gen).tolist()
        blocks.append(torch.tensor(lead + odd + tail))
    got, want = _both(monkeypatch, torch.cat(blocks), signed)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))


@pytest.mark.parametrize("signed", MAPS.values(), ids=MAPS.keys())
def test_the_kernel_writes_the_tables_codes(monkeypatch, signed):
    """The kernel built for this CPU quantizes to the codes of a build that looks every code up in
    the nearest-code table, at every fp32 value of the densest region's top binade [0.5, 1) and the
    hard values, both signs (each block of 256 leads with 1.0, so the values are encoded as they
    are): with AVX-512 (the arithmetic encode) against the build without it, else (the table read
    by AVX2's loads) against the scalar build."""
    code, bounds, zero = _map(signed)
    hard = _hard(bounds, zero, code_regions.region_tables(code, bounds)).clamp(max=1.0)
    x = torch.cat([_every_value_in(0.5, 1.0), hard])
    x = torch.cat([x, -x])
    x = torch.cat([x, torch.zeros(-x.numel() % 255)]).view(-1, 255)
    x = torch.cat([torch.ones(x.shape[0], 1), x], dim=1).reshape(-1)
    got, want = _both(monkeypatch, x, signed)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
