"""The optimizer's update in pieces (``Config.optimizer_piece_bytes``): bitwise the in-RAM run,
memory by pieces.

1. Pieces that cut leaves and shards unevenly: training with the optimizer on NVMe (streamed piece
   by piece, both engines, with and without clipping) equals the in-RAM run with the same pieces
   bitwise.
2. The memory contract: the optimizer's buffers in flight (pieces read ahead, being updated, written
   behind) are bounded by pieces, not by the layer: a layer 4x larger holds no more of them.
3. Bad input: a piece size off the O_DIRECT alignment is a ValueError naming the field and the
   alignment.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import batches, run_engine
from engine_internals import wrap_optimizer_pool
from nvme_helpers import all_states, bits

import zinf_fn as zf
from layers import gpt
from zinf_fn.io import odirect
from zinf_fn.optim.pieces import piece_numel, pieces
from zinf_fn.state import view

PIECE = (
    odirect.ALIGN
)  # 2048 elements: cuts a d_model-32 block's shard (12704 elements) and its qkv leaf unevenly


def test_pieces_cover_a_row_and_start_on_the_alignment_in_every_dtype():
    assert piece_numel(PIECE) == 2048 and piece_numel(64 << 20) == 16 << 20
    assert (
        pieces(12704, 2048)[-1] == (12288, 12704)
        and sum(b - a for a, b in pieces(12704, 2048)) == 12704
    )
    assert all(
        lo * 2 % odirect.ALIGN == 0 for lo, _ in pieces(10**6, piece_numel(3 * odirect.ALIGN))
    )


@pytest.fixture(scope="module")
def in_ram():
    cache = {}

    def get(dtype, clip, accum):
        if (dtype, clip, accum) not in cache:
            config = zf.Config(
                param_dtype=dtype,
                clip_grad_norm=clip,
                grad_accum=accum,
                optimizer_piece_bytes=PIECE,
            )
            losses, final, _, state = run_engine(config, steps=6, mask=True)
            cache[(dtype, clip, accum)] = (losses, all_states(state))
        return cache[(dtype, clip, accum)]

    return get


@pytest.mark.parametrize(
    ("dtype", "depth", "clip", "accum", "engine", "params"),
    [
        (
            torch.bfloat16,
            1,
            None,
            1,
            "direct",
            "nvme",
        ),  # blocks (over 4 pieces) lend no master; embed, head do
        (torch.float32, 2, None, 1, "direct", "nvme"),  # the param row is the master
        (torch.bfloat16, 0, None, 1, "direct", "nvme"),  # no read-ahead: every piece read on demand
        (
            torch.bfloat16,
            2,
            0.5,
            2,
            "direct",
            "nvme",
        ),  # clipped second pass: grad, master, m, v in pieces
        (torch.bfloat16, 1, None, 1, "direct", "cpu"),  # params in memory: the master in pieces too
        (torch.bfloat16, 1, 0.5, 1, "tensorstore", "nvme"),
    ],
)
def test_piecewise_update_on_nvme_bitwise_equals_in_ram(
    tmp_path, in_ram, dtype, depth, clip, accum, engine, params
):
    ref_losses, ref_states = in_ram(dtype, clip, accum)
    config = zf.Config(
        offload_params=params,
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        param_dtype=dtype,
        prefetch_depth=depth,
        clip_grad_norm=clip,
        grad_accum=accum,
        nvme_engine=engine,
        optimizer_piece_bytes=PIECE,
    )
    losses, _, _, state = run_engine(config, steps=6, mask=True)
    assert losses == ref_losses
    states = all_states(state)
    assert sorted(states) == sorted(ref_states)
    for name, rows in states.items():
        assert torch.equal(bits(rows), bits(ref_states[name])), name


class CountingPool:
    """The pool as the optimizer's read-ahead, update and write-behind see it: counts the bytes they
    hold."""

    def __init__(self, pool):
        self.pool, self.mine, self.out, self.peak = pool, set(), 0, 0

    def take(self, numel, dtype, device):
        buf = self.pool.take(numel, dtype, device)
        self.mine.add(id(buf))
        self.out += buf.numel() * buf.element_size()
        self.peak = max(self.peak, self.out)
        return buf

    def give(self, buf):
        if id(buf) in self.mine:
            self.mine.discard(id(buf))
            self.out -= buf.numel() * buf.element_size()
        self.pool.give(buf)


def _optimizer_peak(tmp_path, d_model: int, clip) -> tuple[int, int]:
    """(peak bytes of the optimizer's buffers out at once, bytes of one block's fp32 optimizer
    rows)."""
    tmp_path.mkdir()
    cfg = gpt.Config(vocab_size=64, d_model=d_model, n_heads=2, n_layers=3, seq_len=16)
    config = zf.Config(
        offload_params="cpu",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        clip_grad_norm=clip,
        prefetch_depth=2,
        update_workers=1,
        optimizer_piece_bytes=PIECE,
    )
    state = zf.init(gpt.model(cfg), zf.adamw(), config)
    counting = wrap_optimizer_pool(state, CountingPool)
    for batch in batches(3):
        state, _ = zf.train_step(state, batch)
    v = view(state)
    block, opt_kinds = (
        v.groups["blocks"].part.shard_numel,
        v.kinds(grads=True)[1:],
    )  # master, m, v (+ grad)
    zf.close(state)
    return counting.peak, block * 4 * len(opt_kinds)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_optimizer_buffers_in_flight_are_bounded_by_pieces_not_layers(tmp_path, clip):
    small, small_layer = _optimizer_peak(tmp_path / "small", 64, clip)
    large, large_layer = _optimizer_peak(tmp_path / "large", 128, clip)
    assert large_layer >= 3.5 * small_layer
    # Out at once: `depth` pieces read ahead and one being updated per worker, `depth` pieces
    # written behind and one being put, each with master, m, v (and the stashed grad) and a bf16
    # param piece.
    piece_bytes = piece_numel(PIECE) * (4 * (3 + (clip is not None)) + 2)
    bound = (2 + 1 + 2 + 1) * piece_bytes
    assert small <= bound and large <= bound, (small, large, bound)
    assert large < large_layer / 4, "the optimizer held a large part of a layer at once"


@pytest.mark.parametrize("bad", [0, -4096, 1000, 4096 + 512, 4096.0])
def test_a_piece_size_off_the_alignment_is_rejected(bad):
    with pytest.raises(ValueError, match=r"optimizer_piece_bytes.*4096"):
        zf.Config(optimizer_piece_bytes=bad)
    assert zf.Config(optimizer_piece_bytes=8192).describe()["optimizer_piece_bytes"] == 8192
