"""The model's own compute time: one micro-batch through one layer of each stage, timed at the real
shapes.

A generic FLOP/s figure (a square matmul) misses what a block does besides its matmuls (attention,
norms, activations, the autograd bookkeeping of the recorded forward and the partial recompute of
the backward) and, on a loaded machine, the machine's speed *now*. So the planner times the kernels
a training step runs, on the compute device and in the compute dtype, with the first unit of each
group's initial tree (one layer, never the model):

    embed     forward under no_grad, then ``scan.embed_vjp`` (its recompute and pull-back)
    block     ``scan.block_record`` (the training forward: graph recorded, activations dropped),
              then the tape's ``pull_back`` (the partial recompute and the vjp)
    head      ``scan.head_vjp`` (forward and backward; the head is never recomputed)

the same functions ``scan.loops`` calls. A tiled weight whose codes the engine lends to its op
(``GroupPolicy.codes_lent``: a frozen NF4 expert) is held as those codes (``lent_tiles``), so its
products are timed as the step runs them, by the fused kernel, not on decoded weights; one lent in
its stored dtype (``GroupPolicy.lent_as``: a frozen bf16 head) is held in that dtype. A step of L
blocks and k micro-batches then computes ``k * (embed + L * block + head)`` seconds
(``StageSeconds.forward`` / ``.backward``).

The timing runs beside a worker thread that has run a torch op (``engine_threads``), as a step's
compute runs beside the engine's gather and update workers. It matters on a loaded CPU: torch's
OpenMP runtime on Linux (libgomp) spins ~300k iterations before a waiting thread sleeps, unless the
process's OpenMP threads outnumber its cores (then ~1k); a planner's process without the workers
would spin, and on a shared 2-core machine timed the same layer 3-5x slower than a step ran it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import optree
import torch

from ..formats.codebook import Decode
from ..formats.nf4_linear import CodedMatrix, LentLeaves, encode_lent, lent_apply
from ..layout.units import BLOCKS, EMBED, HEAD, STAGES
from ..model import block_apply
from ..scan.blocks import block_record, embed_vjp, head_vjp
from ..tiling.held import held
from ..tiling.layout import split_tiled

TRIALS = 3  # timed runs of each stage after a warm-up; the median is kept
# a stage whose warm-up took longer is timed once (a big layer on a CPU: seconds each)
SLOW_S = 0.25


class StageSeconds(NamedTuple):
    """Seconds of one micro-batch through one unit of each stage, as a training step runs it."""

    embed_forward: float
    block_forward: float  # the recorded forward (``block_record``)
    head: float  # forward and backward (``head_vjp``)
    block_backward: float  # the tape's pull-back: partial recompute and vjp
    embed_backward: float

    def forward(self, n_blocks: int, micro_batches: int = 1) -> float:
        """Seconds of a step's forward scan (the embedding and every block over every
        micro-batch)."""
        return micro_batches * (self.embed_forward + n_blocks * self.block_forward)

    def backward(self, n_blocks: int, micro_batches: int = 1) -> float:
        """Seconds of a step's head and reverse scan."""
        return micro_batches * (self.head + n_blocks * self.block_backward + self.embed_backward)


def time_stages(
    model,
    embed: Any,
    block: Any,
    head: Any,
    micro: Any,
    device: torch.device,
    lent: Mapping[str, Mapping[str, Decode | torch.dtype]] | None = None,
    frozen: Mapping[str, tuple[int, ...]] | None = None,
    block_lent: LentLeaves | None = None,
) -> StageSeconds:
    """Time ``model``'s stages on one micro-batch ``micro`` with the unit trees ``embed``,
    ``block``, ``head`` (in the compute dtype; ``head`` with its tied leaves, as
    ``scan.loops.head_params`` gives it) on ``device``: seconds per unit and micro-batch, each the
    median of ``TRIALS`` runs after a warm-up. A tiled weight is applied through a
    ``tiling.held.HeldTiles``, the engine's path of a tiled op; ``lent`` (by stage, then the
    weight's key path) names those the engine lends to their ops as stored, and how: their codes
    (a ``Decode``) or their stored dtype.
    ``frozen``: by stage, the indices of its unit tree's leaves (the head's: then its tied leaves)
    that take no gradient (``FrozenLeaves.of``), recorded as the engine records them, so no
    gradient of theirs is timed. ``block_lent``: the block's frozen linears the engine lends as
    their NF4 codes (``layout.policy.lent_leaves``), timed so (``nf4_linear.lent_apply``)."""
    embed, block, head, micro = (_to(t, device) for t in (embed, block, head, micro))
    lent = lent or {}
    frozen = frozen or {}
    # the block timed as layer 0's (a block with model.layer_index gets its index)
    applies = (model.embed.apply, block_apply(model, 0), model.head.apply)
    trees = (embed, block, head)
    (e_apply, embed), (b_apply, block), (h_apply, head) = (
        held(apply, t, lent=_lent(t, lent.get(stage, {})))
        for apply, t, stage in zip(applies, trees, STAGES, strict=True)
    )
    if block_lent is not None:
        block, b_apply = encode_lent(block, block_lent), lent_apply(b_apply, block_lent)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        carry = e_apply(embed, micro)
    floats = [x for x in optree.tree_leaves(carry) if _is_float(x)]
    ones = tuple(torch.ones_like(x) for x in floats)
    e_leaves, e_def = optree.tree_flatten(embed)
    h_leaves, h_def = optree.tree_flatten(head)
    b_leaves = optree.tree_leaves(block)
    b_frozen = frozen.get(BLOCKS, ())

    def embed_forward():
        with torch.no_grad():
            e_apply(embed, micro)

    def block_forward():
        _, (tape,) = block_record(b_apply, block, [carry], "blocks.0", False, b_frozen)
        return tape

    # a head that returns a TokenLoss (``Model.count_targets``) is pulled back through its sum
    token = model.count_targets is not None

    def block_backward(tape):
        tape.pull_back([b_leaves, floats], ones)

    with engine_threads():
        return StageSeconds(
            embed_forward=_median_seconds(embed_forward, sync),
            block_forward=_median_seconds(block_forward, sync),
            head=_median_seconds(
                lambda: head_vjp(
                    h_apply,
                    h_leaves,
                    _unflattener(h_def),
                    carry,
                    micro,
                    1.0,
                    token,
                    frozen.get(HEAD, ()),
                ),
                sync,
            ),
            block_backward=_median_seconds(block_backward, sync, setup=block_forward),
            embed_backward=_median_seconds(
                lambda: embed_vjp(
                    e_apply, e_leaves, _unflattener(e_def), micro, ones, frozen.get(EMBED, ())
                ),
                sync,
            ),
        )


def lent_tiles(node, lent: Decode | torch.dtype) -> list[CodedMatrix] | list[torch.Tensor]:
    """A tiled node's tiles as the engine's fetcher lends a row of them: stored as codes
    (``lent`` a ``Decode``: ``formats.nf4_linear.lent``, NF4 codes: ``CodedMatrix.of``, each
    tile's values rounded to the stored 16-bit dtype and encoded as the row holds them); or as
    stored values (``lent`` a dtype: ``GroupPolicy.lent_as``), each tile cast to
    it."""
    if isinstance(lent, torch.dtype):
        return [tile.to(lent) for tile in node.tiles]
    return [CodedMatrix.of(tile, lent.dtype) for tile in node.tiles]


def _lent(tree: Any, lent: Mapping[str, Decode | torch.dtype]) -> dict[str, list]:
    """By key path, the lent tiles of ``tree``'s tiled nodes named in ``lent``, made once (before
    the timing, as the engine's rows are stored before a step)."""
    _rest, found = split_tiled(tree)
    return {path: lent_tiles(node, lent[path]) for path, _i, node in found if path in lent}


def recomputed_leaves(model, block: Any, carry: Any, frozen: tuple = ()) -> list[int]:
    """The tiled leaves of a block (indices in tree order, as ``TileLayout.leaves``) whose forward
    its backward runs again: one micro-batch's ``carry`` through layer 0's ``block`` tree (tiled
    nodes as tiles), recorded (``scan.block_record``) and pulled back with held tiles, each leaf
    counted as the engine's ``StepTiles.observed`` counts it (told its routing, or fetched more
    tiles than its backward's, during the pull-back: a recorded block's recompute stops before the
    ops nothing needs, such as its last linear). ``frozen``: the indices of the block tree's leaves
    that take no gradient (``FrozenLeaves.of``), as the engine records it."""
    made: list = []
    apply, rest = held(block_apply(model, 0), block, made)
    _, (tape,) = block_record(apply, rest, [carry], "blocks.0", False, frozen)
    before = {id(source): (source.fetches, source.told) for _, source in made}
    floats = [x for x in optree.tree_leaves(carry) if _is_float(x)]
    tape.pull_back([optree.tree_leaves(rest), floats], tuple(map(torch.ones_like, floats)))
    fetched: dict[int, int] = {}
    told: dict[int, int] = {}
    for k, source in made:  # the forward's sources and those a recompute made
        fetches, tells = before.get(id(source), (0, 0))
        fetched[k] = fetched.get(k, 0) + source.fetches - fetches
        told[k] = told.get(k, 0) + source.told - tells
    n_tiles = {k: source.n_tiles for k, source in made}
    return [k for k in sorted(n_tiles) if told[k] or fetched[k] > n_tiles[k]]


@contextlib.contextmanager
def engine_threads() -> Iterator[None]:
    """A worker thread that has run a multi-threaded torch op (so it holds an OpenMP team of its
    own), alive for the ``with`` block: the threads a training step's compute runs beside (see the
    module)."""
    with ThreadPoolExecutor(1, thread_name_prefix="zinf-plan-worker") as worker:
        # sync: the worker's team exists
        worker.submit(lambda: torch.ones(1 << 20).add_(1)).result()
        yield


def _median_seconds(fn: Callable, sync: Callable, setup: Callable | None = None) -> float:
    """Median seconds of ``fn(setup())`` (``fn()`` without ``setup``; setup is not timed) after a
    warm-up; timed once when the warm-up was slow."""
    seconds = []
    for _ in range(1 + TRIALS):
        arg = () if setup is None else (setup(),)
        sync()  # sync: the setup's kernels are not timed
        t0 = time.perf_counter()
        fn(*arg)
        sync()  # sync: fn's kernels are done
        seconds.append(time.perf_counter() - t0)
        if len(seconds) == 2 and seconds[0] > SLOW_S:
            break
    return statistics.median(seconds[1:])


def _unflattener(treedef) -> Callable:
    return lambda leaves: optree.tree_unflatten(treedef, list(leaves))


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _to(tree: Any, device: torch.device) -> Any:
    return optree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)
