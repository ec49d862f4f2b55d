"""A block's frozen linears lent to their op as their NF4 codes (``zf.Model.takes_lent``,
``GroupPolicy.lent_leaves``, ``tiling.lent``): the fused kernels compute from the codes, no fp32
weight is decoded for them.

The reference is the same model with ``takes_lent=None``: its frozen linears are decoded by the
fetcher and run through ``F.linear`` (bitwise the dequantized bf16 twin's,
tests/engine/test_frozen_quantized.py). The fused kernels multiply the same weights (bitwise
``decode_leaf``'s values, tests/tiling/test_nf4_linear.py) but sum each output in another order, so
losses and weights agree to fp32 rounding: the tolerances of another summation order
(tests/partition/test_distributed.py). Every placement, micro-batching and kept activation is the
same computation, so those compare bitwise.
"""

from __future__ import annotations

import threading

import optree
import pytest
import torch
from dist_utils import rank_part
from reference import make_batches

import zinf_fn as zf
from layers import decoder, gpt, llama, lora
from zinf_fn.formats import nf4_linear
from zinf_fn.layout import build
from zinf_fn.layout.build import layout
from zinf_fn.optim import passes
from zinf_fn.planner.sizes import plan_config
from zinf_fn.state import view
from zinf_fn.tiling import lent, two_at_once
from zinf_fn.tree import path_str

# rows of 64 inputs and more: whole NF4 blocks, what the fused kernels take
CFG = llama.Config(
    vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, n_layers=3, seq_len=16
)
LINEARS = [f"attn.{p}.w" for p in "koqv"] + [f"mlp.{p}.w" for p in ("down", "gate", "up")]


def opt():
    return zf.adamw(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def lora_model(lent: bool = True):
    model = lora.apply(llama.model(CFG), rank=4, alpha=8, targets=("attn.q", "attn.v"))
    return model if lent else model._replace(takes_lent=None)


def leaves(tree) -> dict[str, torch.Tensor]:
    paths, xs, _ = optree.tree_flatten_with_path(tree)
    return {path_str(p): x for p, x in zip(paths, xs, strict=True)}


def frozen_policy(model, storage: str = "nf4", config: zf.Config | None = None):
    """The read policy of the blocks' frozen row that ``zf.init`` decides for ``config`` (default:
    ``frozen_storage=storage`` alone): the layout step's, by a layout build."""
    built = layout(model, opt(), config or zf.Config(frozen_storage=storage))
    return built.store.row_kinds.policy("blocks:frozen")


def lent_paths(model, config: zf.Config) -> list[str]:
    """The key paths (in a block) of the frozen leaves whose codes ``zf.init(model, ..., config)``'s
    fetches lend."""
    policy = frozen_policy(model, config=config)
    return sorted(policy.decode.values.leaves[j].path for j in policy.lent_leaves)


def train(state, steps: int = 3, batch_size: int = 2):
    losses = []
    for batch in make_batches(CFG, steps, batch_size=batch_size, seed=1):
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
    out = leaves(zf.gather_params(state))
    zf.close(state)
    return losses, out


def test_the_blocks_frozen_linears_are_lent_and_nothing_else():
    """NF4 on the CPU in fp32: the seven linears' codes are lent, the norms decoded (their values
    alone fill the fetched buffer); int8, bf16 or a model that takes none: nothing is lent."""
    policy = frozen_policy(lora_model())
    assert sorted(policy.decode.values.leaves[j].path for j in policy.lent_leaves) == LINEARS
    assert [leaf.path for leaf in policy.decoded.values.leaves] == ["attn_norm.w", "mlp_norm.w"]
    assert policy.decoded.values.numel == 2 * CFG.d_model
    assert "the nf4 codes of attn.k.w, attn.o.w, attn.q.w, attn.v.w" in policy.describe()
    assert frozen_policy(lora_model(), "int8").lent_leaves == ()
    assert frozen_policy(lora_model(), "bf16").lent_leaves == ()
    assert frozen_policy(lora_model(False)).lent_leaves == ()


def test_a_gpt_lends_its_four_linears():
    cfg = gpt.Config(vocab_size=64, d_model=64, n_heads=4, n_layers=2, seq_len=16)
    policy = frozen_policy(lora.apply(gpt.model(cfg), rank=4, alpha=8))
    lent = sorted(policy.decode.values.leaves[j].path for j in policy.lent_leaves)
    assert lent == ["attn.proj.w", "attn.qkv.w", "mlp.fc.w", "mlp.proj.w"]


def test_lent_linears_train_as_their_decoded_weights():
    """The LoRA step over lent codes against the same step over the decoded weights: the same
    weights, summed in another order (module docstring); the base bitwise (it never changes)."""
    config = zf.Config(frozen_storage="nf4")
    assert lent_paths(lora_model(), config) == LINEARS
    losses, got = train(zf.init(lora_model(), opt(), config, seed=0))
    want_losses, want = train(zf.init(lora_model(False), opt(), config, seed=0))
    assert losses == pytest.approx(want_losses, rel=1e-6)
    assert max((got[p] - want[p]).abs().max().item() for p in want) < 1e-4
    assert all(torch.equal(got[p], want[p]) for p in want if "lora" not in p)


@pytest.mark.parametrize(
    "kw",
    [
        dict(offload_params="cpu", offload_optimizer="cpu"),
        dict(offload_params="nvme", offload_optimizer="nvme"),
        dict(offload_params="nvme", offload_optimizer="cpu", grad_accum=2),
        dict(keep_activations=64 * 2**20),
    ],
    ids=["cpu", "nvme", "nvme-grad_accum", "kept-activations"],
)
def test_lent_linears_train_bitwise_alike_wherever_the_rows_are(kw, tmp_path):
    """Placements and the activations a recorded block keeps (no recompute: the lent bytes rebuilt
    on the refetched row, ``scan.tape``) change nothing of the computation: each run equals the
    in-memory run of the same micro-batches bitwise."""
    base = zf.Config(frozen_storage="nf4", grad_accum=kw.get("grad_accum", 1))
    want = train(zf.init(lora_model(), opt(), base, seed=0), batch_size=4)
    config = zf.Config(frozen_storage="nf4", nvme_path=str(tmp_path), **kw)
    assert lent_paths(lora_model(), config) == LINEARS
    got = train(zf.init(lora_model(), opt(), config, seed=0), batch_size=4)
    assert got[0] == want[0]
    assert all(torch.equal(got[1][p], want[1][p]) for p in want[1])


def _lent_world(rank: int, world: int) -> dict:
    """Per partition mode: (losses, final weights) of the lent LoRA run in a world of ``world``
    (rank's slice): each rank gathers a slice of the byte row (allgather) or whole rows by owner
    (broadcast)."""
    out = {}
    for partition in ("allgather", "broadcast"):
        config = zf.Config(
            offload_params="cpu", offload_optimizer="cpu", partition=partition, frozen_storage="nf4"
        )
        assert lent_paths(lora_model(), config) == LINEARS
        state, losses = zf.init(lora_model(), opt(), config, seed=0), []
        for batch in make_batches(CFG, 2, batch_size=4, seed=1):
            state, metrics = zf.train_step(state, rank_part(batch, rank, world))
            losses.append(metrics["loss"])
        out[partition] = (losses, leaves(zf.gather_params(state)))
        zf.close(state)
    return out


def test_lent_linears_in_a_world_of_two_train_as_a_world_of_one():
    """Tolerances as tests/partition/test_distributed.py (another summation order over ranks); the
    base bitwise."""
    from dist_utils import assert_like_world_of_one, run_world

    assert_like_world_of_one(_lent_world(0, 1), run_world(2, _lent_world))


def test_the_planner_times_the_lent_linears_on_their_codes(monkeypatch):
    """The planner's timed block (``planner.compute.time_stages``) runs each lent linear on its
    codes, forward and backward, as the step does: the matrices the coded products see are the
    seven linears'."""
    seen: dict[str, set] = {"linear": set(), "grad_input": set()}
    for name in seen:
        real = getattr(nf4_linear.CodedMatrix, name)

        def spy(self, *args, _real=real, _name=name):
            seen[_name].add(self.matrix)
            return _real(self, *args)

        monkeypatch.setattr(nf4_linear.CodedMatrix, name, spy)
    tokens = torch.arange(2 * (CFG.seq_len + 1)).reshape(2, -1) % CFG.vocab_size
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    work = plan_config(lora_model(), opt(), zf.Config(frozen_storage="nf4"), batch).work
    assert work.forward_s > 0 and work.backward_s > 0
    d, q, kv, f = CFG.d_model, CFG.n_heads * CFG.head_dim, CFG.n_kv_heads * CFG.head_dim, CFG.d_ff
    want = {(q, d), (kv, d), (d, q), (f, d), (d, f)}
    assert seen["linear"] == want and seen["grad_input"] == want


def test_a_frozen_row_of_lent_linears_only_is_its_gathered_bytes(tmp_path):
    """The norms trained too: every leaf of the frozen row is lent, nothing is decoded
    (``GroupPolicy.decoded`` None: the layer is the gathered row), and the run equals the decoded
    weights' as above, the same bitwise in RAM and on NVMe."""
    lora_trains = lora_model().trainable

    def with_norms(model):
        return model._replace(trainable=lambda p: lora_trains(p) or p.endswith("norm.w"))

    policy = frozen_policy(with_norms(lora_model()))
    assert len(policy.lent_leaves) == len(policy.decode.codes) == 7 and policy.decoded is None
    config = zf.Config(frozen_storage="nf4", offload_params="nvme", nvme_path=str(tmp_path))
    losses, got = train(zf.init(with_norms(lora_model()), opt(), config, seed=0))
    nf4 = zf.Config(frozen_storage="nf4")
    in_ram = train(zf.init(with_norms(lora_model()), opt(), nf4, seed=0))
    assert losses == in_ram[0] and all(torch.equal(got[p], in_ram[1][p]) for p in got)
    want_losses, want = train(zf.init(with_norms(lora_model(False)), opt(), nf4, seed=0))
    assert losses == pytest.approx(want_losses, rel=1e-6)
    assert max((got[p] - want[p]).abs().max().item() for p in want) < 1e-4


def test_a_big_lent_weights_products_in_two_halves_are_the_whole_products_bitwise(monkeypatch):
    """Above ``tiling.lent.SPLIT_WEIGHTS`` (lowered here to this model's linears) a lent weight's
    forward runs as two halves of its rows and its input's gradient as two halves of its columns,
    one on the side thread (``two_at_once``): the LoRA run is bitwise the run that computes every
    product whole, losses and weights, and the side thread computed halves of both."""
    want = train(zf.init(lora_model(), opt(), zf.Config(frozen_storage="nf4"), seed=0))
    threads, started = [], threading.Event()

    def gated(product):
        def part(self, a, p0, p1):  # the second half waits until the first started
            threads.append((product.__name__, threading.current_thread().name))
            started.set() if p0 == 0 else started.wait(10)
            started.clear() if p0 != 0 else None
            return product(self, a, p0, p1)

        return part

    monkeypatch.setattr(lent, "SPLIT_WEIGHTS", 1)
    for name in ("linear_rows", "grad_input_columns"):
        product = getattr(nf4_linear.CodedMatrix, name)
        monkeypatch.setattr(nf4_linear.CodedMatrix, name, gated(product))
    got = train(zf.init(lora_model(), opt(), zf.Config(frozen_storage="nf4"), seed=0))
    assert got[0] == want[0]
    assert all(torch.equal(got[1][p], want[1][p]) for p in want[1])
    names = {name for name, _ in threads}
    assert names == {"linear_rows", "grad_input_columns"}
    sides = {name for name, thread in threads if thread == "zinf-side_0"}
    assert torch.get_num_threads() < 2 or sides == names


@pytest.mark.parametrize(
    ("storage", "batch_size", "alone"), [("nf4", 2, True), ("nf4", 4, False), ("int8", 2, False)]
)
def test_a_step_paired_on_the_side_thread_runs_torch_on_one_thread(
    monkeypatch, storage, batch_size, alone
):
    """Lent NF4 codes at micro-batches of at most ``nf4_kernels.ONE_THREAD_ROWS`` tokens (2 x 16):
    the compute thread's torch runs on one thread within the step (``two_at_once.
    torch_on_one_thread``), the side thread still counted in; 64 tokens, or an int8 base (nothing
    lent): torch's threads as they are. After the step, torch's count is back."""
    before, seen = torch.get_num_threads(), set()
    norm = decoder.norm

    def counted(*args, **kw):  # every block's norms run on the compute thread
        seen.add((torch.get_num_threads(), two_at_once.threads()))
        return norm(*args, **kw)

    monkeypatch.setattr(decoder, "norm", counted)
    config = zf.Config(frozen_storage=storage)
    train(zf.init(lora_model(), opt(), config, seed=0), steps=1, batch_size=batch_size)
    want = {(1, before)} if alone and before > 1 else {(before, before)}
    assert seen == want and torch.get_num_threads() == before


def _held_or_not(monkeypatch, tmp_path, held: bool):
    """A lent LoRA state on NVMe (its optimizer in RAM) whose block 0 frozen row is held
    (``optim.passes.holds_layer``), or, ``held`` False, made by the rule of before, which held
    no row that lends codes: that row is then read at each of its fetches."""
    if not held:

        def codes_never_held(group, policy, unit, piece_numel, _rule=passes.holds_layer):
            return not policy.lent_leaves and _rule(group, policy, unit, piece_numel)

        monkeypatch.setattr(passes, "holds_layer", codes_never_held)
        monkeypatch.setattr(build, "holds_layer", codes_never_held)
    path = tmp_path / ("held" if held else "read")
    path.mkdir()
    config = zf.Config(
        frozen_storage="nf4", offload_params="nvme", offload_optimizer="cpu", nvme_path=str(path)
    )
    state = zf.init(lora_model(), opt(), config, seed=0)
    traffic = zf.estimate(lora_model(), opt(), config).moved["nvme"]
    monkeypatch.undo()
    return state, traffic


def test_block_0s_lent_row_is_held_and_trains_as_when_read(monkeypatch, tmp_path):
    """Block 0's frozen row lends its linears' codes and decodes its norms; held, the fetcher keeps
    both buffers (``overlap.fetch.Kept``), so no later step reads it: each reads 2 x its bytes fewer
    (forward and backward) than the same run with the row read at every fetch, the first step 1 x
    (its forward reads it in both; each run reads one frozen row early for the next step). The
    planner's NVMe traffic follows, and losses and weights are bitwise the same (the same bytes,
    computed from)."""
    runs = {}
    for held in (True, False):
        state, traffic = _held_or_not(monkeypatch, tmp_path, held)
        v = view(state)
        assert frozen_policy(lora_model()).lent_leaves and v.counters().held_layers == 0
        row = v.shard_numel("blocks:frozen") * v.dtype("param", "blocks:frozen").itemsize
        reads, losses = [], []
        for batch in make_batches(CFG, 3, batch_size=2, seed=1):
            state, metrics = zf.train_step(state, batch)
            reads.append(metrics["bytes_read.nvme"])
            losses.append(metrics["loss"])
        assert reads[-1] + metrics["bytes_written.nvme"] == traffic
        counters = view(state).counters()
        # the embedding's and, held, block 0's frozen layers: its norms' values and its codes
        assert (counters.held_layers, counters.held_buffers) == ((2, 3) if held else (1, 1))
        runs[held] = (reads, losses, leaves(zf.gather_params(state)))
        zf.close(state)
    (reads, losses, got), (read_reads, read_losses, want) = runs[True], runs[False]
    assert [b - a for a, b in zip(reads, read_reads, strict=True)] == [row, 2 * row, 2 * row]
    assert losses == read_losses and all(torch.equal(got[p], want[p]) for p in want)


def test_a_held_lent_row_written_gives_both_buffers_back(monkeypatch, tmp_path):
    """A write of block 0's frozen row (``StateView.write_``: here block 1's bytes) gives its held
    layer's two buffers back (the pool has lent out only the embedding's after a flush), and the
    next step computes from the new bytes: as the run that reads the row at every fetch."""
    batches = make_batches(CFG, 2, batch_size=2, seed=1)
    losses = {}
    for held in (True, False):
        state, _ = _held_or_not(monkeypatch, tmp_path, held)
        state, _ = zf.train_step(state, batches[0])
        v = view(state)
        block_1 = torch.empty(v.shard_numel("blocks:frozen"), dtype=torch.uint8)
        v.read_("param", "blocks:frozen", 1, block_1).result()
        v.write_("param", "blocks:frozen", 0, block_1).result()
        zf.flush(state)
        counters = v.counters()
        assert counters.held_layers == counters.held_buffers == counters.pool_out == 1
        state, metrics = zf.train_step(state, batches[1])
        assert view(state).counters().held_layers == (2 if held else 1)
        losses[held] = metrics["loss"]
        zf.close(state)
    assert losses[True] == losses[False]
