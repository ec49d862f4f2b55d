"""What a state's engine has moved and holds now: ``Counters``
(``zinf_fn.state.StateView.counters``), read from the runtime's parts. The one place the state
interface reaches the runtime's internals for them."""

from __future__ import annotations

from typing import NamedTuple

from ..offload.nvme import NvmeTier
from ..planner.memory import members


class Counters(NamedTuple):
    """What a state's engine has moved and holds now (``StateView.counters``): read between steps.

    ``tiers``: role -> that tier's cumulative counters ("bytes_read", "bytes_written", and the NVMe
    tier's "bytes_read_inflight", "bytes_read_resident"; a split tier adds each member's as
    "<member>.<counter>"). The roles are "param" (kind "param"), "optimizer" (every other kind) and,
    with offloaded activations, "activations". A step's metrics report the differences of these over
    the step.
    """

    tiers: dict[str, dict[str, int]]
    # staging buffers handed out and not yet given back (the held layers' included)
    pool_out: int
    pool_peak_out: int  # the most out at once since init
    # buffers the pool has made (the step metrics' "buffers"): at init, its plan
    pool_made: int
    # their bytes (``planner.memory.pool_plan``'s while no part holds more than it declared)
    pool_bytes: int
    write_behind_buffers: int  # pool buffers the write-behind still holds (written or in flight)
    live_layers: int  # fetched units and tiles not yet released
    peak_live_layers: int  # the most materialised at once since init
    # layers the fetcher keeps from their first fetch on (``optim.passes.holds_layer``)
    held_layers: int
    # the pool buffers those keep out (``Fetcher.held_buffers``: two for a row that lends codes)
    held_buffers: int
    leaf_grads: bool  # the last step handed unit gradients to the update as their leaves


def read(runtime) -> Counters:
    """The tiers' byte counters, the buffer pool, the write-behind and the fetcher of ``runtime``,
    as they are now."""
    pool, fetcher = runtime.pool, runtime.fetcher
    return Counters(
        tiers={role: tier.counters() for role, tier in _tiers(runtime).items()},
        pool_out=pool.out,
        pool_peak_out=pool.peak_out,
        pool_made=pool.count,
        pool_bytes=pool.bytes_made,
        write_behind_buffers=runtime.updater.writes.buffers_held,
        live_layers=fetcher.live,
        peak_live_layers=fetcher.peak_live,
        held_layers=fetcher.held,
        held_buffers=fetcher.held_buffers,
        leaf_grads=runtime.driver.last["leaf_grads"],
    )


def idle_buffers(runtime) -> list:
    """The staging buffers ``runtime``'s pool holds idle now (a snapshot)."""
    return runtime.pool.idle()


def _tiers(runtime) -> dict:
    """role -> tier: the state kinds' two tiers and, where activations are offloaded, theirs."""
    tiers = {"param": runtime.store.param_tier, "optimizer": runtime.store.opt_tier}
    if runtime.checkpoints is not None:
        tiers["activations"] = runtime.checkpoints.tier
    return tiers


def nvme_engine(tier) -> str | None:
    """The engine of the first NVMe member of ``tier`` (a split or broadcast-mode tier wraps its
    members)."""
    return next((m.engine for m in members(tier) if isinstance(m, NvmeTier)), None)
