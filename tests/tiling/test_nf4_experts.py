"""A frozen expert stored NF4 whose rows are whole blocks of 64 is fetched as its codes and computed
by the fused kernel (``zinf_fn.formats.nf4_linear``), never decoded; LoRA over such a base trains
as over the same base fetched whole (decoded, then ``F.linear``).

Where an expert's rows are not whole blocks (d_in = 32: tests/tiling/test_experts_engine.py's
quantized case) its tiles are decoded as before and the streamed run stays bitwise the whole
block's. Here the weights are the same numbers in both runs; only the order of each expert
product's fp32 sum differs (tests/tiling/test_nf4_linear.py bounds it by 2 * d_in * 2**-24 of the
terms' magnitudes: below 1e-5 relative at d_in = 64, ~1e-7 in practice), and three LoRA steps
carry that through the loss and the adapters' AdamW updates: a relative 1e-5 on the losses and
1e-5 absolute on the factors (about 2e-7 seen) hold it with a margin, while a wrong weight (a
code, a scale, a rounding) shows in the losses at the 1e-2 level.
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
from dist_utils import run_world
from engine_internals import log_fetches
from llama_reference import train_untiled
from side_threads import StartedSide

import zinf_fn as zf
from layers import llama, lora, moe
from zinf_fn.formats import nf4_linear
from zinf_fn.layout.build import layout
from zinf_fn.layout.policy import DECODED, LENT
from zinf_fn.overlap import fetch, tile_runs
from zinf_fn.planner.memory import demands
from zinf_fn.tiling import two_at_once
from zinf_fn.tiling.layout import TileUnit

MOE = moe.Config(n_experts=4, top_k=2, d_model=64, d_ff=64)
CFG = llama.Config(
    vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=2, seq_len=8, moe=MOE
)
TARGETS = ("attn.q", "attn.v", "mlp.experts.gate_up", "mlp.experts.down")
EXPERTS = ("blocks:mlp.experts.gate_up.w", "blocks:mlp.experts.down.w")
STEPS = 3


ATTENTION = ("attn.q", "attn.v")  # LoRA on attention only: nothing on an expert trains


def _model(stream: bool, targets: tuple[str, ...] = TARGETS, cfg: llama.Config = CFG) -> zf.Model:
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(MOE, stream_experts=stream))
    return lora.apply(llama.model(cfg), rank=2, alpha=4, targets=targets)


def _train(stream: bool, config: zf.Config, targets: tuple[str, ...] = TARGETS):
    """(losses, final weights untiled) of STEPS LoRA steps."""
    return train_untiled(_model(stream, targets), config, CFG, STEPS)


@pytest.mark.parametrize("storage", ["nf4", "int8", "bf16", "nf4-bf16-compute"])
def test_the_experts_read_policy_lends_nf4_codes_only(storage):
    """NF4 with fp32 compute on the CPU: the expert tiles' codes are lent (``LENT``, not
    decoded); int8 codes, and NF4 under another compute dtype (the fused kernel's is fp32), are
    decoded by the fetcher as before, bf16 rows cast."""
    config = zf.Config(frozen_storage=storage.split("-")[0])
    if storage == "nf4-bf16-compute":
        config = dataclasses.replace(config, compute_dtype=torch.bfloat16)
    built = layout(_model(True), zf.adamw(), config)
    policies = [built.store.row_kinds.policy(group) for group in EXPERTS]
    if storage == "nf4":
        assert all(p.codes == LENT and p.decoded is None for p in policies)
        assert all(p.codes_lent.codes == ("nf4",) for p in policies)
        assert all("its nf4 codes lent to the op" in p.describe() for p in policies)  # zf.plan's
    else:
        assert all(p.codes == DECODED and p.codes_lent is None for p in policies)
        assert all((p.decoded is None) == (storage == "bf16") for p in policies)


@pytest.mark.parametrize("storage", ["nf4", "int8"])
def test_the_fetchers_demand_holds_a_decoded_expert_only_where_it_is_decoded(storage):
    """The fetched layers' demand (what the pool is made of, tests/engine/test_demand.py) holds
    buffers of an expert tile's decoded values (fp32, one expert's elements) for int8 codes, none
    for lent NF4 codes."""
    config = zf.Config(frozen_storage=storage)
    built = layout(_model(True), zf.adamw(), config)
    fetched = next(d for d in demands(built, config) if d.part == "fetched layers")
    gate_up = 2 * MOE.d_ff * MOE.d_model  # one expert's values (down's numel is the vocabulary
    # tile's too: 64 x 64)
    decoded = [b for b in fetched.buffers if b.numel == gate_up and b.dtype == torch.float32]
    assert bool(decoded) == (storage == "int8")


@pytest.mark.parametrize("storage", ["nf4", "int8"])
def test_the_window_counts_lent_codes_by_their_own_bytes(storage, monkeypatch):
    """The tile window's bytes (``tile_runs.store_window``) are what its buffers hold: lent NF4
    codes their own bytes (uint8), so four times as many runs are in flight as at fp32's; int8
    codes, decoded into fp32 buffers, the compute dtype's."""
    built = layout(_model(True), zf.adamw(), zf.Config(frozen_storage=storage))
    store = built.store
    runs = [
        group.part.padded_numel * store.row_kinds.policy(group.name).fetch_run
        for group in store.groups.values()
        if store.row_kinds.policy(group.name).streamed
    ]
    # room for 8 of the largest run's codes: 2 of them counted in fp32
    monkeypatch.setattr(tile_runs, "TILE_WINDOW_BYTES", 8 * max(runs))
    window = tile_runs.store_window(store, torch.float32, 1)
    assert window == (8 if storage == "nf4" else 2)


def test_a_frozen_nf4_expert_is_never_decoded(monkeypatch):
    """Counted: every row the fetcher decodes is the blocks' frozen row (2-D attention weights),
    never an expert's (a (1, 2I, D) or (1, D, I) tile); the fused products ran, forward and dx."""
    decoded, products = [], {"linear": 0, "grad_input": 0}

    def counting_decode(decode, row, out):
        decoded.append(tuple(len(leaf.shape) for leaf in decode.values.leaves))
        return decode_row_(decode, row, out)

    def counted(name):
        original = getattr(nf4_linear.CodedMatrix, name)

        def run(self, *args):
            products[name] += 1
            return original(self, *args)

        return run

    decode_row_ = fetch.decode_row_
    monkeypatch.setattr(fetch, "decode_row_", counting_decode)
    for name in products:
        monkeypatch.setattr(nf4_linear.CodedMatrix, name, counted(name))
    _train(True, zf.Config(frozen_storage="nf4"))
    assert decoded and all(3 not in dims for dims in decoded)
    assert products["linear"] > 0 and products["grad_input"] > 0


@pytest.mark.parametrize("targets", [TARGETS, ATTENTION], ids=["experts", "attention"])
@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_lora_on_an_nf4_base_of_lent_experts_trains_as_the_whole_block(
    placement, targets, tmp_path
):
    """The streamed run (experts' codes lent, fused products; with LoRA on attention only, each
    expert one ``tiling.expert_swiglu`` node) against the whole block (its frozen row decoded,
    ``F.linear``): the tolerances of the module docstring."""
    config = zf.Config(offload_params=placement, nvme_path=str(tmp_path), frozen_storage="nf4")
    streamed = _train(True, config, targets)
    reference = _train(False, config, targets)
    assert streamed[0] == pytest.approx(reference[0], rel=1e-5)
    got, want = optree.tree_flatten(streamed[1])[0], optree.tree_flatten(reference[1])[0]
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() <= 1e-5


def test_a_layers_frozen_experts_are_one_node_fetched_only_where_their_tokens_are(monkeypatch):
    """One token, top-2 of 4 experts, LoRA on attention only over lent NF4 experts: the layer's
    experts run as one node a pass (``tiling.experts_swiglu``: one ``two_at_once.each`` over them,
    its fetches its own), each expert's products once in it, and the backward fetches exactly the
    experts the forward did, as the two-call path does (tests/tiling/test_experts_engine.py)."""
    calls = []
    each = two_at_once.each

    def counted_each(*args):
        calls.append("each")
        return each(*args)

    def counted(name):  # an expert tile's products (1, d_out, d_in); not the attention's (2-D)
        inner = getattr(nf4_linear.CodedMatrix, name)

        def product(self, a, *rest):
            calls.extend([name] if len(self.shape) == 3 else [])
            return inner(self, a, *rest)

        monkeypatch.setattr(nf4_linear.CodedMatrix, name, product)

    monkeypatch.setattr(two_at_once, "each", counted_each)
    counted("linear")
    counted("grad_input")
    one = dataclasses.replace(CFG, n_layers=1)
    config = zf.Config(frozen_storage="nf4", prefetch_depth=0)
    state = zf.init(_model(True, ATTENTION, one), zf.adamw(), config, seed=0)
    log = []
    log_fetches(state, log)
    tokens = torch.randint(0, CFG.vocab_size, (1, 2), generator=torch.Generator().manual_seed(2))
    state, _ = zf.train_step(state, {"inputs": tokens[:, :1], "targets": tokens[:, 1:]})
    zf.close(state)
    tiles = [(u.path, u.tile) for _, u in log if isinstance(u, TileUnit)]
    half = len(tiles) // 2  # one block: its forward unit's fetches, then its backward unit's
    used = sorted({t for _, t in tiles[:half]})
    assert sorted({t for _, t in tiles[half:]}) == used and len(used) == MOE.top_k
    # one node a pass: the forward, its recompute in backward (no activation kept), the backward
    assert calls.count("each") == 3
    # each used expert's two forward products in the forward and the recompute, its two dx once
    assert calls.count("linear") == 4 * len(used) and calls.count("grad_input") == 2 * len(used)


def _world(rank: int, world: int):
    """(losses, final weights as arrays) of the streamed NF4 LoRA run on this rank's slice of each
    batch in a world of ``world``: each expert's byte row sharded, gathered as bytes, lent."""
    config = zf.Config(offload_params="cpu", offload_optimizer="cpu", frozen_storage="nf4")
    losses, final = train_untiled(_model(True), config, CFG, STEPS, rank, world)
    paths, leaves, _ = optree.tree_flatten_with_path(final)
    return losses, {".".join(map(str, p)): x.numpy() for p, x in zip(paths, leaves, strict=True)}


def test_lent_experts_in_a_world_of_two_train_as_a_world_of_one():
    """Every rank computes the union of the ranks' experts (some on no rows: the kernel's empty
    product), from the gathered codes. Tolerances as tests/partition/test_distributed.py (the
    gradients sum over ranks in another order); the frozen base bitwise."""
    one_losses, one = _world(0, 1)
    for losses, final in run_world(2, _world):
        assert losses == pytest.approx(one_losses, rel=1e-6)
        assert final.keys() == one.keys()
        assert max(abs(final[p] - one[p]).max() for p in one) < 1e-4
        assert all((final[p] == one[p]).all() for p in one if "lora" not in p)


def test_two_experts_at_once_fit_the_pool_and_train_as_one_at_a_time(tmp_path, monkeypatch):
    """LoRA on attention over lent NF4 experts on NVMe, runs of one tile and a window of one
    (the pool made from the fetcher's demand, which counts three experts' tiles out for compute:
    ``tile_runs.EXPERTS_AT_ONCE``): with every expert it may take handed to a side thread that
    holds it while the compute thread fetches and computes the next, the run is bitwise the one
    computing every expert on the compute thread, losses and weights."""
    config = zf.Config(offload_params="nvme", nvme_path=str(tmp_path), frozen_storage="nf4")
    # runs of one tile, the window no wider than the depth: the pool holds what is out, no more
    monkeypatch.setattr(tile_runs, "TILE_RUN_BYTES", 1)
    monkeypatch.setattr(tile_runs, "TILE_WINDOW_RUNS", 1)
    each = two_at_once.each

    def one_at_a_time(jobs, fetch, compute, release, side_ok):
        return each(jobs, fetch, compute, release, lambda j, held: False)

    monkeypatch.setattr(two_at_once, "each", one_at_a_time)
    alone = _train(True, config, ATTENTION)
    ran: list = []
    side = StartedSide(ran)
    monkeypatch.setattr(two_at_once, "each", each)
    monkeypatch.setattr(two_at_once, "side_thread", lambda: side)
    try:
        together = _train(True, config, ATTENTION)
    finally:
        side.shutdown()
    assert ran  # experts were computed on the side thread
    assert together[0] == alone[0]
    got, want = optree.tree_flatten(together[1])[0], optree.tree_flatten(alone[1])[0]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
