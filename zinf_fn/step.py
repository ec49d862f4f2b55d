"""One step of a runtime: ``StepDriver`` runs a training or evaluation step over the runtime's
parts (``step_io.StepParts``): the step's plan and prefetcher, the scans over a ``step_io.StepIO``,
the updates and the step's metrics. ``FirstBatch`` checks each batch against the run's first.
"""

from __future__ import annotations

import time

import optree
import torch

from .formats.nf4_kernels import ONE_THREAD_ROWS
from .formats.nf4_linear import lend
from .layout.policy import lent_leaves
from .layout.units import head_index
from .model import packed_head
from .offload.activations import OffloadedCheckpoints
from .optim.optimizers import clip_coefficient, learning_rate
from .overlap.plan import eval_plan, step_plan
from .overlap.prefetch import Prefetcher, plan_prefetcher
from .scan.blocks import check_loss
from .scan.loops import ScanOptions, backward_scan, forward_scan, head_params, head_step
from .step_io import GradientsOut, StepIO, StepParts
from .store import Store
from .tiling import two_at_once
from .tiling.step_tiles import StepTiles


class StepDriver:
    """Runs a training or evaluation step over the runtime's parts: the plan, its prefetcher and
    tiles, the scans over a ``StepIO``, the updates, and the step's metrics.

    ``last`` holds what the last training step decided (``leaf_grads``: it handed the updates unit
    gradients as their leaves; False before any step).
    """

    def __init__(self, parts: StepParts):
        self.parts = parts
        self.comm = parts.sharding.comm
        self.last = {"leaf_grads": False}
        # the model as the scans run it: the blocks' lent codes made ``CodedMatrix`` s in its apply
        self.model = lend(packed_head(parts.model), lent_leaves(parts.store.row_kinds.policy))
        policy = parts.store.row_kinds.policy
        self.lends_codes = any(policy(g).codes_lent is not None for g in parts.store.groups)

    def train_step(self, micro_batches: list, step: int) -> dict:
        """Forward, head, backward and every update of one step; returns its metrics."""
        parts, config = self.parts, self.parts.config
        t0 = time.perf_counter()
        # a TokenLoss head: the loss is the mean over the global batch's targets
        n_targets = self._target_tokens(micro_batches)
        before = self._counters()
        parts.observers.waits.computes_here()  # the thread that calls train_step computes
        parts.updater.reset_norm()
        clipping = config.clip_grad_norm is not None
        self.last["leaf_grads"] = parts.leaf_grads
        depth = config.prefetch_depth
        plan = step_plan(parts.units, parts.frozen.embed_trains(), parts.reuse, depth, clipping)
        prefetcher = plan_prefetcher(plan, parts.fetcher, depth, parts.executor, parts.issuer)
        out = GradientsOut(parts, step, clipping)
        tiles = parts.tiles.begin(plan, out, len(micro_batches), train=True)
        scale = None if n_targets is None else self.comm.world_size / n_targets
        io = StepIO(parts, plan, prefetcher, out, tiles, self._options(scale))
        try:
            with two_at_once.torch_on_one_thread(self._side_pairs(micro_batches)):
                losses, grad_norm = self._scan_and_update(io, tiles, micro_batches, step, clipping)
        except BaseException:
            self._abandon()
            raise
        finally:
            close_step(prefetcher, tiles)
        loss = self._mean_loss(losses, n_targets)
        counts = self._step_counts(before)
        seconds = time.perf_counter() - t0
        metrics = self._metrics(loss, grad_norm, step, seconds, prefetcher.wait_s, counts)
        parts.observers.tracer.flush()
        return metrics

    def _side_pairs(self, micro_batches: list) -> bool:
        """Whether the side thread carries this step's parallel work (``two_at_once``: its
        compute thread then runs torch on one thread): on the CPU, over a model computing from lent
        NF4 codes (a frozen base's linears or experts: their products at few rows paired on the
        side thread), micro-batches of at most ``nf4_kernels.ONE_THREAD_ROWS`` elements a leaf
        (tokens: the products' rows)."""
        if self.parts.device.type != "cpu" or not self.lends_codes:
            return False
        leaves = (leaf for mb in micro_batches for leaf in optree.tree_leaves(mb))
        return max((leaf.numel() for leaf in leaves), default=0) <= ONE_THREAD_ROWS

    def _options(self, loss_scale: float | None) -> ScanOptions:
        """How this step's scans run (``scan.ScanOptions``)."""
        parts = self.parts
        return ScanOptions(
            checkpoints=parts.checkpoints,
            loss_scale=loss_scale,
            embed_trains=parts.frozen.embed_trains(),
            keep_activations=parts.config.keep_activations,
            reuse=parts.reuse,
        )

    def _scan_and_update(
        self, io: StepIO, tiles: StepTiles | None, micro_batches: list, step: int, clipping: bool
    ) -> tuple[list, float]:
        """Forward, head, backward and every update of one step: (the micro-batches' losses, the
        global gradient norm)."""
        parts = self.parts
        model = parts.tiles.model(self.model, tiles)
        carries, bounds = forward_scan(model, io, micro_batches, keep_boundaries=True, check=True)
        losses, d_carries, d_tied = head_step(model, io, carries, micro_batches)
        del carries
        backward_scan(model, io, bounds, d_carries, micro_batches, d_tied)
        if clipping:
            grad_norm = self._global_grad_norm()
            scale = clip_coefficient(grad_norm, parts.config.clip_grad_norm)
            updated = parts.frozen.trained(parts.units + parts.tiles.layout.units(parts.units))
            parts.updater.stream_clipped(updated, step, scale)
        # sync: every update ran; the last units' writes stay in flight (Updater.wait)
        parts.updater.wait()
        if not clipping:  # the one-pass updates took the norms of the units they updated
            grad_norm = self._global_grad_norm()
        return losses, grad_norm

    def eval_step(self, micro_batches: list) -> torch.Tensor:
        """The mean loss over the micro-batches and ranks; changes nothing."""
        parts = self.parts
        plan = eval_plan(parts.units)
        depth = parts.config.prefetch_depth
        prefetcher = plan_prefetcher(plan, parts.fetcher, depth, parts.executor, parts.issuer)
        tiles = parts.tiles.begin(plan, None, len(micro_batches), train=False)
        io = StepIO(parts, plan, prefetcher, None, tiles, self._options(None))
        try:
            with two_at_once.torch_on_one_thread(self._side_pairs(micro_batches)):
                losses = self._eval_losses(io, tiles, micro_batches)
        finally:
            close_step(prefetcher, tiles)
        n_targets = self._target_tokens(micro_batches)
        token = n_targets is not None
        return torch.tensor(self._mean_loss([check_loss(x, token) for x in losses], n_targets))

    def _eval_losses(self, io: StepIO, tiles: StepTiles | None, micro_batches: list) -> list:
        """The forward and the head of an evaluation step: each micro-batch's loss."""
        model = self.parts.tiles.model(self.model, tiles)
        carries, _ = forward_scan(model, io, micro_batches, keep_boundaries=False, check=True)
        layer = io.get(head_index(self.parts.model.n_layers))
        with torch.no_grad():
            pairs = zip(carries, micro_batches, strict=True)
            losses = [model.head.apply(head_params(model, layer), c, mb) for c, mb in pairs]
        io.release(layer)
        return losses

    def _step_counts(self, before: dict) -> dict:
        """The counters' change since ``before`` (``_counters``), with the I/O time compute hid."""
        counts = {k: v - before[k] for k, v in self._counters().items()}
        wait, busy = counts.pop("io_wait_s"), counts.pop("io_busy_s")
        counts.update(io_wait_s=wait, io_busy_s=busy, io_hidden_s=max(0.0, busy - wait))
        return counts

    def _global_grad_norm(self) -> float:
        total = self.parts.updater.sq_norm()
        self.comm.all_reduce_sum_(total, "grad norm")  # sync: every rank's squared shard norms
        return float(total.sqrt())

    def _target_tokens(self, micro_batches: list) -> int | None:
        """The target tokens of the global batch (``Model.count_targets`` summed over micro-batches
        and ranks); None for a model whose head returns a scalar loss."""
        count = self.parts.model.count_targets
        if count is None:
            return None
        local = torch.stack([torch.as_tensor(count(mb)).reshape(()) for mb in micro_batches])
        # sync: one device-to-host copy for all micro-batches
        total = local.sum().to("cpu", torch.float64)
        self.comm.all_reduce_sum_(total, "target tokens")  # sync: every rank's count, once a step
        if total <= 0:
            raise ValueError(
                "the global batch has no target tokens (every target is -100): its "
                "loss is undefined; skip such batches or train on the prompt "
                "(train_on_prompt)"
            )
        return int(total)

    def _mean_loss(self, losses: list, n_targets: int | None = None) -> float:
        """The mean over micro-batches and ranks; for ``TokenLoss`` es the sum / ``n_targets``.

        Where every micro-batch of every rank holds the same number of targets (nothing masked),
        the token mean is the mean of the micro-batches' means, and it is computed so: bitwise the
        loss a scalar head (``reduction="mean"``) reports."""
        if n_targets is None:
            mean = torch.stack([x.detach().double().cpu() for x in losses]).mean()
            self.comm.all_reduce_sum_(mean, "loss")  # sync: the global loss is the mean over ranks
            return float(mean) / self.comm.world_size
        even = n_targets / (len(losses) * self.comm.world_size)  # targets per micro-batch, if even
        counts = torch.stack([torch.as_tensor(x.count).reshape(()) for x in losses]).cpu()
        sums = [x.sum.detach() for x in losses]
        means = [(total / count).double().cpu() for total, count in zip(sums, counts, strict=True)]
        reduced = torch.stack(
            [
                torch.stack([total.double().cpu() for total in sums]).sum(),
                torch.stack(means).mean(),
                (counts != even).any().double(),  # 0 on every rank: the counts are even
            ]
        )
        self.comm.all_reduce_sum_(reduced, "loss")  # sync: the global sum, means, unevenness
        if reduced[2] == 0:
            return float(reduced[1]) / self.comm.world_size
        return float(reduced[0]) / n_targets

    def _counters(self) -> dict:
        """Cumulative traffic counters and clocks; a step reports their difference."""
        parts = self.parts
        store, observers = parts.store, parts.observers
        moved = sum(
            sum(t.counters()[c] for c in ("bytes_read", "bytes_written"))
            for t in (store.param_tier, store.opt_tier)
        )
        out = {
            **parts.fetcher.counters(),
            "io_wait_s": observers.waits.seconds,
            "io_busy_s": observers.io_clock.read(),
            "state_bytes_moved": moved,
        }
        for tier in tiers_of(store, parts.checkpoints):
            for counter, value in tier.counters().items():  # NVMe adds bytes_read_inflight
                name = f"{counter}.{tier.name}"
                out[name] = out.get(name, 0) + value
        return out

    def _abandon(self) -> None:
        """A step failed: give every buffer of the optimizer stream and the checkpoints back."""
        self.parts.updater.abandon()
        if self.parts.checkpoints is not None:
            self.parts.checkpoints.abandon()

    def _metrics(
        self, loss: float, grad_norm: float, step: int, seconds: float, wait_s: float, counts: dict
    ) -> dict:
        parts = self.parts
        lr = parts.optimizer.lr
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": None if lr is None else learning_rate(lr, step),
            "step_time_s": seconds,
            "fetch_wait_s": wait_s,
            "peak_live_layers": parts.fetcher.peak_live,
            "buffers": parts.pool.count,
            "bytes_per_param": counts["state_bytes_moved"] / max(1, self._held_elements()),
            **(parts.tiles.last if parts.tiles.layout else {}),
            **counts,
        }

    def _held_elements(self) -> int:
        """Elements of one row of every unit and tile this rank holds (padding included): the
        parameters whose states this rank's tiers store and move."""
        parts = self.parts
        frozen, units = parts.frozen, parts.units
        rows = units + parts.tiles.layout.units(units) + frozen.companions(units)
        return sum(
            frozen.codes.shard_elements(u.group, parts.store.group_of(u).part)
            for u in rows
            if parts.sharding.holds(u)
        )


class FirstBatch:
    """The signature of a run's first batch (its tree, each leaf's trailing shape and dtype): every
    later batch must have the same tree, and each leaf the same dtype and number of dimensions
    (``zinf_fn.train.split_batch``). The sizes may change from batch to batch (rows padded to a
    few bucket lengths): nothing kept from one step to the next depends on them but the offloaded
    boundary carries, which size their rows for the largest batch yet
    (``offload.activations.OffloadedCheckpoints``)."""

    def __init__(self):
        self.seen: list = []  # the first batch's signature, once one came

    def check(self, signature: tuple) -> None:
        """Record ``signature`` as the first, or raise ValueError where its tree, a leaf's dtype or
        a leaf's number of dimensions differs from the first's."""
        if not self.seen:
            self.seen.append(signature)
            return
        first = self.seen[0]
        if _kind(signature) != _kind(first):
            want = [f"(B, {', '.join(map(str, s))}) {d}" for s, d in first[1]]
            got = [f"(B, {', '.join(map(str, s))}) {d}" for s, d in signature[1]]
            raise ValueError(
                f"batch differs from the first batch of this run: expected leaves {want}, got "
                f"{got} (the sizes may differ; the tree, dtypes and dimensions may not)"
            )


def _kind(signature: tuple) -> tuple:
    """A batch signature without its sizes: the tree, and each leaf's dimensions and dtype."""
    treedef, leaves = signature
    return treedef, tuple((len(shape), dtype) for shape, dtype in leaves)


def tiers_of(store: Store, checkpoints: OffloadedCheckpoints | None) -> list:
    """A runtime's tiers: the params', the optimizer's and, with offloaded activations, theirs."""
    tiers = [store.param_tier, store.opt_tier]
    return tiers + ([checkpoints.tier] if checkpoints is not None else [])


def close_step(prefetcher: Prefetcher, tiles: StepTiles | None) -> None:
    """A step's prefetcher and tile stream released, whether the step finished or failed."""
    prefetcher.close()
    if tiles is not None:
        tiles.close()
