"""What the planner counts of a mixture of experts whose experts are fetch units.

A block that streams its experts (``layers.moe.Config(stream_experts=True)``) declares each
stacked expert weight, ``(E, out, in)``, as ``E`` row tiles of ``(1, out, in)``: one tile per
expert, so the layout step makes every expert a unit of its own (a row of the weight's tile group,
``tiling.layout``) and the states, the fetch window and the tile plan already count it as a tile.
What a tile count does not know is routing: only the experts some token chose are fetched and
computed. Under uniform routing (each token's ``top_k`` experts a uniform draw of ``top_k`` of
``E``, which a trained router only approaches) the expected share of a layer's experts that
``T`` routed tokens of a micro-batch touch is

    share = 1 - (1 - top_k / E) ** T

so the expert rows' reads per step (forward, and the backward's refetch: for a frozen base, LoRA, an
expert no token chose is not read again) are ``share`` times what fetching every expert reads.
The planner scales the fetcher's reads of the expert groups by it (``with_experts``) and says so;
without ``top_k`` (or a batch) it assumes every expert is read, an upper bound. Expert tile groups
are the tile layout's leaves that say so (``TiledLeaf.experts``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..config import Config
from ..overlap.tile_runs import computing, store_window
from ..tiling.plan import TileReads, step_reads
from .memory import Estimate, sizing

if TYPE_CHECKING:  # type names only: the layout step is imported by whoever builds one
    from ..layout.build import Layout

MIB = float(1 << 20)


def touched_share(top_k: int, n_experts: int, tokens: int) -> float:
    """The expected share of a layer's ``n_experts`` that ``tokens`` routed tokens touch, each
    choosing ``top_k`` of them uniformly: ``1 - (1 - top_k / n_experts) ** tokens``."""
    if not 0 < top_k <= n_experts or tokens < 0:
        raise ValueError(f"touched_share: expected 0 < top_k <= n_experts and tokens >= 0, got "
                         f"top_k={top_k}, n_experts={n_experts}, tokens={tokens}")
    return 1.0 - (1.0 - top_k / n_experts) ** tokens


class Experts(NamedTuple):
    """The streamed experts of a layout, and what a step is expected to read of them (this rank)."""

    groups: tuple[str, ...]  # the expert leaves' tile groups ("blocks:mlp.experts.down.w")
    per_layer: int  # experts per layer (E)
    units: int  # expert units of the model: layers x E x expert leaves
    window: int  # expert tiles out at once: the window's runs + those computing, of fetch_run tiles
    window_bytes: int  # ... in the compute dtype, of the largest expert tile
    top_k: int | None
    tokens: int | None  # routed tokens of a micro-batch
    share: float  # expected share of a layer's experts touched per micro-batch (1.0: assumed all)
    reads: tuple[int, int]  # NVMe bytes of the expert rows a step reads (forward, backward), all
    #                         experts fetched; ``share`` of them are expected

    @property
    def expected_reads(self) -> tuple[int, int]:
        """The NVMe bytes of expert rows a step is expected to read: ``share`` x ``reads``."""
        return tuple(int(self.share * r) for r in self.reads)

    def row(self) -> str:
        """One line for the estimate's table."""
        missing = [name for name, v in (("top_k", self.top_k), ("batch", self.tokens)) if v is None]
        touched = (
            f"top-{self.top_k} of {self.per_layer}, {self.tokens} tokens per micro-batch: "
            f"{self.share:.1%} touched per layer (uniform-routing expectation)"
            if not missing
            else f"every expert read (no {' or '.join(missing)} given: an upper bound)"
        )
        return (
            f"experts: {self.units} units ({self.per_layer} per layer x {len(self.groups)} "
            f"leaves), {self.window} in flight ({self.window_bytes / MIB:.1f} MiB); {touched}; "
            f"expert NVMe reads {sum(self.expected_reads) / MIB:.1f} of "
            f"{sum(self.reads) / MIB:.1f} MiB per step"
        )


def count(layout: Layout, config: Config, top_k: int | None = None,
          tokens: int | None = None) -> Experts | None:
    """The ``Experts`` of ``layout`` (None where no tiled leaf is a stack of experts); ``tokens``:
    the routed tokens of one micro-batch; with ``top_k`` too, the expected share touched."""
    leaves = [leaf for stage in layout.tiles.leaves.values() for leaf in stage if leaf.experts]
    if not leaves:
        return None
    store = layout.store
    per_layer = max(leaf.n_tiles for leaf in leaves)
    run = max(store.row_kinds.policy(leaf.group).fetch_run for leaf in leaves)
    compute = config.resolved_compute_dtype()
    held = max(computing(store.row_kinds.policy(leaf.group)) for leaf in leaves)
    window = (store_window(store, compute, config.prefetch_depth) + held) * run
    tile = max(store.groups[leaf.group].part.padded_numel for leaf in leaves)
    known = top_k is not None and tokens is not None
    share = touched_share(top_k, per_layer, tokens) if known else 1.0
    by_group = _reads(layout, config)
    reads = [by_group.get(leaf.group, TileReads())[:2] for leaf in leaves]
    return Experts(
        tuple(leaf.group for leaf in leaves),
        per_layer,
        sum(layout.tiles.rows(leaf) for leaf in leaves),
        window,
        window * tile * compute.itemsize,
        top_k,
        tokens,
        share,
        (sum(f for f, _ in reads), sum(b for _, b in reads)),
    )


def _reads(layout: Layout, config: Config) -> dict[str, TileReads]:
    """Per tile group, the (forward, backward) NVMe bytes the fetcher reads of its param rows per
    step, every tile fetched as often as the tile plan fetches it (``tiling.plan.step_reads``)."""
    return step_reads(layout.tiles, layout.store, sizing(layout, config))


def with_experts(est: Estimate, experts: Experts | None) -> Estimate:
    """``est`` with its experts counted: its NVMe traffic less the expert reads a step is not
    expected to make (``Experts.expected_reads``), its table with the experts' line."""
    if experts is None:
        return est
    unread = sum(experts.reads) - sum(experts.expected_reads)
    moved = dict(est.moved)
    if unread:
        moved["nvme"] = moved["nvme"] - unread
    return est._replace(moved=moved, experts=experts)
