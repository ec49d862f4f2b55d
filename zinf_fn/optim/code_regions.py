"""The tables of the int8 encode's arithmetic path (``native_chunks``' AVX-512 ``code_fast``): the
nearest code of a scaled moment y without a table lookup, wherever y is not within ``NEAR`` of a
midpoint of the map (there the nearest-code table decides, ``native.code_luts``).

A dynamic map's codes of one sign fall in regions of evenly spaced codes: 0, one region per decade
(2^i codes in 10^(i-7)..10^(i-6) for m's map, 2^(i+1) for v's) and 1.0. For |y| = a, the number of
the map's midpoints between 0 and a (its code, counted from the code of 0) is

    base[r] + min(floor(a * inv[r] - k2[r]), nmax[r])

where r is a's region: ``region[b]`` (the region of the smallest value of a's binade b, its fp32
exponent less ``BINADE_LO``, clamped to 0..31) plus one where a lies above ``enter[region[b]]``
(the midpoint between that region and the next: each binade holds at most one, checked here).
``a * inv - k2`` is the region's codes' index (evenly spaced: codes at integers, midpoints at
halves) plus 0.5, so away from an integer its floor counts the region's midpoints below a. The
fp32 products stray from the midpoints' exact places by the codes' own rounding; where it lies
within ``NEAR`` of an integer the kernel takes the table instead. ``_check`` proves the tables
against every midpoint: as w = a * inv - k2 is monotone in a (fp32 rounding is), w at a midpoint
and at the next fp32 value above it bound w on either side of it, so a floor taken outside the
``NEAR`` band is the count of midpoints below a.

For y < 0 on m's map (whose negative codes mirror the positive ones, less 1.0's) the code is 127
less the count of midpoints <= a: the same formula at the next fp32 value above a.
"""

from __future__ import annotations

import math

import torch

BINADE_LO = 96  # a's binade: its fp32 exponent less this, clamped to 0..31 (binade 31 is [1, 2))
NEAR = 2.0**-12  # w this close to an integer: the table decides (native_chunks' NEAR)
# a map's words: region (32, int32), then enter, inv, k2 (16 each, fp32), base (16, int32), nmax
# (16, fp32): regions beyond the map's are padded (enter +inf)
WORDS = 32 + 5 * 16


def region_tables(code: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """int32 (``WORDS``,): the arithmetic encode's tables of the sorted map ``code`` with its
    midpoints ``bounds`` (``formats.codebook.bounds``), as int32 bits."""
    zero = int((code < 0).sum())
    assert float(code[zero]) == 0.0, "a map holds its code 0.0 after its negative codes"
    pos = code[zero:].double()  # 0, then the positive codes
    mids = bounds[zero : code.numel() - 1]  # the midpoints above 0, fp32
    decade = [math.floor(math.log10(c)) if c > 0 else -99 for c in pos.tolist()]
    starts = [i for i in range(len(decade)) if i == 0 or decade[i] != decade[i - 1]]
    ends = [*starts[1:], len(decade)]
    assert len(starts) <= 16, "a map of more than 16 regions"
    inf = float("inf")
    enter, inv, k2, base, nmax = [inf] * 16, [0.0] * 16, [-0.5] * 16, [0] * 16, [0.0] * 16
    for r, (s, e) in enumerate(zip(starts, ends, strict=True)):
        base[r], nmax[r] = s, float(e - 1 - s)
        if e < len(decade):
            enter[r] = float(mids[e - 1])  # between the region's last code and the next's first
        if e - s > 1:
            inv[r] = (e - 1 - s) / float(pos[e - 1] - pos[s])
            k2[r] = float(torch.tensor(float(pos[s]) * inv[r], dtype=torch.float32)) - 0.5
    region = [_region_of(2.0 ** (b + BINADE_LO - 127) if b else 0.0, enter) for b in range(32)]
    floats = torch.tensor(enter + inv + k2, dtype=torch.float32)
    tables = torch.cat(
        [
            torch.tensor(region, dtype=torch.int32),
            floats.view(torch.int32),
            torch.tensor(base, dtype=torch.int32),
            torch.tensor(nmax, dtype=torch.float32).view(torch.int32),
        ]
    )
    _check(tables, mids, starts, ends)
    return tables


def _region_of(a: float, enter: list[float]) -> int:
    """The region of a >= 0: the number of regions' upper midpoints below it."""
    return sum(t < a for t in enter)


def fields(tables: torch.Tensor) -> dict[str, torch.Tensor]:
    """``region_tables``' words by name, in their dtypes."""
    f = tables[32:].view(torch.float32)
    return {
        "region": tables[:32],
        "enter": f[:16],
        "inv": f[16:32],
        "k2": f[32:48],
        "base": tables[80:96],
        "nmax": f[64:80],
    }


def _place(a: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(region, w = a * inv - k2) of fp32 a in [0, 2), as the kernel computes them."""
    t = fields(tables)
    binade = ((a.view(torch.int32) >> 23) - BINADE_LO).clamp(0, 31)
    r = t["region"][binade].long()
    r = r + (a > t["enter"][r]).long()
    return r, a * t["inv"][r] - t["k2"][r]


def fast_count(a: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count of midpoints in (0, a), near) for fp32 a in [0, 2), as the kernel computes them;
    ``near``: within ``NEAR`` of a midpoint's place, where the count is the table's, not this."""
    t = fields(tables)
    r, w = _place(a, tables)
    f = torch.floor(w)
    near = ((w - f) < NEAR) | ((w - f) > 1 - NEAR)
    return t["base"][r] + torch.minimum(f, t["nmax"][r]).long(), near


def _check(tables: torch.Tensor, mids: torch.Tensor, starts: list, ends: list) -> None:
    """The tables count right wherever the kernel takes their count (the module's docstring): each
    binade holds at most one region's upper midpoint; at the j-th midpoint within a region, w lies
    below j + 1 + NEAR and w at the next fp32 value above it above j + 1 - NEAR (so, w being
    monotone, a floor taken outside the band is j at or below the midpoint, j + 1 above it); and a
    region's smallest values have w above -NEAR."""
    t, up = fields(tables), torch.tensor(float("inf"))
    lows = torch.tensor([2.0 ** (b + BINADE_LO - 127) for b in range(1, 32)] + [2.0])
    edges = torch.bucketize(t["enter"][t["enter"] < 2.0], lows, right=True)
    assert edges.unique().numel() == edges.numel(), "a binade holds two regions' upper midpoints"
    for r, (s, e) in enumerate(zip(starts, ends, strict=True)):
        at = mids[s : e - 1]
        past = torch.arange(1, e - s, dtype=torch.float32)  # the integer past each midpoint
        lowest = torch.nextafter(mids[s - 1 : s], up) if s else torch.zeros(1)
        for a, ok in (
            (at, lambda w, past=past: w < past + NEAR),
            (torch.nextafter(at, up), lambda w, past=past: w > past - NEAR),
            (lowest, lambda w: w > -NEAR),
        ):
            where, w = _place(a, tables)
            assert bool((where == r).all()) and bool(ok(w).all()), f"region {r} miscounts"
