"""Qwen3-MoE, Mixtral, OLMoE and gpt-oss through ``checkpoints.from_hf`` / ``to_hf`` /
``to_peft``, against transformers and PEFT (tiny random fp32 models, tests/hf_reference.py's
MOE_FAMILIES).

Tolerances (test_dense_families' reasoning): logits and eval loss are the same fp32 ops on the same
values (the experts grouped per expert sum each token's k outputs in HF's order), so 1e-5 relative;
training, world 1: the engine equals autograd + ``torch.optim.AdamW(fused=True)`` to rounding,
losses 1e-5 relative, weights 1e-5 absolute (0.3% of one step's move at lr 3e-3); world 2 averages
gradients in another order: weights 1e-4, losses 1e-6 relative. Storage moves are bitwise.
"""

from __future__ import annotations

import dataclasses
import json
import re
from functools import partial

import pytest
import torch
import transformers
from hf_reference import (
    engine_config,
    full_tree,
    hf_loss,
    hf_model,
    hf_tensors,
    train_engine,
    tree_paths,
)
from hf_workers import (
    adamw,
    assert_world_two_trains_like_world_one,
    fp32_config,
    import_train_export,
    save_hf,
)
from llama_reference import train_hf
from peft_reference import assert_adapter_loads, our_leaves, peft_model
from reference import make_batches
from safetensors.torch import load_file

import checkpoints
import zinf_fn as zf
from layers import llama, lora

MOE = ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"]
ATTN = ("attn.q", "attn.k", "attn.v", "attn.o")
RANK, ALPHA = 2, 4.0


@pytest.mark.parametrize("family", [*MOE, "qwen3_moe_aux", "qwen3_moe_w4", "olmoe_clip"])
def test_import_equals_transformers_and_exports_the_source(family, tmp_path):
    """Logits, eval loss (with the aux loss: HF's output_router_logits=True loss) and the tensors
    equal transformers'; fp32 in, fp32 out is the source bitwise, per-expert names included."""
    hf = save_hf(family, tmp_path / "hf")
    model, state = checkpoints.from_hf(str(tmp_path / "hf"), adamw(), fp32_config())
    cfg = model.config
    assert cfg == engine_config(hf) and cfg.moe is not None
    assert cfg.aux_loss == (family == "qwen3_moe_aux")
    params = zf.gather_params(state)
    assert all(torch.equal(tree_paths(params)[p], t) for p, t in hf_tensors(hf).items())
    batch = make_batches(cfg, 1, batch_size=3, seed=0)[0]
    with torch.no_grad():
        want, want_loss = hf(input_ids=batch["inputs"]).logits, hf_loss(hf, batch)
    torch.testing.assert_close(
        llama.logits(params, cfg, batch["inputs"]), want, rtol=1e-5, atol=1e-5
    )
    assert zf.eval_step(state, batch) == pytest.approx(want_loss.item(), rel=1e-5)
    checkpoints.to_hf(state, str(tmp_path / "out"), "fp32")
    theirs, ours = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "out"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[name], want) for name, want in theirs.items())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert llama.Config.from_hf(written) == cfg


@pytest.mark.parametrize(
    ("family", "placement"),
    [
        ("qwen3_moe", "none"),
        ("mixtral", "cpu"),
        ("olmoe", "nvme"),
        ("gpt_oss", "cpu"),
        ("qwen3_moe_aux", "cpu"),
        ("olmoe_clip", "none"),
    ],
)
def test_training_equals_transformers_adamw(family, placement, tmp_path):
    hf, _, final = import_train_export(family, placement, tmp_path)  # random targets: need not fall
    start = hf_tensors(hf)
    assert all(not torch.equal(final[p], start[p]) for p in final if ".experts." in p)


def test_world_two_trains_like_world_one_and_writes_the_same_files(tmp_path):
    assert_world_two_trains_like_world_one("mixtral", tmp_path)


def test_gpt_oss_bf16_checkpoint(tmp_path):
    """A bf16 gpt-oss checkpoint (what gpt-oss ships beside MXFP4): its export before training, in
    the dtype it came in (to_hf's default), is the source file bitwise; the engine's fp32 masters
    hold its values exactly (bf16 -> fp32 is exact), so fp32 logits, eval loss and 3 AdamW steps
    equal transformers' fp32 run of the same values within the module's fp32 tolerances; the
    engine's default bf16 parameter copy holds them losslessly (its eval equals too). Not compared:
    both sides computing in bf16, whose different sum orders differ by bf16 rounding, and where a
    token's top-k experts can flip: transformers' own bf16 logits differ from its fp32 ones by up to
    0.5 relative on these tiny models, a bound that would hide any import error."""
    save_hf("gpt_oss", tmp_path / "hf", torch.bfloat16)
    # read as a user would: fp32 weights holding the bf16 values, rope buffers computed in fp32 (a
    # bf16 model's .float() keeps its bf16-rounded inv_freq, another rope)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32
    )
    model, state = checkpoints.from_hf(str(tmp_path / "hf"), adamw(), fp32_config())
    cfg = model.config
    assert cfg.hf_dtype == "bfloat16"
    checkpoints.to_hf(state, str(tmp_path / "out"))
    theirs, ours = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "out"))
    assert sorted(ours) == sorted(theirs) and {t.dtype for t in ours.values()} == {torch.bfloat16}
    assert all(torch.equal(ours[name], want) for name, want in theirs.items())
    batches = make_batches(cfg, 3, batch_size=4, seed=1)
    with torch.no_grad():
        want, want_loss = hf(input_ids=batches[0]["inputs"]).logits, hf_loss(hf, batches[0])
    params = zf.gather_params(state)
    torch.testing.assert_close(
        llama.logits(params, cfg, batches[0]["inputs"]), want, rtol=1e-5, atol=1e-5
    )
    assert zf.eval_step(state, batches[0]) == pytest.approx(want_loss.item(), rel=1e-5)
    _, bf16_copy = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),  # fp32 compute on CPU
        zf.Config(param_dtype=torch.bfloat16),
    )
    assert zf.eval_step(bf16_copy, batches[0]) == pytest.approx(want_loss.item(), rel=1e-5)
    ref_losses = train_hf(hf, batches)
    state, losses, final = train_engine(state, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for path, want in hf_tensors(hf).items():
        assert (final[path] - want).abs().max() <= 1e-5, path


def test_olmoe_clip_qkv_bites():
    """The clamp changes the logits far beyond the 1e-5 the import test allows: without it they
    would differ from transformers'."""
    clipped = hf_model("olmoe_clip")
    cfg = engine_config(clipped)
    assert cfg.clip_qkv == 0.1
    batch = make_batches(cfg, 1, batch_size=3, seed=0)[0]
    tree = full_tree({n: t.detach() for n, t in clipped.state_dict().items()}, cfg.n_layers, cfg)
    with torch.no_grad():
        want = clipped(input_ids=batch["inputs"]).logits
        unclipped = llama.logits(tree, dataclasses.replace(cfg, clip_qkv=None), batch["inputs"])
    assert (unclipped - want).abs().max() > 1e-2


def test_qwen3_moe_window_needs_use_sliding_window():
    """As ``Qwen3MoeConfig``: a sliding_window with use_sliding_window false is no window."""
    hf = hf_model("qwen3_moe_w4").config.to_dict()
    assert llama.Config.from_hf(hf).sliding_window == 4
    assert llama.Config.from_hf({**hf, "use_sliding_window": False}).sliding_window is None


@pytest.mark.parametrize(
    ("family", "changes", "field"),
    [
        (
            "qwen3_moe",
            {"model_type": "deepseek_v3", "first_k_dense_replace": 3},
            "first_k_dense_replace",
        ),
        ("qwen3_moe", {"model_type": "kimi_k2", "kv_lora_rank": 512}, "kv_lora_rank"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        (
            "mixtral",
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            "quantization_config.quant_method",
        ),
        ("mixtral", {"clip_qkv": 8.0}, "clip_qkv"),  # OLMoE's field: Mixtral does not clamp
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("mixtral", {"model_type": "dbrx"}, "model_type"),
    ],
)
def test_from_hf_refuses_by_field_name(family, changes, field, tmp_path):
    save_hf(family, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(checkpoints.CheckpointError, match=rf"config\.json: {re.escape(field)}"):
        checkpoints.from_hf(str(tmp_path), adamw(), fp32_config())


def test_gpt_oss_mxfp4_experts_read_as_transformers_dequantizes(tmp_path):
    """A gpt-oss checkpoint whose experts are MXFP4 ``*_blocks``/``*_scales`` (packed here, random
    codes) imports as the same checkpoint holding transformers' ``convert_moe_packed_tensors`` of
    them; its export is unquantized (no quantization_config)."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    save_hf("gpt_oss_i32", tmp_path / "plain")
    tensors = load_file(str(tmp_path / "plain" / "model.safetensors"))
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    gen = torch.Generator().manual_seed(4)
    packed = dict(tensors)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        n_experts, d_in, d_out = tensors[name].shape  # input x output; blocks of 32 inputs
        blocks = torch.randint(
            0, 256, (n_experts, d_out, d_in // 32, 16), generator=gen, dtype=torch.uint8
        )
        scales = torch.randint(
            117, 137, (n_experts, d_out, d_in // 32), generator=gen, dtype=torch.uint8
        )  # exponents -10 .. 9
        del packed[name]
        packed.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    for directory, content, quant in (
        ("mxfp4", packed, {"quant_method": "mxfp4"}),
        ("dequantized", tensors, None),
    ):
        (tmp_path / directory).mkdir()
        save_file(
            content, str(tmp_path / directory / "model.safetensors"), metadata={"format": "pt"}
        )
        (tmp_path / directory / "config.json").write_text(
            json.dumps({**config, "quantization_config": quant})
        )
    _, state = checkpoints.from_hf(str(tmp_path / "mxfp4"), adamw(), fp32_config())
    _, want = checkpoints.from_hf(str(tmp_path / "dequantized"), adamw(), fp32_config())
    got = tree_paths(zf.gather_params(state))
    assert all(torch.equal(got[p], t) for p, t in tree_paths(zf.gather_params(want)).items())
    checkpoints.to_hf(
        state,
        str(tmp_path / "out"),
        torch.float32,
        hf_config=json.loads((tmp_path / "mxfp4" / "config.json").read_text()),
    )
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(ours) == sorted(tensors)
    assert all(torch.equal(ours[name], want) for name, want in tensors.items())


EXPERTS = ("mlp.experts.gate_up", "mlp.experts.down")
PEFT_ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
PEFT_EXPERTS = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


@pytest.mark.parametrize("family", MOE)
def test_lora_on_attention_and_experts_equals_peft_step_by_step(family, tmp_path):
    """LoRA on q, k, v, o and the stacked experts: every step's loss and the trained factors equal
    PEFT's (target_modules + target_parameters) + AdamW(fused); to_peft writes PEFT's own file
    (names, shapes, config), which PeftModel.from_pretrained reads as our factors bitwise and whose
    logits are ours; from_peft reads PEFT's own adapter bitwise."""
    save_hf(family, tmp_path / "hf")
    lm, state = checkpoints.from_hf(
        str(tmp_path / "hf"), adamw(), fp32_config(), transform=lora_transform(ATTN + EXPERTS)
    )
    ref = peft_model(family, lm, state, PEFT_ATTN, RANK, ALPHA, PEFT_EXPERTS)
    batches = make_batches(lm.config.base, 3, batch_size=4, seed=1)
    ref_losses = train_hf(ref, batches)
    state, losses, final = train_engine(state, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for path, want in our_leaves(lm, ref).items():
        assert (final[path] - want).abs().max() <= 1e-5, path
    checkpoints.to_peft(state, str(tmp_path / "ours"))
    ref.save_pretrained(str(tmp_path / "theirs"))
    ours, theirs = (
        load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("ours", "theirs")
    )
    assert {n: t.shape for n, t in ours.items()} == {n: t.shape for n, t in theirs.items()}
    configs = [
        json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "theirs")
    ]
    for key in ("target_modules", "target_parameters"):
        assert sorted(configs[0][key]) == sorted(configs[1][key]), key
    loaded = assert_adapter_loads(family, lm, str(tmp_path / "ours"), final)
    inputs = batches[0]["inputs"]
    params = zf.gather_params(state)
    blocks = [lora.bind(lm.config, b) for b in params["blocks"]]
    with torch.no_grad():
        want = loaded(input_ids=inputs).logits
    got = llama.logits({**params, "blocks": blocks}, lm.config.base, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _, fresh = checkpoints.from_hf(
        str(tmp_path / "hf"), adamw(), fp32_config(), transform=lora_transform(ATTN + EXPERTS)
    )
    read = tree_paths(zf.gather_params(checkpoints.from_peft(str(tmp_path / "theirs"), fresh)))
    assert all(torch.equal(read[p], t) for p, t in our_leaves(lm, ref).items())


def lora_transform(targets: tuple[str, ...]):
    """``from_hf``'s transform: LoRA of rank RANK, alpha ALPHA on ``targets``."""
    return partial(lora.apply, rank=RANK, alpha=ALPHA, targets=targets)


@pytest.mark.parametrize("targets", [("mlp.experts.down",), ("attn.o", "mlp.experts.gate_up")])
def test_one_expert_target_loads_in_peft(targets, tmp_path):
    """One adapted expert tensor: no nesting, PEFT names its factors without base_layer."""
    save_hf("gpt_oss", tmp_path / "hf")
    lm, state = checkpoints.from_hf(
        str(tmp_path / "hf"), adamw(), fp32_config(), transform=lora_transform(targets)
    )
    state, _, final = train_engine(state, make_batches(lm.config.base, 1, batch_size=2, seed=2))
    checkpoints.to_peft(state, str(tmp_path / "adapter"))
    names = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert not any("base_layer" in n for n in names)
    assert_adapter_loads("gpt_oss", lm, str(tmp_path / "adapter"), final)


def test_peft_refusals_name_the_targets(tmp_path):
    """The router has no PEFT form (to_peft names it); an adapter whose target_parameters adapt
    the experts does not load into a state adapting the attention only (from_peft names both
    fields)."""
    save_hf("mixtral", tmp_path / "hf")
    _, state = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config(),
        transform=lora_transform(("attn.q", "mlp.router")),
    )
    with pytest.raises(checkpoints.CheckpointError, match=r"LoRA targets \['mlp\.router'\]"):
        checkpoints.to_peft(state, str(tmp_path / "router"))
    _, state = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config(),
        transform=lora_transform(("attn.q",) + EXPERTS),
    )
    checkpoints.to_peft(state, str(tmp_path / "experts"))
    _, attention_only = checkpoints.from_hf(
        str(tmp_path / "hf"), adamw(), fp32_config(), transform=lora_transform(("attn.q",))
    )
    with pytest.raises(
        checkpoints.CheckpointError,
        match=r"target_parameters \['mlp\.experts\.down_proj', "
        r"'mlp\.experts\.gate_up_proj'\]\) adapt",
    ):
        checkpoints.from_peft(str(tmp_path / "experts"), attention_only)


def test_lora_on_experts_merges_per_expert(tmp_path):
    """to_hf merges each expert's adapter into its weights as PEFT's merge does: B @ A per
    expert."""
    save_hf("qwen3_moe", tmp_path / "hf")
    lm, state = checkpoints.from_hf(
        str(tmp_path / "hf"), adamw(), fp32_config(), transform=lora_transform(EXPERTS)
    )
    state, _, final = train_engine(state, make_batches(lm.config.base, 2, batch_size=2, seed=1))
    checkpoints.to_hf(state, str(tmp_path / "merged"), torch.float32)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    up = final["blocks.0.mlp.experts.gate_up.w"] + torch.bmm(
        final["blocks.0.mlp.experts.gate_up.lora_b"], final["blocks.0.mlp.experts.gate_up.lora_a"]
    ) * (ALPHA / RANK)
    assert torch.equal(hf_tensors(merged)["blocks.0.mlp.experts.gate_up.w"], up)
