"""GPT-2 (``GPT2LMHeadModel``: tied head, Conv1D weights, learned positions, ``gelu_new``) and a
tied Llama through ``checkpoints.from_hf`` / ``to_hf``, against transformers. Nothing is downloaded:
tiny random models.

Tolerances: as tests/models/test_llama.py. Both sides run fp32 ops on the same values; GPT-2's
Conv1D is an ``addmm`` over the transposed weight where ``layers.gpt`` runs ``F.linear`` and HF's
SDPA path may differ from ours in summation order, so the bound is fp32 rounding: logits ``rtol =
atol = 1e-5`` (size ~1), losses 1e-5 relative, weights after 10 AdamW steps 1e-5 absolute (0.3% of
one lr = 3e-3 step: a missing gradient, e.g. one use of the tied weight, moves them by ~lr). Storage
moves (fp32 to_hf, then from_pretrained) are compared bitwise.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from hf_reference import gpt2, train_engine, tree_paths
from hf_workers import adamw, fp32_config, save_hf
from llama_reference import reference_run, train_hf
from reference import make_batches
from safetensors import safe_open

import checkpoints
import zinf_fn as zf
from layers import gpt, gpt2_hf, llama

STEPS = 10


def ours(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An HF GPT-2's weights by the engine's key paths, Conv1D weights transposed to nn.Linear's
    layout."""
    return {
        gpt2_hf.hf_to_ours(n): (t.t() if gpt2_hf.transposed(n) else t).detach().float()
        for n, t in hf.state_dict().items()
    }


def hf_loss(hf, batch) -> torch.Tensor:
    """The engine's convention: targets already shifted, the mean over all B*T positions, fp32
    logits."""
    logits = hf(input_ids=batch["inputs"]).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1))


def train_like(state, batches: list, ref_losses: list, ref_final: dict) -> tuple:
    """Train ``state`` on ``batches``; assert the reference's losses and final weights (the module's
    tolerances); returns (the state, its final weights by key path)."""
    state, losses, final = train_engine(state, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for path, want in ref_final.items():
        assert (final[path] - want).abs().max() <= 1e-5, path
    return state, final


def test_from_hf_gpt2_weights_and_logits_equal_transformers(tmp_path):
    hf = gpt2()
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: HF writes the embedding only
    model, state = checkpoints.from_hf(str(tmp_path), adamw(), fp32_config())
    cfg = model.config
    assert cfg == gpt.Config(
        vocab_size=96,
        d_model=32,
        n_heads=4,
        n_layers=2,
        seq_len=16,
        tie_embeddings=True,
        activation="gelu_new",
        norm_eps=1e-5,
    )
    params = tree_paths(zf.gather_params(state))
    assert params.keys() == ours(hf).keys()
    for path, want in ours(hf).items():
        assert torch.equal(params[path], want), path
    batch = make_batches(cfg, 1, batch_size=3, seed=0)[0]
    with torch.no_grad():
        want, want_loss = hf(input_ids=batch["inputs"]).logits, hf_loss(hf, batch)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(
        gpt.logits(zf.gather_params(state), cfg, batch["inputs"]), want, rtol=1e-5, atol=1e-5
    )
    assert zf.eval_step(state, batch) == pytest.approx(want_loss.item(), rel=1e-5)


def _hf_run(grad_accum: int) -> tuple:
    hf = gpt2()
    initial = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    cfg = gpt2_hf.config_from_hf(hf.config.to_dict())
    batches = make_batches(cfg, STEPS, batch_size=4, seed=1)
    losses = train_hf(hf, batches, grad_accum)  # dropout 0: train() changes nothing numerically
    return initial, batches, losses, ours(hf)


@pytest.mark.parametrize(("placement", "grad_accum"), [("none", 1), ("cpu", 2), ("nvme", 1)])
def test_gpt2_training_equals_transformers_adamw_and_exports_back(placement, grad_accum, tmp_path):
    initial, batches, ref_losses, ref_final = _hf_run(grad_accum)
    hf = gpt2()
    assert all(torch.equal(t, initial[n]) for n, t in hf.state_dict().items())
    hf.save_pretrained(tmp_path / "hf")
    config = zf.Config(
        **{
            **fp32_config(placement, str(tmp_path) if placement == "nvme" else None).__dict__,
            "grad_accum": grad_accum,
        }
    )
    _, state = checkpoints.from_hf(str(tmp_path / "hf"), adamw(), config)
    state, final = train_like(state, batches, ref_losses, ref_final)
    checkpoints.to_hf(state, str(tmp_path / "out"), torch.float32)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert (
        type(back) is transformers.GPT2LMHeadModel
        and back.lm_head.weight is back.transformer.wte.weight
    )
    for path, got in ours(back).items():
        assert torch.equal(got, final[path]), path


def test_gpt2_to_hf_writes_what_save_pretrained_writes(tmp_path):
    hf = gpt2()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    _, state = checkpoints.from_hf(
        str(tmp_path / "hf"), adamw(), fp32_config("cpu"), overrides={"mlp_tiles": 2}
    )
    checkpoints.to_hf(
        state, str(tmp_path / "out"), "fp32", max_shard_size="20KB", hf_config=hf.config.to_dict()
    )
    theirs = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    mine = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert mine == theirs and "lm_head.weight" not in mine["weight_map"]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    for name, want in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], want), (
            name
        )  # fp32 export: bitwise, Conv1D transposed back
    assert gpt2_hf.config_from_hf(
        json.loads((tmp_path / "out" / "config.json").read_text())
    ) == gpt2_hf.config_from_hf(hf.config.to_dict())


def test_untied_gpt2_keeps_its_lm_head(tmp_path):
    hf = gpt2(tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "hf")
    model, state = checkpoints.from_hf(str(tmp_path / "hf"), adamw(), fp32_config())
    assert model.ties == () and torch.equal(
        tree_paths(zf.gather_params(state))["head.lm_head.w"], hf.lm_head.weight
    )
    checkpoints.to_hf(state, str(tmp_path / "out"), torch.float32)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert back.lm_head.weight is not back.transformer.wte.weight
    for name, want in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], want), name


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"activation_function": "relu"},
            r"activation_function: expected one of \['gelu', 'gelu_new'\], got 'relu'",
        ),
        ({"reorder_and_upcast_attn": True}, r"reorder_and_upcast_attn: expected False .*got True"),
        (
            {"scale_attn_by_inverse_layer_idx": True},
            r"scale_attn_by_inverse_layer_idx: expected False",
        ),
    ],
)
def test_gpt2_config_it_cannot_compute_is_refused(tmp_path, changes, expected):
    gpt2().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(checkpoints.CheckpointError, match=expected) as err:
        checkpoints.from_hf(str(tmp_path), adamw(), fp32_config())
    assert str(err.value).startswith(str(tmp_path / "config.json"))


@pytest.mark.parametrize("placement", ["none", "cpu", "nvme"])
def test_tied_llama_through_from_hf_and_to_hf(placement, tmp_path):
    initial, batches, ref_losses, ref_final = reference_run("llama_tied")
    hf = save_hf("llama_tied", tmp_path / "hf")
    assert all(torch.equal(t, initial[n]) for n, t in hf.state_dict().items())
    model, state = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config(placement, str(tmp_path) if placement == "nvme" else None),
    )
    assert model.config.tie_embeddings and model.ties
    state, final = train_like(state, batches, ref_losses, ref_final)
    checkpoints.to_hf(state, str(tmp_path / "out"), torch.float32)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert back.config.tie_word_embeddings and back.lm_head.weight is back.model.embed_tokens.weight
    for name, got in back.state_dict().items():
        assert torch.equal(got, final[llama.hf_to_ours(name)]), name
