"""Qwen3, Phi-3, Gemma 3 text and sliding windows shorter than the sequence (Mistral, Qwen2, Gemma
3's local layers) through ``checkpoints.from_hf`` / ``to_hf`` / ``to_peft``, against transformers
and PEFT.

Tolerances (the reasoning of tests/models/test_hf_import.py, whose helpers these tests share):
- Logits and eval loss: both sides run the same fp32 ops on the same values, so they agree to fp32
rounding;
  ``rtol = atol = 1e-5`` on logits of size ~1 (a wrong norm, window or rope moves them ~1e-2).
- Training, world 1: the engine equals autograd + ``torch.optim.AdamW(fused=True)`` to rounding;
losses
  1e-5 relative and weights 1e-5 absolute (0.3% of one step's move at lr 3e-3). World 2 averages
  gradients in another order: weights 1e-4, losses 1e-6 relative
  (tests/partition/test_distributed.py).
- Storage moves (from_hf -> to_hf in fp32, the trained masters into transformers) are compared
bitwise.
"""

from __future__ import annotations

import json
import re

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
from peft_reference import assert_adapter_loads, peft_run
from reference import make_batches
from safetensors.torch import load_file

import checkpoints
import zinf_fn as zf
from layers import llama, lora, packing

MODEL_TYPE = {
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3": "gemma3_text",
    "mistral_w4": "mistral",
    "qwen2_w4": "qwen2",
}
NEW = ["qwen3", "phi3", "gemma3"]
WINDOWED = ["mistral_w4", "qwen2_w4", "gemma3"]  # a window of 4 in sequences of 16
ATTN = ("attn.q", "attn.k", "attn.v", "attn.o")
PEFT_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


# -- import: logits and loss -----------------------------------------------------------------------


@pytest.mark.parametrize("family", [*NEW, "mistral_w4", "qwen2_w4"])
def test_from_hf_logits_and_loss_equal_transformers(family, tmp_path):
    hf = save_hf(family, tmp_path)
    model, state = checkpoints.from_hf(str(tmp_path), adamw(), fp32_config())
    cfg = model.config
    assert cfg == engine_config(hf) and cfg.family == MODEL_TYPE[family]
    params = zf.gather_params(state)
    want_weights = hf_tensors(hf)
    assert tree_paths(params).keys() == want_weights.keys()
    for path, want in want_weights.items():
        assert torch.equal(tree_paths(params)[path], want), path
    batch = make_batches(cfg, 1, batch_size=3, seed=0)[0]  # T = 16: a window of 4 cuts it
    with torch.no_grad():
        want, want_loss = hf(input_ids=batch["inputs"]).logits, hf_loss(hf, batch)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(
        llama.logits(params, cfg, batch["inputs"]), want, rtol=1e-5, atol=1e-5
    )
    assert zf.eval_step(state, batch) == pytest.approx(want_loss.item(), rel=1e-5)


def test_gemma_scales_the_embedding_in_its_dtype():
    """``Gemma3TextScaledWordEmbedding`` rounds sqrt(d) to the weight's dtype before multiplying:
    bf16 too."""
    hf = hf_model("gemma3").to(torch.bfloat16)
    cfg = engine_config(hf)
    inputs = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf.model.embed_tokens(inputs)
        got = llama.embed_tokens(cfg, hf.model.embed_tokens.weight, inputs)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


# -- sliding windows -------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 4, 16])
def test_window_mask_is_transformers_mask(window):
    from transformers.masking_utils import sliding_window_causal_mask_function

    allowed = sliding_window_causal_mask_function(window)
    zero = torch.tensor(0)
    want = torch.tensor(
        [
            [bool(allowed(zero, zero, torch.tensor(q), torch.tensor(k))) for k in range(16)]
            for q in range(16)
        ]
    )
    assert torch.equal(packing.causal_mask(16, window, torch.device("cpu")), want)


@pytest.mark.parametrize("family", WINDOWED)
def test_packed_rows_with_a_window_equal_each_example_alone(family):
    """Packed examples (segments) of 6, 3 and 7 tokens under a window of 4: each row's logits are
    those transformers computes for every example alone."""
    hf = hf_model(family)
    cfg = engine_config(hf)
    assert cfg.sliding_window == 4
    lengths = [6, 3, 7]
    inputs = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    segments = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).expand(2, -1)
    with torch.no_grad():
        got = llama.logits(full_tree(hf.state_dict(), cfg.n_layers, cfg), cfg, inputs, segments)
        start = 0
        for n in lengths:
            want = hf(input_ids=inputs[:, start : start + n]).logits
            torch.testing.assert_close(got[:, start : start + n], want, rtol=1e-5, atol=1e-5)
            start += n


# -- training and export ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "placement"),
    [
        ("qwen3", "none"),
        ("qwen3", "cpu"),
        ("phi3", "cpu"),
        ("gemma3", "nvme"),
        ("mistral_w4", "none"),
    ],
)
def test_training_after_from_hf_equals_transformers_adamw(family, placement, tmp_path):
    _, losses, _ = import_train_export(family, placement, tmp_path)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("family", NEW)
def test_export_of_the_import_is_the_source_bitwise(family, tmp_path):
    """fp32 in, fp32 out: the same tensor names (Phi-3's fused ones fused again) holding the same
    bits."""
    hf = save_hf(family, tmp_path / "hf")
    _, state = checkpoints.from_hf(str(tmp_path / "hf"), adamw(), fp32_config())
    files = checkpoints.to_hf(state, str(tmp_path / "out"), "fp32")
    assert sorted(files) == ["config.json", "model.safetensors"]
    theirs, ours = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "out"))
    assert sorted(ours) == sorted(theirs)  # safetensors orders its header by name
    for name, want in theirs.items():
        assert torch.equal(ours[name], want), name
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(back) is type(hf)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (
        llama.Config.from_hf(written)
        == engine_config(hf)
        == llama.Config.from_hf(back.config.to_dict())
    )


def test_world_two_trains_like_world_one_and_writes_the_same_files(tmp_path):
    assert_world_two_trains_like_world_one("gemma3", tmp_path)


# -- LoRA and PEFT ---------------------------------------------------------------------------------


def test_lora_on_attention_equals_peft_step_by_step(tmp_path):
    """Qwen3 with LoRA on q, k, v and o: every step's loss and the trained adapter equal PEFT +
    AdamW(fused); to_peft writes what PeftModel.from_pretrained loads."""
    save_hf("qwen3", tmp_path / "hf")
    lm, state = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config(),
        transform=lambda m: lora.apply(m, rank=4, alpha=8, targets=ATTN),
    )
    batches = make_batches(lm.config.base, 3, batch_size=4, seed=1)
    ref_losses, leaves = peft_run("qwen3", lm, state, batches, list(PEFT_ATTN), 4, 8)
    state, losses, final = train_engine(state, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for path, want in leaves.items():
        assert (final[path] - want).abs().max() <= 1e-5, path
    checkpoints.to_peft(state, str(tmp_path / "adapter"))
    assert_adapter_loads("qwen3", lm, str(tmp_path / "adapter"), final)


def test_phi3_fused_targets_are_refused_at_peft_export(tmp_path):
    """PEFT adapts Phi-3's qkv_proj whole: an adapter on q alone has no PEFT form (a merged export
    has)."""
    save_hf("phi3", tmp_path / "hf")
    _, state = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config(),
        transform=lambda m: lora.apply(m, rank=4, alpha=8, targets=("attn.q",)),
    )
    with pytest.raises(
        checkpoints.CheckpointError,
        match=r"LoRA targets \['attn.q'\]: the phi3 "
        r"model holds "
        r"them in a fused HF tensor",
    ):
        checkpoints.to_peft(state, str(tmp_path / "adapter"))
    checkpoints.to_hf(state, str(tmp_path / "merged"), torch.float32)
    assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")) is not None


# -- what is refused -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "changes", "field"),
    [
        ("qwen3", {"model_type": "qwen3_next"}, "model_type"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3", {"hidden_activation": "relu"}, "hidden_activation"),
        ("phi3", {"resid_pdrop": 0.1}, "resid_pdrop"),
        (
            "phi3",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            "rope_parameters.rope_type",
        ),
        ("qwen2_w4", {"layer_types": ["full_attention"]}, "layer_types"),
    ],
)
def test_from_hf_refuses_what_it_cannot_compute(family, changes, field, tmp_path):
    save_hf(family, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    pattern = rf"config\.json: {re.escape(field)}: expected"
    with pytest.raises(checkpoints.CheckpointError, match=pattern):
        checkpoints.from_hf(str(tmp_path), adamw(), fp32_config())


def test_to_hf_refuses_what_the_family_cannot_say():
    with pytest.raises(ValueError, match="family 'qwen2' cannot express qk_norm=True"):
        llama.Config(family="qwen2", qkv_bias=True, qk_norm=True).to_hf()
    with pytest.raises(ValueError, match="family 'mistral' slides every layer or none"):
        llama.Config(
            family="mistral", sliding_window=4, layer_types=("sliding_attention", "full_attention")
        ).to_hf()


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path):
    from safetensors.torch import save_file

    save_hf("phi3", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[qkv] = tensors[qkv][:-8].clone()  # 8 rows short of q, k and v
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    named = r"blocks\.1\.attn\.q\.w: shape \(56, 32\) in tensor '[^']*\.1\.self_attn\.qkv_proj"
    with pytest.raises(checkpoints.CheckpointError, match=named):
        checkpoints.from_hf(str(tmp_path), adamw(), fp32_config())
