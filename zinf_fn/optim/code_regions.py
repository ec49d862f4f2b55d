"""The tables of the int8 encode's arithmetic path (``native_chunks``' AVX-512 ``code_fast``): the
nearest code of a scaled moment y without a table lookup, wherever y is not within ``NEAR`` of a
midpoint of the map (there the nearest-code table decides, ``native.code_luts``).

A dynamic map's codes of one sign fall in regions of evenly spaced codes: 0, one region per decade
(2^i codes in 10^(i-7)..10^(i-6) for m's map, 2^(i+1) for v's) and 1.0. For |y| = a, the number of
the map's midpoints between 0 and a (its code, counted from the code of 0) is

    min(floor(a * inv[r] - k[r]), top[r])

where r is a's region: ``region[b]`` (the region of the smallest value of a's binade b: its fp32
exponent less ``BINADE_LO``, 0 below) plus one where a lies above ``enter[region[b]]`` (the
midpoint between that region and the next: each binade holds at most one, checked here).
``w = a * inv - k`` places a on the region's even spacing, its codes at halves and its midpoints
at integers (the count of the midpoints below the region's first code, plus the index), so away
from an integer its floor counts the midpoints below a; ``top`` is the count at the region's last
code, which a reaches before the region's upper midpoint. The fp32 products stray from the
midpoints' exact places by the codes' own rounding; where w lies within ``NEAR`` of an integer the
kernel takes the table instead. ``check`` proves the tables against every midpoint: as w is
monotone in a (fp32 rounding is), w at a midpoint and at the next fp32 value above it bound w on
either side of it, so a floor taken outside the ``NEAR`` band is the count of midpoints below a.

For y < 0 on m's map (whose negative codes mirror the positive ones, less 1.0's) the code is 127
less the count of midpoints <= a: the same formula at the next fp32 value above a.
"""

from __future__ import annotations

import math

import torch

BINADE_LO = 96  # a's binade: its fp32 exponent less this, 0 below (binade 31 is [1, 2))
# w this close to an integer: the table decides (``native_source`` writes it into the kernel)
NEAR = 2.0**-12
# a map's words: region (32, int32), then enter, inv, k (16 each, fp32), top (16, int32), at these
# offsets (the kernel's too: ``native_source`` writes them in); the regions past the map's padded
# (enter +inf, inv 0)
OFFSETS = {"region": 0, "enter": 32, "inv": 48, "k": 64, "top": 80}
WORDS = 32 + 4 * 16
FLOATS = ("enter", "inv", "k")  # the fields of fp32 words


def layout(code: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, list, list]:
    """(the midpoints above 0 (fp32), each region's first and past-last code) of the sorted map
    ``code`` with its midpoints ``bounds`` (``formats.codebook.bounds``), its codes counted from
    the code of 0: a region is the codes of one decade, 0 and 1.0 each one of their own."""
    zero = int((code < 0).sum())
    assert float(code[zero]) == 0.0, "a map holds its code 0.0 after its negative codes"
    decade = [math.floor(math.log10(c)) if c > 0 else -99 for c in code[zero:].tolist()]
    starts = [i for i in range(len(decade)) if i == 0 or decade[i] != decade[i - 1]]
    assert len(starts) <= 16, "a map of more than 16 regions"
    return bounds[zero : code.numel() - 1], starts, [*starts[1:], len(decade)]


def region_tables(code: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """int32 (``WORDS``,): the arithmetic encode's tables of the sorted map ``code`` with its
    midpoints ``bounds``, as int32 bits; checked (``check``) before they are returned."""
    mids, starts, ends = layout(code, bounds)
    pos = code[int((code < 0).sum()) :].double()  # 0, then the positive codes
    enter, inv, k, top = [float("inf")] * 16, [0.0] * 16, [-0.5] * 16, [0] * 16
    for r, (s, e) in enumerate(zip(starts, ends, strict=True)):
        top[r], k[r] = e - 1, -0.5 - s
        if e < pos.numel():
            enter[r] = float(mids[e - 1])  # between the region's last code and the next's first
        if e - s > 1:
            inv[r] = (e - 1 - s) / float(pos[e - 1] - pos[s])
            k[r] = float(torch.tensor(float(pos[s]) * inv[r], dtype=torch.float32)) - 0.5 - s
    region = [_region_of(2.0 ** (b + BINADE_LO - 127) if b else 0.0, enter) for b in range(32)]
    tables = torch.cat(
        [
            torch.tensor(region, dtype=torch.int32),
            torch.tensor(enter + inv + k, dtype=torch.float32).view(torch.int32),
            torch.tensor(top, dtype=torch.int32),
        ]
    )
    check(tables, mids, starts, ends)
    return tables


def _region_of(a: float, enter: list[float]) -> int:
    """The region of a >= 0: the number of regions' upper midpoints below it."""
    return sum(t < a for t in enter)


def fields(tables: torch.Tensor) -> dict[str, torch.Tensor]:
    """``region_tables``' words by name, in their dtypes."""
    ends = [*list(OFFSETS.values())[1:], WORDS]
    out = {name: tables[at:end] for (name, at), end in zip(OFFSETS.items(), ends, strict=True)}
    return {k: v.view(torch.float32) if k in FLOATS else v for k, v in out.items()}


def _place(a: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(region, w = a * inv - k) of fp32 a in [0, 2), as the kernel computes them."""
    t = fields(tables)
    binade = ((a.view(torch.int32) >> 23) - BINADE_LO).clamp(min=0)
    r = t["region"][binade].long()
    r = r + (a > t["enter"][r]).long()
    return r, a * t["inv"][r] - t["k"][r]


def fast_count(a: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count of midpoints in (0, a), near) for fp32 a in [0, 2), as the kernel computes them;
    ``near``: within ``NEAR`` of a midpoint's place, where the count is the table's, not this."""
    r, w = _place(a, tables)
    near = (w - torch.round(w)).abs() < NEAR
    return torch.minimum(torch.floor(w).long(), fields(tables)["top"][r].long()), near


def check(tables: torch.Tensor, mids: torch.Tensor, starts: list, ends: list) -> None:
    """The tables count right wherever the kernel takes their count (the module's docstring): each
    binade holds at most one region's upper midpoint; at the i-th midpoint above 0 within a region,
    w lies below i + NEAR and w at the next fp32 value above it above i - NEAR (so, w being
    monotone, a floor taken outside the band is i - 1 at or below the midpoint, i above it); and a
    region's smallest values have w above its first count less NEAR."""
    t, up = fields(tables), torch.tensor(float("inf"))
    lows = torch.tensor([2.0 ** (b + BINADE_LO - 127) for b in range(1, 32)] + [2.0])
    edges = torch.bucketize(t["enter"][t["enter"] < 2.0], lows, right=True)
    assert edges.unique().numel() == edges.numel(), "a binade holds two regions' upper midpoints"
    for r, (s, e) in enumerate(zip(starts, ends, strict=True)):
        at = mids[s : e - 1]
        past = torch.arange(s + 1, e, dtype=torch.float32)  # the count just above each midpoint
        lowest = torch.nextafter(mids[s - 1 : s], up) if s else torch.zeros(1)
        for a, ok in (
            (at, lambda w, past=past: w < past + NEAR),
            (torch.nextafter(at, up), lambda w, past=past: w > past - NEAR),
            (lowest, lambda w, s=s: w > s - NEAR),
        ):
            where, w = _place(a, tables)
            assert bool((where == r).all()) and bool(ok(w).all()), f"region {r} miscounts"
