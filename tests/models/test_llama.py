"""``layers.llama`` against transformers' LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM.

Tolerances. Both sides run the same fp32 torch ops in the same order on the same tensors: RMSNorm as
``LlamaRMSNorm`` writes it, rotary angles and ``rotate_half`` as ``LlamaRotaryEmbedding`` /
``apply_rotary_pos_emb``, SDPA with HF's ``scale`` and ``enable_gqa`` (HF's CPU path without a
padding mask), the head's ``F.linear`` + fp32 cross-entropy. On this stack the logits and the losses
come out bitwise equal. The assertions still allow fp32 rounding (``rtol = atol = 1e-5`` on logits
of size ~1, i.e. ~100 ulp) so that a transformers release that reorders a sum (e.g. SDPA through
``repeat_kv`` instead of ``enable_gqa``, or another fused kernel) does not fail a correct model; a
wrong weight, layout, rotary frequency or bias moves the logits by 1e-2 or more.

Training: 10 AdamW steps at lr 3e-3. The engine's per-block vjp equals autograd through the whole HF
model and ``zf.adamw`` runs ``torch.optim.AdamW(fused=True)``'s kernel (see
tests/engine/test_engine.py), so the runs agree bitwise here too. Allowed: losses to 1e-5 relative
and weights to 1e-5 absolute. The weight bound is 0.3% of one step's move (Adam moves each weight by
about lr = 3e-3 a step): reassociation noise passes, a missing gradient, decay or update on any
tensor moves it by ~lr and fails.
"""

from __future__ import annotations

import json

import optree
import pytest
import torch
from hf_reference import (
    FAMILIES,
    engine_config,
    engine_weights,
    full_tree,
    hf_loss,
    hf_model,
    train_engine,
    tree_paths,
)
from llama_reference import adamw, placement_config, reference_run
from reference import make_batches

import checkpoints
import zinf_fn as zf
from layers import decoder_names, llama, rope
from zinf_fn import tiling
from zinf_fn.model import plain_loss

# -- forward parity
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_loss_match_transformers(family):
    hf = hf_model(family)
    cfg = engine_config(hf)
    full = full_tree(hf.state_dict(), cfg.n_layers, cfg)
    batch = make_batches(cfg, 1, batch_size=3, seed=0)[0]
    with torch.no_grad():
        want = hf(input_ids=batch["inputs"]).logits
        got = llama.logits(full, cfg, batch["inputs"])
        loss, want_loss = plain_loss(llama.model(cfg), full, batch), hf_loss(hf, batch)
    assert got.shape == (3, cfg.seq_len, cfg.vocab_size) and got.dtype == torch.float32
    assert (
        want.abs().max() > 0.1
    )  # logits of size ~1: the tolerance below is fp32 rounding, not the signal
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)


def test_families_use_their_features():
    """The parametrised parity above covers what it claims: GQA, both rope scalings, biases,
    head_dim."""
    cfgs = {family: engine_config(hf_model(family)) for family in FAMILIES}
    assert all(c.n_kv_heads == 2 and c.n_heads == 4 for c in cfgs.values())
    assert cfgs["llama3"].rope == rope.Rope(
        theta=500_000.0,
        type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8,
    )
    assert cfgs["llama_linear"].rope == rope.Rope(theta=10_000.0, type="linear", factor=2.0)
    assert cfgs["qwen2"].qkv_bias and not cfgs["qwen2"].o_bias and not cfgs["llama3"].qkv_bias
    assert cfgs["llama_bias"].qkv_bias and cfgs["llama_bias"].o_bias and cfgs["llama_bias"].mlp_bias
    assert cfgs["llama_bias"].rope == rope.Rope()
    assert (
        cfgs["mistral"].head_dim == 16 and cfgs["mistral"].d_model // cfgs["mistral"].n_heads == 8
    )


@pytest.mark.parametrize("family", ["llama3", "llama_linear"])
def test_inv_freq_is_transformers_bitwise(family):
    hf = hf_model(family)
    cfg = engine_config(hf)
    assert torch.equal(rope.inv_freq(cfg.rope, cfg.head_dim), hf.model.rotary_emb.inv_freq)


def test_tiled_model_gives_the_same_loss():
    hf = hf_model("llama3")
    cfg = llama.Config.from_hf(hf.config.to_dict(), mlp_tiles=2, head_tiles=3)
    state = checkpoints.from_state_dict(
        hf.state_dict(),
        llama.model(cfg),
        adamw(),
        zf.Config(param_dtype=torch.float32),
        rename=llama.hf_to_ours,
    )
    batch = make_batches(cfg, 1, batch_size=2, seed=3)[0]
    with torch.no_grad():
        want = hf_loss(hf, batch)
    # The down projection sums two partial products and the head accumulates its log-sum-exp online
    # over three vocabulary tiles: fp32 reassociation only, ~1e-7 relative.
    assert zf.eval_step(state, batch) == pytest.approx(want.item(), rel=1e-5)


# -- training parity
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("placement", "grad_accum"), [("none", 1), ("cpu", 1), ("nvme", 1), ("cpu", 2)]
)
@pytest.mark.parametrize("family", ["llama3", "qwen2", "llama_tied"])
def test_training_matches_transformers_with_adamw(family, placement, grad_accum, tmp_path):
    initial, batches, ref_losses, ref_final = reference_run(family, grad_accum)
    cfg = llama.Config.from_hf(FAMILIES[family][1]().to_dict())
    config = placement_config(placement, tmp_path, grad_accum=grad_accum)
    state = checkpoints.from_state_dict(
        initial, llama.model(cfg), adamw(), config, rename=llama.hf_to_ours
    )
    _, losses, final = train_engine(state, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert losses[-1] < losses[0]
    assert sorted(final) == sorted(ref_final)
    for path, want in ref_final.items():
        assert (final[path] - want).abs().max() <= 1e-5, path


def test_tiled_training_matches_transformers():
    """mlp_tiles=2, head_tiles=3, embed_tiles=3: HF's whole weights are cut on the way in and
    trained tile by tile. The tiled ops only reassociate fp32 sums (observed: losses within 1e-7
    relative, weights within 1e-6; the embedding's rows and gradients are F.embedding's bitwise,
    tests/tiling/test_vocab.py), so the same bounds as the untiled runs hold."""
    initial, batches, ref_losses, ref_final = reference_run("llama3")
    cfg = llama.Config.from_hf(
        FAMILIES["llama3"][1]().to_dict(), mlp_tiles=2, head_tiles=3, embed_tiles=3
    )
    state = checkpoints.from_state_dict(
        initial, llama.model(cfg), adamw(), placement_config("cpu", None), rename=llama.hf_to_ours
    )
    assert isinstance(zf.gather_params(state)["blocks"][0]["mlp"]["down"]["w"], tiling.ColTiles)
    assert isinstance(zf.gather_params(state)["embed"]["tok"]["w"], tiling.RowTiles)
    losses = []
    for batch in batches:
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
    final = tree_paths(
        optree.tree_map(tiling.untile, zf.gather_params(state), is_leaf=tiling.is_tiled)
    )
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for path, want in ref_final.items():
        assert (final[path] - want).abs().max() <= 1e-5, path


def test_pad_token_row_gets_no_gradient():
    """``pad_token_id`` is HF's ``nn.Embedding(padding_idx=...)``: that row is not trained (only
    decayed)."""
    cfg = llama.Config(
        vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, seq_len=8, pad_token_id=0
    )
    m = llama.model(cfg)
    embed = {"tok": {"w": torch.randn(64, 32).requires_grad_(True)}}
    batch = {"inputs": torch.tensor([[0, 1, 0, 2]]), "targets": torch.tensor([[1, 0, 2, 3]])}
    m.embed.apply(embed, batch).sum().backward()
    grad = embed["tok"]["w"].grad
    assert torch.equal(grad[0], torch.zeros(32)) and grad[1].abs().sum() > 0


# -- the name map
# -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_name_map_covers_the_hf_state_dict_both_ways(family):
    hf = hf_model(family)
    cfg = engine_config(hf)
    names = list(hf.state_dict())  # a tied model lists lm_head.weight too; save_pretrained drops it
    assert llama.hf_names(cfg) == [
        n for n in names if not (cfg.tie_embeddings and n == "lm_head.weight")
    ]
    unfused = [n for n in names if not decoder_names.fused_parts(cfg, n)]  # Phi-3's are parts
    ours = [decoder_names.hf_to_ours(n, cfg.family) for n in unfused]
    assert [decoder_names.ours_to_hf(p, cfg.family) for p in ours] == unfused
    tree = llama.model(cfg)
    gen = torch.Generator().manual_seed(0)
    init = {
        "embed": tree.embed.init(gen),
        "blocks": [tree.block.init(gen, i) for i in range(cfg.n_layers)],
        "head": tree.head.init(gen),
    }
    init["head"] = zf.model.with_ties(
        tree.ties, init["head"], init["embed"]
    )  # tied: lm_head.w is embed.tok.w
    shapes = {p: tuple(t.shape) for p, t in tree_paths(init).items()}
    assert shapes == {p: tuple(t.shape) for p, t in engine_weights(hf.state_dict(), cfg).items()}


def test_name_map_examples_and_unknown_names():
    assert llama.hf_to_ours("model.layers.11.self_attn.k_proj.bias") == "blocks.11.attn.k.b"
    assert llama.hf_to_ours("model.embed_tokens.weight") == "embed.tok.w"
    assert llama.ours_to_hf("head.lm_head.w") == "lm_head.weight"
    assert llama.ours_to_hf("blocks.0.mlp.down.w") == "model.layers.0.mlp.down_proj.weight"
    for bad in (
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "transformer.wte.weight",
        "model.layers.x.mlp",
    ):
        with pytest.raises(ValueError, match="not a Llama-family HF name"):
            llama.hf_to_ours(bad)
    with pytest.raises(ValueError, match="engine name"):
        llama.ours_to_hf("blocks.0.attn.qkv.w")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_pretrained_safetensors_load_through_the_name_map(tmp_path, dtype):
    """What ``save_pretrained`` writes (one unsharded model.safetensors) loads tensor by tensor, as
    it is."""
    hf = hf_model("qwen2").to(dtype)
    hf.save_pretrained(tmp_path)
    cfg = llama.Config.from_hf(json.loads((tmp_path / "config.json").read_text()))
    state = checkpoints.from_safetensors(
        str(tmp_path / "model.safetensors"),
        llama.model(cfg),
        adamw(),
        zf.Config(param_dtype=torch.float32),
        rename=llama.hf_to_ours,
    )
    got = tree_paths(zf.gather_params(state))
    for name, want in hf.state_dict().items():
        assert torch.equal(got[llama.hf_to_ours(name)], want.float()), name  # bf16 -> fp32 is exact


def test_from_state_dict_rejects_a_wrong_shape():
    hf = hf_model("qwen2")
    sd = dict(hf.state_dict())
    sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 32)
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.k\.w: shape \(3, 32\)"):
        checkpoints.from_state_dict(
            sd, llama.model(engine_config(hf)), adamw(), zf.Config(), rename=llama.hf_to_ours
        )


# -- Config.from_hf: what it reads and what it refuses
# ----------------------------------------------------


def _hf_dict(family: str, **changes) -> dict:
    return {**FAMILIES[family][1]().to_dict(), **changes}


def test_from_hf_reads_old_style_rope_fields():
    """transformers < 5 wrote ``rope_theta`` at the top level and ``rope_scaling`` with ``type``."""
    d = {k: v for k, v in _hf_dict("llama3").items() if k != "rope_parameters"}
    cfg = llama.Config.from_hf(
        {**d, "rope_theta": 250_000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    )
    assert cfg.rope == rope.Rope(theta=250_000.0, type="linear", factor=4.0)
    plain = llama.Config.from_hf({**d, "rope_theta": 1e4, "rope_scaling": None})
    assert plain.rope == rope.Rope()
    assert llama.Config.from_hf(d, seq_len=8).seq_len == 8


@pytest.mark.parametrize(
    ("family", "changes", "field"),
    [
        ("llama3", {"model_type": "gpt_neox"}, "model_type"),
        ("llama3", {"model_type": None}, "model_type"),
        ("mistral", {"sliding_window": 0}, "sliding_window"),
        (
            "qwen2",
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["full_attention", "chunked"],
            },
            "layer_types",
        ),
        ("llama3", {"num_local_experts": 8, "num_experts_per_tok": 2}, "num_local_experts"),
        ("qwen2", {"num_experts": 4}, "num_experts"),
        (
            "llama3",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "rope_parameters.rope_type",
        ),
        ("llama3", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        (
            "llama3",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
            "rope_parameters.factor",
        ),
        ("llama3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("llama3", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama3", {"attention_dropout": 0.1}, "attention_dropout"),
        ("llama3", {"num_key_value_heads": 3}, "n_kv_heads"),
    ],
)
def test_from_hf_refuses_what_it_cannot_compute(family, changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as err:
        llama.Config.from_hf(_hf_dict(family, **changes))
    assert "expected" in str(err.value) or "must" in str(err.value)


def test_from_hf_names_expected_and_got():
    with pytest.raises(
        ValueError,
        match=r"model_type: expected one of \('llama', 'mistral', "
        r"'qwen2', .*\), "
        r"got 'gpt2'",
    ):
        llama.Config.from_hf(_hf_dict("llama3", model_type="gpt2"))
    with pytest.raises(
        ValueError,
        match=r"sliding_window: expected null or a positive int, got "
        r"True",
    ):
        llama.Config.from_hf(_hf_dict("mistral", sliding_window=True))
    d = _hf_dict("llama3")
    del d["hidden_size"]
    with pytest.raises(ValueError, match="missing field.*hidden_size"):
        llama.Config.from_hf(d)
    with pytest.raises(TypeError, match="config.json dict"):
        llama.Config.from_hf("config.json")


def test_tied_embeddings_are_one_weight():
    """``tie_word_embeddings``: the head reads the token embedding; the model has no lm_head.w of
    its own."""
    cfg = engine_config(hf_model("llama_tied"))
    assert cfg.tie_embeddings and llama.model(cfg).ties == (zf.Tie("tok.w", "lm_head.w"),)
    assert "lm_head" not in llama.model(cfg).head.init(torch.Generator())
    assert cfg.to_hf()["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="head_tiles=1"):
        llama.Config(tie_embeddings=True, head_tiles=2)
