"""Looking at a state from outside a step: where its states live, and the printed fetch plan (the
full parameter trees are ``zinf_fn.state.gather_params``)."""

from __future__ import annotations

from ..config import spill_of
from ..layout.policy import describe
from ..layout.units import head_index, units
from ..overlap.plan import step_plan
from ..tiling.plan import format_plan_with_tiles


def plan(state) -> str:
    """Where each state kind lives (with its split), then the fetch plan of one training step, one
    line per fetch, as the prefetcher will run it, with the events its entries start
    (``overlap.plan.step_plan``).

    Where anything is frozen, a line says which units are (``zinf_fn.formats.frozen``: wholly, or
    some of their leaves); where a group's rows are read otherwise than plainly, its read policy
    (``zinf_fn.layout.policy``) follows. Units with tiled leaves list their tile fetches (each tile
    its own fetch) under them, each stage's leaves in the order its ``apply`` uses them once a step
    has run (tree order before).
    """
    runtime = state.runtime
    config = state.config
    depth = config.prefetch_depth
    clipping = config.clip_grad_norm is not None
    embed_trains = runtime.frozen.embed_trains()
    all_units = units(state.model.n_layers)
    fetch_plan = step_plan(all_units, embed_trains, runtime.reuse, depth, clipping)
    fetches = format_plan_with_tiles(runtime.tiles.layout, fetch_plan, depth, config.grad_accum)
    # only where something is frozen
    frozen = [runtime.frozen.describe()] if runtime.frozen else []
    # zinf_fn.layout.policy: only where a group is read otherwise than plainly
    policy = describe(runtime.store.row_kinds.policies)
    head = [placements(state.config, state.model.n_layers), formats(runtime.store), *frozen]
    return "\n".join([*head, *([policy] if policy else []), fetches])


def formats(store) -> str:
    """One line of the stored formats of the state kinds: "formats: master fp32; moments fp32", or
    e.g. "formats: master remainder (int16 rows beside the bf16 params); moments int8 (uint8 codes
    "opt.<i>", an fp32 absmax per 256 elements "opt.<i>.absmax") in blocks, fp32 in embed, head"."""
    master = (
        "remainder (int16 rows beside the bf16 params)" if store.row_kinds.remainder else "fp32"
    )
    if store.row_kinds.ties_away and not store.row_kinds.remainder:
        master += " (16-bit copy rounded ties away)"
    packed = [g for g in store.groups if g in store.row_kinds.compressed]
    plain = [g for g in store.groups if g not in store.row_kinds.compressed]
    moments = (
        "fp32"
        if not packed
        else f"{_moments_name(store)} in {', '.join(packed)}"
        + (f", fp32 in {', '.join(plain)}" if plain else "")
    )
    return f"formats: master {master}; moments {moments}"


def _moments_name(store) -> str:
    """The compressed moments' format as ``formats`` prints it: its rows' dtypes and, for int8, its
    scale rows."""
    if store.row_kinds.moments == "int8":
        codes = 'uint8 codes "opt.<i>"'
        return (
            f'int8 ({codes}, an fp32 absmax per {store.row_kinds.block} elements "opt.<i>.absmax")'
        )
    return "bfloat16"


def placements(config, n_layers: int) -> str:
    """One line per state kind: "optimizer: cpu+nvme (units 0..1 in cpu, 2..4 in nvme)" or "params:
    none"."""
    last, lines = head_index(n_layers), []
    for kind in ("params", "optimizer"):
        placement, spill = config.placement(kind), spill_of(config, kind)
        if spill is None or spill[0] > last:
            lines.append(f"{kind}: {placement}")
            continue
        first, slow = spill
        fast_units = f"units 0..{first - 1} in {placement}, " if first else ""
        lines.append(f"{kind}: {placement}+{slow} ({fast_units}{first}..{last} in {slow})")
    return "\n".join(lines)
