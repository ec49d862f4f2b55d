"""``zf.Stage.from_module``: any ``nn.Module`` block through ``torch.func.functional_call``, no
hooks.

The block here is transformers' own ``LlamaDecoderLayer``; the embed and head stages are
``layers.llama``'s (the token embedding, the final RMSNorm and the head), and the rotary ``(cos,
sin)`` travel in the carry as HF's model passes them to each layer. The same tensors go through the
same modules in the same order as in ``LlamaForCausalLM``, so the tolerances of
tests/models/test_llama.py hold (losses to 1e-5 relative, weights to 1e-5 absolute: 0.3% of one Adam
step's move of ~lr).
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_model, train_engine, tree_paths
from llama_reference import adamw, placement_config, reference_run
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import checkpoints
import zinf_fn as zf
from layers import llama
from layers.batch import count_targets


def hf_block_model(hf) -> zf.Model:
    """LlamaForCausalLM as a zf.Model whose block is HF's decoder layer, called functionally."""
    cfg = llama.Config.from_hf(hf.config.to_dict())
    rotary = LlamaRotaryEmbedding(
        hf.config
    )  # its inv_freq is a constant of the embed stage, not a parameter

    def embed_apply(params, batch):
        h = llama.embed_apply(cfg, params, batch)  # (B, T, D)
        positions = torch.arange(h.shape[1]).unsqueeze(0)  # (1, T)
        cos, sin = rotary(h, positions)  # 2 x (1, T, Dh)
        return {"h": h, "cos": cos, "sin": sin}

    def layer_forward(layer, carry):
        h = layer(
            carry["h"], position_embeddings=(carry["cos"], carry["sin"])
        )  # causal: no mask given
        return {**carry, "h": h}

    return zf.Model(
        embed=zf.Stage(lambda gen: llama.embed_init(cfg, gen), embed_apply),
        block=zf.Stage.from_module(lambda i: LlamaDecoderLayer(hf.config, i), layer_forward),
        head=zf.Stage(
            lambda gen: llama.head_init(cfg, gen),
            lambda params, carry, batch: llama.head_apply(cfg, params, carry["h"], batch),
        ),
        n_layers=cfg.n_layers,
        # llama's head returns a zf.TokenLoss (token_loss, the default)
        count_targets=count_targets,
    )


def rename(name: str) -> str:
    """HF names: a decoder layer keeps its module's own names
    (``blocks.1.self_attn.q_proj.weight``)."""
    if name.startswith("model.layers."):
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        return f"blocks.{i}.{rest}"
    return llama.hf_to_ours(name)


def test_init_is_seeded_and_names_are_the_modules_own():
    hf = hf_model("llama3")
    model = hf_block_model(hf)
    a = model.block.init(torch.Generator().manual_seed(3), 1)
    b = model.block.init(torch.Generator().manual_seed(3), 1)
    c = model.block.init(torch.Generator().manual_seed(4), 1)
    assert sorted(a) == sorted(n for n, _ in LlamaDecoderLayer(hf.config, 1).named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], c[k]) for k in a)
    state = zf.init(model, adamw(), zf.Config(param_dtype=torch.float32), seed=0)
    again = zf.init(model, adamw(), zf.Config(param_dtype=torch.float32), seed=0)
    flat, flat_again = tree_paths(zf.gather_params(state)), tree_paths(zf.gather_params(again))
    assert "blocks.1.mlp.gate_proj.weight" in flat
    assert all(torch.equal(flat[k], flat_again[k]) for k in flat)


@pytest.mark.parametrize("placement", ["none", "nvme"])
def test_hf_decoder_layer_as_a_block_trains_like_the_hf_model(placement, tmp_path):
    initial, batches, ref_losses, ref_final = reference_run("llama3")
    model = hf_block_model(hf_model("llama3"))
    state = checkpoints.from_state_dict(
        initial, model, adamw(), placement_config(placement, tmp_path), rename=rename
    )
    _, losses, final = train_engine(state, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert losses[-1] < losses[0]
    for name, want in ref_final.items():  # ref_final is keyed by layers.llama's paths
        ours = rename(llama.ours_to_hf(name))
        assert (final[ours] - want).abs().max() <= 1e-5, name


def test_blocks_with_buffers_or_no_module_are_refused():
    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))

    with pytest.raises(TypeError, match=r"block 0 \(WithBuffer\) holds buffers \['scale'\]"):
        zf.Stage.from_module(lambda i: WithBuffer()).init(torch.Generator(), 0)
    with pytest.raises(TypeError, match=r"make_block\(2\) returned dict, expected an nn.Module"):
        zf.Stage.from_module(lambda i: {}).init(torch.Generator(), 2)
