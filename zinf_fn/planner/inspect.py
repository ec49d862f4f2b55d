"""Looking at a state from outside a step: the full parameter trees, and the printed fetch plan."""

from __future__ import annotations

import torch

from ..config import spill_of
from ..model import with_ties
from ..overlap.plan import train_plan
from ..tiling.layout import assemble
from ..tiling.plan import format_plan_with_tiles
from ..tree import unflatten
from ..units import BLOCKS, EMBED, HEAD, head_index, key, units


def gather_params(state, kind: str = "master") -> dict:
    """Full parameter trees ``{"embed": tree, "blocks": [tree, ...], "head": tree}`` on the CPU, in fp32.

    ``kind`` is "master" (the optimizer's fp32 copy) or "param" (the stored 16-bit copy, upcast).
    A tiled weight comes back as the ``RowTiles``/``ColTiles`` node its ``init`` returned. A tied weight
    (``zf.Model.ties``) is stored once, in the embedding, and comes back in both places: the head's tree
    holds the embed tree's tensor itself at the tie's head path.
    Collective: every rank must call it. Materialises the whole model: for tests, export and sampling
    of models that fit in memory.
    """
    if kind not in ("master", "param"):
        raise ValueError(f"gather_params: kind must be 'master' or 'param', got {kind!r}")
    runtime = state.runtime
    out = {EMBED: None, BLOCKS: [], HEAD: None}
    for unit in units(runtime.model.n_layers):
        rest = unflatten(gather_row(runtime, kind, unit), runtime.store.group_of(unit).spec)
        tree = assemble(runtime.tiles.layout, unit, rest, lambda tile: gather_row(runtime, kind, tile))
        if unit.group == BLOCKS:
            out[BLOCKS].append(tree)
        else:
            out[unit.group] = tree
    out[HEAD] = with_ties(runtime.model.ties, out[HEAD], out[EMBED])
    return out


def gather_row(runtime, kind: str, unit) -> torch.Tensor:
    """One row of a group (a unit or a tile), gathered over ranks: a flat fp32 CPU tensor (padding cut).
    Collective: every rank calls it for the same row."""
    store, sharding = runtime.store, runtime.sharding
    tier, group = store.tier_of(kind), store.group_of(unit)
    dtype = store.param_dtype if kind == "param" else torch.float32
    shard = None
    if sharding.holds(unit):
        shard = torch.empty(group.part.shard_numel, dtype=dtype, device=tier.device)
        tier.read_(key(unit.group, kind), unit.row, shard).result()   # sync: shard read
    full = torch.empty(group.part.padded_numel, dtype=dtype, device=tier.device)
    sharding.gather_(full, shard, unit)   # sync: every rank's part has arrived
    return full[: group.spec.numel].to("cpu", torch.float32).clone()


def plan(state) -> str:
    """Where each state kind lives (with its split), then the fetch plan of one training step, one line
    per fetch, as the prefetcher will run it.

    Units with tiled leaves list their tile fetches (each tile its own fetch) under them, each stage's
    leaves in the order its ``apply`` uses them once a step has run (tree order before).
    """
    runtime = state.runtime
    fetches = format_plan_with_tiles(runtime.tiles.layout, train_plan(units(state.model.n_layers)),
                                     state.config.prefetch_depth, state.config.grad_accum)
    return placements(state.config, state.model.n_layers) + "\n" + fetches


def placements(config, n_layers: int) -> str:
    """One line per state kind: "optimizer: cpu+nvme (units 0..1 in cpu, 2..4 in nvme)" or "params: none"."""
    last, lines = head_index(n_layers), []
    for kind in ("params", "optimizer"):
        placement, spill = getattr(config, f"offload_{kind}"), spill_of(config, kind)
        if spill is None or spill[0] > last:
            lines.append(f"{kind}: {placement}")
            continue
        first, slow = spill
        fast_units = f"units 0..{first - 1} in {placement}, " if first else ""
        lines.append(f"{kind}: {placement}+{slow} ({fast_units}{first}..{last} in {slow})")
    return "\n".join(lines)
