"""Frozen base weights stored int8 or NF4 (``Config(frozen_storage=)``, ``zinf_fn.formats.frozen``,
``zinf_fn.formats.codebook``).

The exact reference of a quantized base is the same model whose frozen weights *are* their
dequantized values, stored bf16 (bf16 holds them exactly: they are rounded to bf16 when
dequantized): the same numbers go into the same fp32 kernels in the same order, so losses and
weights agree bitwise. The base itself is checked against bitsandbytes' own quantize_4bit /
dequantize_4bit of the bf16 weights init wrote, bitwise. Bytes are counted from the rows, as
tests/engine/test_frozen_storage.py counts them.
"""

from __future__ import annotations

import optree
import pytest
import torch
from dist_utils import rank_part
from reference import make_batches

import checkpoints
import zinf_fn as zf
from layers import llama, lora, moe
from zinf_fn.formats import codebook
from zinf_fn.state import view
from zinf_fn.tree import path_str

CFG = llama.Config(
    vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=3, seq_len=16
)
STEPS = 3


def opt():
    return zf.adamw(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def lora_model(cfg=CFG):
    return lora.apply(llama.model(cfg), rank=4, alpha=8, targets=("attn.q", "attn.v"))


def leaves(tree) -> dict[str, torch.Tensor]:
    paths, xs, _ = optree.tree_flatten_with_path(tree)
    return {path_str(p): x for p, x in zip(paths, xs, strict=True)}


def twin(state, config: zf.Config):
    """A bf16-stored state whose every weight is ``state``'s (its base dequantized): the exact
    reference."""
    values = zf.gather_params(state)
    out = zf.init(state.model, opt(), config, seed=0)
    v = view(out)
    for unit in zf.state.units(v.n_layers):
        tree = values[unit.group][unit.row] if unit.group == "blocks" else values[unit.group]
        flat = leaves(tree)
        v.load_unit_(unit, lambda path, flat=flat: flat[path])
    return out


def train(state, n: int = STEPS):
    losses = []
    for batch in make_batches(CFG, n, batch_size=2, seed=1):
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
    return state, losses


def frozen_linears(params) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{p}": x
        for i, b in enumerate(params["blocks"])
        for p, x in leaves(b).items()
        if x.dim() == 2 and "lora" not in p
    }


@pytest.mark.parametrize("storage", ["nf4", "int8"])
@pytest.mark.parametrize("placement", ["none", "nvme"])
def test_a_quantized_base_trains_as_its_dequantized_bf16_twin(storage, placement, tmp_path):
    paths = [tmp_path / "q", tmp_path / "ref"]
    for path in paths:
        path.mkdir()
    kw = [
        dict(offload_params=placement, nvme_path=str(p)) if placement == "nvme" else {}
        for p in paths
    ]
    quantized = zf.init(lora_model(), opt(), zf.Config(frozen_storage=storage, **kw[0]), seed=0)
    reference = twin(quantized, zf.Config(**kw[1]))
    quantized, losses = train(quantized)
    reference, want = train(reference)
    assert losses == want  # bitwise: the same numbers in
    got, ref = leaves(zf.gather_params(quantized)), leaves(zf.gather_params(reference))
    assert all(torch.equal(got[p], ref[p]) for p in ref)
    zf.close(quantized)
    zf.close(reference)


def test_the_nf4_base_is_bitsandbytes_of_the_bf16_base():
    """Rows of 64 inputs: bitsandbytes' CPU dequantize_4bit kernel takes a weight's blocks row by
    row, so for rows shorter than a block (the 32 of ``CFG``) it reads other scales than its own
    quantize_4bit wrote."""
    import bitsandbytes.functional as bnb  # a dev dependency: the reference, never skipped

    cfg = llama.Config(
        vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, n_layers=2, seq_len=16
    )
    plain = frozen_linears(
        zf.gather_params(zf.init(lora_model(cfg), opt(), zf.Config(), seed=0), "param")
    )
    ours = frozen_linears(
        zf.gather_params(zf.init(lora_model(cfg), opt(), zf.Config(frozen_storage="nf4"), seed=0))
    )
    assert (
        len(ours) == 7 * cfg.n_layers
    )  # q, k, v, o, gate, up, down (q's and v's base under their adapters)
    for path, w in plain.items():
        w16 = w.to(torch.bfloat16)
        packed, qs = bnb.quantize_4bit(
            w16, blocksize=64, quant_type="nf4", compress_statistics=False
        )
        assert torch.equal(ours[path], bnb.dequantize_4bit(packed, qs).float()), path


@pytest.mark.parametrize("storage", ["nf4", "int8"])
def test_the_bytes_of_a_quantized_base(storage, tmp_path):
    """The frozen row is its leaves' codes and scales (norms as bf16); the state, the planner's
    states and the NVMe bytes a step moves all drop by the rows' difference, exactly."""
    config = dict(offload_params="nvme", offload_optimizer="cpu", nvme_path=str(tmp_path))
    plain = zf.init(lora_model(), opt(), zf.Config(**config), seed=0)
    (tmp_path / "q").mkdir()
    small_config = zf.Config(frozen_storage=storage, **{**config, "nvme_path": str(tmp_path / "q")})
    small = zf.init(lora_model(), opt(), small_config, seed=0)
    p, q = view(plain), view(small)
    spec = q.frozen.splits["blocks"].spec
    want = sum(
        -(
            -(codebook.leaf_nbytes(storage, leaf.numel) if len(leaf.shape) == 2 else 2 * leaf.numel)
            // 4
        )
        * 4
        for leaf in spec.leaves
    )
    assert (
        q.dtype("param", "blocks:frozen") == torch.uint8 and q.shard_numel("blocks:frozen") == want
    )
    saved = CFG.n_layers * (2 * p.shard_numel("blocks:frozen") - want)
    assert p.state_bytes() - q.state_bytes() == saved
    assert (
        sum(
            zf.estimate(
                lora_model(), opt(), zf.Config(frozen_storage=storage, **config)
            ).states.values()
        )
        == q.state_bytes()
    )
    traffic = zf.estimate(lora_model(), opt(), zf.Config(frozen_storage=storage, **config)).moved[
        "nvme"
    ]
    for batch in make_batches(
        CFG, 2, batch_size=2, seed=1
    ):  # the second step's bytes: the planner's per step
        plain, before = zf.train_step(plain, batch)
        small, after = zf.train_step(small, batch)
    # each block's row, forward and back, but block 0's: its layer is held from the first step
    # (passes.holds_layer)
    assert (
        before["bytes_read.nvme"] - after["bytes_read.nvme"]
        == 2 * saved * (CFG.n_layers - 1) // CFG.n_layers
    )
    assert after["bytes_read.nvme"] + after["bytes_written.nvme"] == traffic
    zf.close(plain)
    zf.close(small)


def test_a_quantized_checkpoint_round_trips_bitwise(tmp_path):
    config = zf.Config(offload_params="cpu", frozen_storage="nf4")
    state, _ = train(zf.init(lora_model(), opt(), config, seed=0), 1)
    checkpoints.save(str(tmp_path / "ckpt"), state)
    restored = checkpoints.restore(str(tmp_path / "ckpt"), lora_model(), opt(), config)
    v, r = view(state), view(restored)
    for row in v.rows():
        if row.group == "blocks:frozen":
            assert torch.equal(v.gather_row("param", row.unit), r.gather_row("param", row.unit))
    state, want = train(state, 2)
    restored, got = train(restored, 2)
    assert got == want


def test_exports_write_the_dequantized_base(tmp_path):
    """``to_hf(merge_lora=True)`` and ``to_peft`` of an nf4 base are those of its dequantized bf16
    twin."""
    from safetensors.torch import load_file

    quantized = zf.init(lora_model(), opt(), zf.Config(frozen_storage="nf4"), seed=0)
    reference = twin(quantized, zf.Config())
    for name, state in (("q", quantized), ("ref", reference)):
        checkpoints.to_hf(state, str(tmp_path / name / "hf"), merge_lora=True)
        checkpoints.to_peft(state, str(tmp_path / name / "peft"))
    for sub, file in (("hf", "model.safetensors"), ("peft", "adapter_model.safetensors")):
        got, want = (load_file(str(tmp_path / n / sub / file)) for n in ("q", "ref"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_bad_frozen_storage_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"Config.frozen_storage='fp4' is not a frozen weights' storage; expected"
    ):
        zf.Config(frozen_storage="fp4")
    odd = llama.Config(
        vocab_size=64, d_model=24, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2, seq_len=16
    )
    with pytest.raises(
        ValueError,
        match=r"frozen weight blocks.attn.k.w of shape \(12, 24\) has 288 elements, "
        r"not a multiple of the block of 64",
    ):
        zf.init(lora_model(odd), opt(), zf.Config(frozen_storage="nf4"))


def test_from_hf_quantizes_the_imported_base(tmp_path):
    """``from_hf`` fills the frozen row from the HF tensors: the nf4 base is bitsandbytes' nf4 of
    their bf16 copy, exactly the base a bf16 import holds quantized (the same ``encode_leaf`` of the
    same 16-bit values)."""
    from hf_reference import hf_model

    hf_model("llama3").save_pretrained(tmp_path / "hf")

    def imported(storage: str):
        _, state = checkpoints.from_hf(
            str(tmp_path / "hf"),
            opt(),
            zf.Config(frozen_storage=storage),
            transform=lambda m: lora.apply(m, rank=4, alpha=8, targets=("attn.q", "attn.v")),
        )
        return state

    plain = frozen_linears(zf.gather_params(imported("bf16"), "param"))
    ours = frozen_linears(zf.gather_params(imported("nf4")))
    assert ours.keys() == plain.keys() and ours
    for path, w in plain.items():
        w16 = w.to(torch.bfloat16)
        want = codebook.decode_leaf(
            "nf4", codebook.encode_leaf("nf4", w16), tuple(w.shape), torch.bfloat16
        )
        assert torch.equal(ours[path], want.float()), path


def test_a_quantized_checkpoint_restores_only_as_it_is_stored(tmp_path):
    state = zf.init(lora_model(), opt(), zf.Config(frozen_storage="nf4"), seed=0)
    checkpoints.save(str(tmp_path / "ckpt"), state)
    with pytest.raises(
        checkpoints.CheckpointError,
        match=r"config.frozen_storage: the checkpoint stores its frozen "
        r"weights as 'nf4', this state as 'bf16'; restore it with "
        r"zf.Config\(frozen_storage='nf4'\)",
    ):
        checkpoints.restore(str(tmp_path / "ckpt"), lora_model(), opt(), zf.Config())
    with pytest.raises(
        checkpoints.CheckpointError,
        match=r"param_dtype: a checkpoint whose frozen weights are stored "
        r"'nf4' restores in its own param_dtype \(bfloat16",
    ):
        checkpoints.restore(
            str(tmp_path / "ckpt"),
            lora_model(),
            opt(),
            zf.Config(frozen_storage="nf4", param_dtype=torch.float32),
        )
    with pytest.raises(
        checkpoints.CheckpointError,
        match=r"its frozen weights are stored 'nf4' .* checkpoints.to_hf",
    ):
        checkpoints.export(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))


def test_hf_export_command_of_a_quantized_lora_checkpoint_writes_the_dequantized_merge(tmp_path):
    """``python -m checkpoints hf export`` restores the checkpoint's frozen storage and writes what
    ``to_hf`` of the live nf4 state writes (the dequantized base, merged), bitwise."""
    from safetensors.torch import load_file

    from checkpoints.hf_cli import main as hf_main

    state, _ = train(zf.init(lora_model(), opt(), zf.Config(frozen_storage="nf4"), seed=0), 1)
    checkpoints.to_hf(state, str(tmp_path / "live"), torch.float32)
    hf_config = checkpoints.hf_files.read_config(str(tmp_path / "live"))
    checkpoints.save(str(tmp_path / "ckpt"), state, extra={"hf_config": hf_config})
    hf_main(
        [
            "export",
            str(tmp_path / "ckpt"),
            str(tmp_path / "cli"),
            "--dtype",
            "fp32",
            "--lora-alpha",
            "8",
        ]
    )
    live, cli = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("live", "cli"))
    assert set(live) == set(cli) and all(torch.equal(live[name], cli[name]) for name in live)


def test_only_the_blocks_linears_are_quantized():
    """The embedding and head stay 16-bit even where partly frozen (a "head:frozen" group), and a
    blocks' frozen group of norms only stays 16-bit; ``zf.plan`` says which weights are
    quantized."""
    from layers import gpt

    cfg = gpt.Config(vocab_size=64, d_model=32, n_heads=2, n_layers=2, seq_len=16)
    frozen = {
        "blocks.0.ln1.w",
        "head.lm_head.w",
    }  # a norm (1-D) in every block, and the LM head (2-D)
    model = gpt.model(cfg)._replace(
        trainable=lambda p: p.replace("blocks.1.", "blocks.0.") not in frozen
    )
    v = view(zf.init(model, opt(), zf.Config(frozen_storage="nf4")))
    assert [leaf.path for leaf in v.groups["head:frozen"].spec.leaves] == ["lm_head.w"]
    assert {g: v.dtype("param", g) for g in v.groups if ":" in g} == {
        "blocks:frozen": torch.bfloat16,
        "head:frozen": torch.bfloat16,
    }
    state = zf.init(lora_model(), opt(), zf.Config(frozen_storage="nf4"))
    assert (
        "blocks 9 of 13 leaves (in blocks:frozen, a param row only, its 2-D weights nf4)"
        in zf.plan(state)
    )


def _quantized_world(rank: int, world: int) -> dict:
    """Per partition mode: (losses, final weights) of an nf4 base's LoRA run in a world of ``world``
    (rank's slice): the byte row is sharded (allgather: every rank a slice of the bytes; broadcast:
    whole rows by owner)."""
    out = {}
    for partition in ("allgather", "broadcast"):
        config = zf.Config(
            offload_params="cpu", offload_optimizer="cpu", partition=partition, frozen_storage="nf4"
        )
        state, losses = zf.init(lora_model(), opt(), config, seed=0), []
        for batch in make_batches(CFG, 2, batch_size=4, seed=1):
            state, metrics = zf.train_step(state, rank_part(batch, rank, world))
            losses.append(metrics["loss"])
        out[partition] = (losses, leaves(zf.gather_params(state)))
    return out


def test_a_quantized_base_in_a_world_of_two_trains_as_a_world_of_one():
    """Tolerances as tests/partition/test_distributed.py (another summation order over ranks); the
    base bitwise."""
    from dist_utils import assert_like_world_of_one, run_world

    assert_like_world_of_one(_quantized_world(0, 1), run_world(2, _quantized_world))


MOE = llama.Config(
    vocab_size=64,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    d_ff=48,
    n_layers=2,
    seq_len=16,
    moe=moe.Config(n_experts=4, top_k=2, d_model=32, d_ff=32),
)


@pytest.mark.parametrize("storage", ["nf4", "int8"])
def test_a_quantized_moe_base_trains_as_its_dequantized_bf16_twin(storage):
    """The stacked experts (3-D leaves: (E, 2I, D), (E, D, I)) are stored as codes too, as the 2-D
    linears are: the LoRA step over the quantized base is bitwise the step over its dequantized bf16
    twin (the same numbers in), and the frozen row holds codes, not 16-bit values, for them."""
    model = lora_model(MOE)
    quantized = zf.init(model, opt(), zf.Config(frozen_storage=storage), seed=0)
    reference = twin(quantized, zf.Config())
    quantized, losses = train(quantized)
    reference, want = train(reference)
    assert losses == want
    got, ref = leaves(zf.gather_params(quantized)), leaves(zf.gather_params(reference))
    assert all(torch.equal(got[p], ref[p]) for p in ref)
    experts = [p for p in ref if ".experts." in p]
    assert experts and all(got[p].dim() == 3 for p in experts)
    bf16 = view(zf.init(model, opt(), zf.Config(), seed=0)).state_bytes()
    small = view(quantized).state_bytes()
    expert_values = sum(got[p].numel() for p in experts)
    # int8: 1 + 4/64 bytes a weight, nf4: 0.5 + 4/64, against bf16's 2 (the experts are most of it)
    saved = {"int8": 2 - 1 - 4 / 64, "nf4": 2 - 0.5 - 4 / 64}[storage]
    assert bf16 - small >= saved * expert_values
    zf.close(quantized)
    zf.close(reference)
