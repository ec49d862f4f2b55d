"""Frozen leaves stored small (``zinf_fn.formats.frozen``): a param row only, never written, no
gradient computed.

Counts, not times: the kinds of each group, the bytes of the states, the tier rows written after
init (a tier wrapper records every ``write_``), the matmuls a block's pull-back runs (a
``TorchDispatchMode``), the ``requires_grad`` of every leaf an ``apply`` sees, and the NVMe bytes a
LoRA step moves, counted here by hand from the groups' row sizes and compared with the engine's
counters and the planner's.
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
from engine_helpers import BETAS, CFG, EPS, LR, WD, batches
from frozen_helpers import (
    Matmuls,
    RowWrites,
    assert_frozen_unchanged,
    embed_and_norms_frozen,
    only_mlp_trains,
)

import zinf_fn as zf
from layers import gpt, llama, lora
from zinf_fn.scan.blocks import block_vjp
from zinf_fn.state import view
from zinf_fn.tree import path_str

FP32 = dict(param_dtype=torch.float32)


def opt(**kw):
    return zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD, **kw)


def test_frozen_leaves_are_stored_as_a_param_row_only():
    """A frozen group's kinds are ["param"]; the trainable remainder holds zero-size anchors in
    their place."""
    state = zf.init(
        gpt.model(CFG)._replace(trainable=embed_and_norms_frozen), zf.adamw(), zf.Config(**FP32)
    )
    v = view(state)
    assert {g: v.kinds(group=g) for g in v.groups} == {
        "embed": ["param"],
        "blocks": ["param", "master", "opt.0", "opt.1"],
        "blocks:frozen": ["param"],
        "head": ["param", "master", "opt.0", "opt.1"],
        "head:frozen": ["param"],
    }
    assert [leaf.path for leaf in v.groups["blocks:frozen"].spec.leaves] == [
        "ln1.b",
        "ln1.w",
        "ln2.b",
        "ln2.w",
    ]
    assert all(
        leaf.numel == 0 for leaf in v.groups["blocks"].spec.leaves if leaf.path.startswith("ln")
    )
    plain = view(zf.init(gpt.model(CFG), zf.adamw(), zf.Config(**FP32)))
    frozen = sum(
        v.groups[g].spec.numel * v.groups[g].rows for g in ("embed", "blocks:frozen", "head:frozen")
    )
    # fp32 params in memory: a trained row's param array is its master's; a frozen row has its param
    # array only
    assert plain.state_bytes() - v.state_bytes() == frozen * 4 * 2  # no m, no v of frozen leaves
    estimate = zf.estimate(
        gpt.model(CFG)._replace(trainable=embed_and_norms_frozen), zf.adamw(), zf.Config(**FP32)
    )
    assert (
        sum(estimate.states.values()) == v.state_bytes()
    )  # the planner counts what the store allocates


def test_a_frozen_master_is_its_bf16_copy_and_a_remainder_master_keeps_no_frozen_row():
    config = zf.Config(param_dtype=torch.bfloat16, master="remainder", param_rounding=None)
    state = zf.init(gpt.model(CFG)._replace(trainable=only_mlp_trains), opt(), config)
    v = view(state)
    assert v.kinds(group="blocks") == ["param", "remainder", "opt.0", "opt.1"]
    assert (
        v.kinds(group="blocks:frozen")
        == v.kinds(group="embed")
        == v.kinds(group="head")
        == ["param"]
    )
    master, param = zf.gather_params(state), zf.gather_params(state, "param")
    assert torch.equal(
        master["blocks"][1]["attn"]["qkv"]["w"], param["blocks"][1]["attn"]["qkv"]["w"]
    )
    assert master["blocks"][1]["attn"]["qkv"]["w"].dtype == torch.float32


@pytest.mark.parametrize("clip", [None, 0.5])
def test_no_frozen_row_is_written_after_init(clip, tmp_path):
    """Every frozen row (a wholly frozen stage's, a stage's frozen group's) gets no ``write_`` in
    training; the trainable remainders of the blocks and the head are written."""
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        clip_grad_norm=clip,
        grad_accum=2,
        param_dtype=torch.bfloat16,
    )  # a bf16 copy: param rows written apart
    state = zf.init(
        gpt.model(CFG)._replace(trainable=embed_and_norms_frozen), opt(), config, seed=0
    )
    initial = zf.gather_params(state)
    params, optimizer = (view(state).wrap_tier_(kind, RowWrites) for kind in ("param", "master"))
    for batch in batches(3):
        state, _ = zf.train_step(state, batch)
    zf.flush(state)
    assert {k.split("/")[0] for k, _ in params.rows | optimizer.rows} == {"blocks", "head"}
    assert {k for k, _ in params.rows} == {"blocks/param", "head/param"}
    assert_frozen_unchanged(initial, zf.gather_params(state), embed_and_norms_frozen)
    zf.close(state)


def test_a_block_backward_makes_no_dw_of_a_frozen_linear():
    """The pull-back gives frozen leaves requires_grad=False: autograd skips the dW matmul of each
    of the block's 4 frozen linears, their gradients come back None, every other gradient is bitwise
    the same."""
    model = gpt.model(CFG)
    leaves, treedef = optree.tree_flatten(model.block.init(torch.Generator().manual_seed(0), 0))
    paths = [
        path_str(p)
        for p in optree.tree_paths(model.block.init(torch.Generator().manual_seed(0), 0))
    ]
    carry = model.embed.apply(model.embed.init(torch.Generator().manual_seed(1)), batches(1)[0])
    d_carry = (torch.randn(carry.shape, generator=torch.Generator().manual_seed(2)),)
    frozen = tuple(j for j, p in enumerate(paths) if p.endswith(".w") and not p.startswith("ln"))
    assert len(frozen) == 4  # attn.qkv, attn.proj, mlp.fc, mlp.proj

    def run(still):
        with Matmuls() as mm:
            out = block_vjp(
                model.block.apply,
                leaves,
                lambda ls: optree.tree_unflatten(treedef, list(ls)),
                carry,
                d_carry,
                still,
            )
        return out, mm.count

    (d_all, d_in_all), all_trainable = run(())
    (d_some, d_in_some), some_frozen = run(frozen)
    assert all_trainable - some_frozen == len(frozen)
    assert all(d_some[j] is None for j in frozen)
    assert all(torch.equal(d_some[j], d_all[j]) for j in range(len(leaves)) if j not in frozen)
    assert all(torch.equal(a, b) for a, b in zip(d_in_all, d_in_some, strict=True))


def test_every_apply_sees_frozen_leaves_without_requires_grad():
    """In a training step (the forward's recorded graph, the backward's recompute, the head) every
    frozen leaf an apply sees has requires_grad False and every trainable one True; with the
    embedding frozen, block 0's input carry needs no gradient either and the embedding's backward
    never runs."""
    seen: list[tuple[str, bool, bool]] = []
    base = gpt.model(CFG)

    def watched(stage, s):
        def apply(params, *args):
            if torch.is_grad_enabled():
                tree = params[0] if isinstance(params, tuple) else params
                for path, x in zip(optree.tree_paths(tree), optree.tree_leaves(tree), strict=True):
                    seen.append(
                        (
                            f"{stage}.{path_str(path)}",
                            x.requires_grad,
                            stage == "blocks" and args[0].requires_grad,
                        )
                    )
            return s.apply(params, *args)

        return zf.Stage(s.init, apply)

    model = base._replace(
        embed=watched("embed", base.embed),
        block=watched("blocks", base.block),
        head=watched("head", base.head),
        trainable=only_mlp_trains,
    )
    state = zf.init(model, opt(), zf.Config(grad_accum=2, **FP32))
    state, _ = zf.train_step(state, batches(1)[0])
    assert {p.split(".")[0] for p, _, _ in seen} == {"blocks", "head"}  # no embedding backward
    for path, requires_grad, _ in seen:
        assert requires_grad == (".mlp." in path), path
    assert any(carry for _, _, carry in seen) and not all(
        carry for _, _, carry in seen
    )  # block 0: no d carry


def _lora_state(tmp_path, placement_optimizer: str = "cpu"):
    cfg = llama.Config(
        vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=3, seq_len=16
    )
    lm = lora.apply(llama.model(cfg), rank=4, alpha=8, targets=("attn.q", "attn.v"))
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer=placement_optimizer,
        nvme_path=str(tmp_path),
        param_dtype=torch.bfloat16,
    )
    return cfg, lm, config, zf.init(lm, opt(), config, seed=0)


@pytest.mark.parametrize("optimizer_on", ["cpu", "nvme"])
def test_the_nvme_bytes_a_lora_step_moves_are_exact(optimizer_on, tmp_path):
    """Counted by hand from the rows: forward reads every 16-bit row (the frozen embedding and head
    once, a block's adapters and frozen base each), the backward reads each block's two rows again
    (no embedding: nothing of it trains), except the base layers the fetcher holds; only the
    adapters' rows are written: their bf16 copy, and on NVMe their fp32 master and moments (read in
    backward too). The engine's counters and the planner's traffic both agree. Every row is read
    through the tier's counters, kept rows (``offload.resident``) included."""
    from reference import make_batches

    cfg, lm, config, state = _lora_state(tmp_path, optimizer_on)
    v = view(state)
    assert set(v.groups) == {"embed", "blocks", "blocks:frozen", "head"}
    row = {g: v.shard_numel(g) for g in v.groups}
    layers = cfg.n_layers
    read = 2 * (row["embed"] + row["head"]) + 2 * 2 * layers * (
        row["blocks"] + row["blocks:frozen"]
    )
    written = 2 * layers * row["blocks"]
    if (
        optimizer_on == "nvme"
    ):  # master, m, v of the adapters: fp32, read and written once per step; the
        read += (
            3 * 4 * layers * row["blocks"]
        )  # master read ahead is lent to the backward fetch, which casts it
        written += 3 * 4 * layers * row["blocks"]  # instead of reading the adapters' bf16 row again
        read -= 2 * layers * row["blocks"]
    # the fetcher holds the frozen embedding's and block 0's base layers from their first fetch on
    # (optim.passes.holds_layer): the first step reads them in its forward only, later steps not at
    # all; each step's backward reads the next step's block 1 base early (Fetcher.read_early): the
    # first step, as many bytes as a step with nothing held
    first = read
    read -= 2 * (row["embed"] + 2 * row["blocks:frozen"])
    traffic = zf.estimate(lm, opt(), config).moved["nvme"]
    for i, batch in enumerate(make_batches(cfg, 3, batch_size=2, seed=1)):
        state, metrics = zf.train_step(state, batch)
        assert (metrics["bytes_read.nvme"], metrics["bytes_written.nvme"]) == (
            first if i == 0 else read,
            written,
        )
    assert view(state).counters().held_layers == 2
    assert traffic == read + written
    base = sum(g.spec.numel * g.rows for name, g in v.groups.items() if name != "blocks")
    adapters = v.groups["blocks"].spec.numel * layers
    assert adapters < 0.1 * base
    if (
        optimizer_on == "cpu"
    ):  # the adapters' states in RAM: the bf16 base read twice, and the adapters' rows
        assert (read + written) / base < 4.2
    zf.close(state)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_a_checkpoint_of_frozen_groups_saves_restores_and_exports(param_dtype, tmp_path):
    """A frozen group is saved as its param array only; restored, training goes on bitwise as
    without the save; the consolidated export names every leaf (frozen ones from their 16-bit copy).
    With fp32 params a trained group's param array is its master, a frozen group's its own: both
    restore."""
    from safetensors.torch import load_file

    import checkpoints
    from zinf_fn.tree import path_str

    config = zf.Config(offload_params="cpu", offload_optimizer="cpu", param_dtype=param_dtype)
    model = gpt.model(CFG)._replace(trainable=embed_and_norms_frozen)
    data = batches(4)
    state = zf.init(model, opt(), config, seed=0)
    for batch in data[:2]:
        state, _ = zf.train_step(state, batch)
    checkpoints.save(str(tmp_path / "ckpt"), state)
    arrays = {e["name"] for e in checkpoints.read_manifest(str(tmp_path / "ckpt"))["arrays"]}
    assert {"embed/param", "blocks--frozen/param", "head--frozen/param"} <= arrays
    assert not any(
        a.startswith(("embed/", "blocks--frozen/", "head--frozen/")) and not a.endswith("/param")
        for a in arrays
    )
    restored = checkpoints.restore(str(tmp_path / "ckpt"), model, opt(), config)
    for batch in data[2:]:
        state, _ = zf.train_step(state, batch)
        restored, _ = zf.train_step(restored, batch)
    want, got = zf.gather_params(state), zf.gather_params(restored)
    assert all(
        torch.equal(a, b)
        for a, b in zip(optree.tree_leaves(want), optree.tree_leaves(got), strict=True)
    )
    checkpoints.export(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    exported = load_file(str(tmp_path / "out.safetensors"))
    saved = zf.gather_params(checkpoints.restore(str(tmp_path / "ckpt"), model, opt(), config))
    tree = {
        "embed": saved["embed"],
        "head": saved["head"],
        **{f"blocks.{i}": b for i, b in enumerate(saved["blocks"])},
    }
    for path, leaf in zip(optree.tree_paths(tree), optree.tree_leaves(tree), strict=True):
        assert torch.equal(exported[path_str(path)], leaf), path_str(path)


def test_a_written_frozen_row_is_fetched_anew(tmp_path):
    """After a step the fetcher holds the frozen embedding's and block 0's base layers
    (passes.holds_layer) and has the next step's first other frozen read (block 1's) under way
    (``Fetcher.read_early``). Writing the rows of blocks 0 and 1 (``StateView.write_``) gives the
    held layer and the early read back: the next step computes with the new weights, as the same
    state flushed before the writes (no early read), and a state restored from its checkpoint (a new
    engine, nothing held) evaluates the same."""
    from reference import make_batches

    import checkpoints

    batches = make_batches(
        llama.Config(
            vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=3, seq_len=16
        ),
        2,
        batch_size=2,
        seed=1,
    )
    runs = {}
    for name in ("unflushed", "flushed"):
        (tmp_path / name).mkdir()
        cfg, lm, config, state = _lora_state(tmp_path / name)
        state, _ = zf.train_step(state, batches[0])
        v = view(state)
        assert v.counters().held_layers == 2
        if name == "flushed":
            zf.flush(state)
        gen = torch.Generator().manual_seed(3)
        for row in (0, 1):
            v.write_(
                "param",
                "blocks:frozen",
                row,
                torch.randn(v.shard_numel("blocks:frozen"), generator=gen).to(torch.bfloat16),
            ).result()
        assert v.counters().held_layers == 1
        state, metrics = zf.train_step(state, batches[1])
        runs[name] = (state, metrics["loss"], config, lm)
    assert runs["unflushed"][1] == runs["flushed"][1]
    state, _, config, lm = runs["unflushed"]
    checkpoints.save(str(tmp_path / "ckpt"), state)
    (tmp_path / "r").mkdir()
    restored = checkpoints.restore(
        str(tmp_path / "ckpt"),
        lm,
        opt(),
        dataclasses.replace(config, nvme_path=str(tmp_path / "r")),
    )
    assert zf.eval_step(restored, batches[0]) == zf.eval_step(state, batches[0])
    for s in (restored, state, runs["flushed"][0]):
        zf.close(s)
