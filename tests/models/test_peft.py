"""PEFT interop: ``checkpoints.to_peft`` / ``from_peft``, ``to_hf(merge_lora=)`` and
``from_hf(transform=)`` against peft and transformers (tiny random Llama and GPT-2 from configs;
nothing downloaded).

Tolerances: logits as tests/models/test_lora.py (``rtol = atol = 1e-5``: the same fp32 ops on the
same values). Stored values (adapter tensors, fp32 merged and base weights, the from_peft round
trip) are compared bitwise: a merge is PEFT's ``W + (B @ A) * scaling`` in the same order, and fp32
files hold the masters as they are.
"""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers
from hf_reference import full_tree, gpt2, hf_model, tree_paths
from hf_workers import adamw, fp32_config
from peft_reference import ALPHA, RANK, lora_leaves, peft_llama
from reference import make_batches

import checkpoints
import zinf_fn as zf
from layers import gpt, llama, lora
from zinf_fn import tiling

LLAMA_TARGETS = ("attn.q", "attn.v")


def lora_transform(targets=LLAMA_TARGETS, rank: int = RANK, alpha: float = ALPHA):
    return lambda m: lora.apply(m, rank=rank, alpha=alpha, targets=targets)


def our_logits(model: zf.Model, state, inputs: torch.Tensor) -> torch.Tensor:
    params = zf.gather_params(state)
    family = llama if isinstance(model.config.base, llama.Config) else gpt
    return family.logits(
        {**params, "blocks": [lora.bind(model.config, b) for b in params["blocks"]]},
        model.config.base,
        inputs,
    )


def lora_state(tmp_path, targets=LLAMA_TARGETS, family: str = "llama3"):
    """(PEFT reference with random A and B, our LoRA model, a state holding the same weights)."""
    base, ref = peft_llama(targets, family)
    cfg = llama.Config.from_hf(ref.get_base_model().config.to_dict())
    lm = lora.apply(llama.model(cfg), rank=RANK, alpha=ALPHA, targets=targets)
    weights = {
        **tree_paths(full_tree(base, cfg.n_layers)),
        **{p: t.detach() for p, t in lora_leaves(ref).items()},
    }
    return ref, lm, checkpoints.from_state_dict(weights, lm, adamw(), fp32_config())


# -- to_peft, merged export ------------------------------------------------------------------------


def test_to_peft_loads_in_peft_and_merges_as_peft_does(tmp_path):
    ref, lm, state = lora_state(tmp_path)
    files = checkpoints.to_peft(
        state, str(tmp_path / "adapter"), base_model_name_or_path="tiny-llama"
    )
    ref.save_pretrained(tmp_path / "theirs")
    ours_cfg, theirs_cfg = (
        json.loads((tmp_path / d / "adapter_config.json").read_text())
        for d in ("adapter", "theirs")
    )
    for key in (
        "peft_type",
        "r",
        "lora_alpha",
        "lora_dropout",
        "fan_in_fan_out",
        "bias",
        "use_dora",
        "use_rslora",
    ):
        assert ours_cfg[key] == theirs_cfg[key], key
    assert (
        sorted(ours_cfg["target_modules"])
        == sorted(theirs_cfg["target_modules"])
        == ["q_proj", "v_proj"]
    )
    assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors"]
    from safetensors.torch import load_file

    ours, theirs = (
        load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("adapter", "theirs")
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    loaded = peft.PeftModel.from_pretrained(hf_model("llama3"), str(tmp_path / "adapter")).eval()
    batch = make_batches(lm.config.base, 1, batch_size=3, seed=0)[0]
    with torch.no_grad():
        want = ref(input_ids=batch["inputs"]).logits
        torch.testing.assert_close(
            loaded(input_ids=batch["inputs"]).logits, want, rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            our_logits(lm, state, batch["inputs"]), want, rtol=1e-5, atol=1e-5
        )
    # merged: what merge_and_unload leaves, bitwise; unmerged: the base as it was
    checkpoints.to_hf(state, str(tmp_path / "merged"), torch.float32)
    checkpoints.to_hf(state, str(tmp_path / "base"), torch.float32, merge_lora=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged")
    ).state_dict()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).state_dict()
    want_merged = ref.merge_and_unload().state_dict()
    assert merged.keys() == want_merged.keys() == hf_model("llama3").state_dict().keys()
    for name, want in want_merged.items():
        assert torch.equal(merged[name], want), name
    for name, want in hf_model("llama3").state_dict().items():
        assert torch.equal(base[name], want), name
    v = "model.layers.1.self_attn.v_proj.weight"
    assert not torch.equal(merged[v], base[v])


def test_gpt2_adapter_from_peft_and_back(tmp_path):
    """GPT-2: Conv1D modules (fan_in_fan_out), an ambiguous suffix (attn.c_proj vs mlp.c_proj), a
    tied head."""
    hf = gpt2()
    hf.save_pretrained(tmp_path / "hf")
    ref = peft.get_peft_model(
        gpt2(), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["c_attn", "attn.c_proj"])
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    ref.save_pretrained(tmp_path / "theirs")
    lm, state = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config(),
        transform=lora_transform(("attn.qkv", "attn.proj")),
    )
    state = checkpoints.from_peft(str(tmp_path / "theirs"), state)
    batch = make_batches(lm.config.base, 1, batch_size=2, seed=0)[0]
    with torch.no_grad():
        want = ref.eval()(input_ids=batch["inputs"]).logits
        torch.testing.assert_close(
            our_logits(lm, state, batch["inputs"]), want, rtol=1e-5, atol=1e-5
        )
        checkpoints.to_peft(state, str(tmp_path / "ours"))
        config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
        assert config["fan_in_fan_out"] is True and config["target_modules"] == [
            "attn.c_proj",
            "c_attn",
        ]
        loaded = peft.PeftModel.from_pretrained(gpt2(), str(tmp_path / "ours")).eval()
        torch.testing.assert_close(
            loaded(input_ids=batch["inputs"]).logits, want, rtol=1e-5, atol=1e-5
        )
    checkpoints.to_hf(state, str(tmp_path / "merged"), torch.float32)
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged")
    ).state_dict()
    for name, want in ref.merge_and_unload().state_dict().items():
        assert torch.equal(merged[name], want), name


# -- from_peft, from_hf(transform=) ----------------------------------------------------------------


def test_from_peft_round_trip_is_bitwise(tmp_path):
    ref, lm, state = lora_state(tmp_path, ("attn.v", "mlp.down"), "qwen2")
    hf_model("qwen2").save_pretrained(tmp_path / "hf")  # the base peft_llama adapted
    checkpoints.to_peft(state, str(tmp_path / "adapter"))
    _, fresh = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config("cpu"),
        overrides={"mlp_tiles": 2},
        transform=lora_transform(("attn.v", "mlp.down")),
        seed=3,
    )  # a tiled block too
    fresh = checkpoints.from_peft(str(tmp_path / "adapter"), fresh)
    got, want = whole(zf.gather_params(fresh)), tree_paths(zf.gather_params(state))
    assert got.keys() == want.keys() and all(torch.equal(got[p], want[p]) for p in want)


@pytest.mark.parametrize("overrides", [None, {"mlp_tiles": 2, "head_tiles": 3}])
def test_from_hf_transform_fills_the_base_and_inits_the_lora_leaves(tmp_path, overrides):
    hf = hf_model("llama3")
    hf.save_pretrained(tmp_path / "hf")
    targets = ("attn.q", "mlp.down", "mlp.up")  # tiled ones too, with overrides
    lm, state = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config("cpu"),
        overrides=overrides,
        transform=lora_transform(targets),
        seed=5,
    )
    assert isinstance(lm.config, lora.Config) and lm.config.targets == targets
    got = whole(zf.gather_params(state))
    for name, want in hf.state_dict().items():
        assert torch.equal(got[llama.hf_to_ours(name)], want), name
    inited = whole(
        zf.gather_params(zf.init(lm, adamw(), fp32_config(), seed=5))
    )  # the transform's init
    lora_paths = [p for p in got if p.rsplit(".", 1)[-1] in lora.LORA_LEAVES]
    assert len(lora_paths) == 2 * len(targets) * lm.n_layers
    assert all(torch.equal(got[p], inited[p]) for p in lora_paths)
    assert (
        got["blocks.1.mlp.down.lora_a"].abs().max() > 0
        and got["blocks.1.mlp.down.lora_b"].abs().max() == 0
    )


def whole(params: dict) -> dict[str, torch.Tensor]:
    """``tree_paths`` with tiled weights put back together."""
    return {p: tiling.untile(t) if tiling.is_tiled(t) else t for p, t in tree_paths(params).items()}


def peft_world_worker(rank: int, world: int, hf_dir: str, adapter_dir: str, out_dir: str) -> dict:
    """from_hf with a LoRA transform, from_peft, to_peft at this world size; returns the gathered
    weights."""
    _, state = checkpoints.from_hf(hf_dir, adamw(), fp32_config("cpu"), transform=lora_transform())
    state = checkpoints.from_peft(adapter_dir, state)
    files = checkpoints.to_peft(state, out_dir)
    return {"files": files, "weights": tree_paths(zf.gather_params(state))}


def test_world_two_loads_and_writes_the_same_adapter(tmp_path):
    from dist_utils import run_world
    from hf_workers import file_bytes

    ref, _, state = lora_state(tmp_path)
    hf_model("llama3").save_pretrained(tmp_path / "hf")
    checkpoints.to_peft(state, str(tmp_path / "w1"))
    results = run_world(
        2, peft_world_worker, str(tmp_path / "hf"), str(tmp_path / "w1"), str(tmp_path / "w2")
    )
    assert file_bytes(tmp_path / "w2") == file_bytes(tmp_path / "w1")  # rank 0 wrote them, bitwise
    want = tree_paths(zf.gather_params(state))
    for result in results:
        assert result["files"] == ["adapter_config.json", "adapter_model.safetensors"]
        assert result["weights"].keys() == want.keys()
        assert all(torch.equal(result["weights"][p], want[p]) for p in want)


# -- bad input -------------------------------------------------------------------------------------


def test_from_peft_refuses_an_adapter_for_another_model(tmp_path):
    ref, lm, state = lora_state(tmp_path)
    checkpoints.to_peft(state, str(tmp_path / "ours"), base_model_name_or_path="tiny-llama")
    cases = {  # directory -> (how it was made, the error)
        "rank": (
            lambda d: peft_llama(rank=2)[1].save_pretrained(d),
            r"adapter_config.json: r: expected 4 .* got 2",
        ),
        "targets": (
            lambda d: peft_llama(("attn.q", "attn.o"))[1].save_pretrained(d),
            r"target_modules .* adapt \['attn.o', 'attn.q'\]; expected this model's targets "
            r"\['attn.q', 'attn.v'\]",
        ),
        "shapes": (
            lambda d: peft_llama(family="mistral")[1].save_pretrained(
                d
            ),  # head_dim 16: other shapes
            r"(?s)not an adapter for this model .*q_proj.lora_B.weight: shape \(64, 4\), the model "
            r"wants "
            r"\(32, 4\)",
        ),
    }
    for name, (make, error) in cases.items():
        make(tmp_path / name)
        with pytest.raises(checkpoints.CheckpointError, match=error):
            checkpoints.from_peft(str(tmp_path / name), state)
    with pytest.raises(
        checkpoints.CheckpointError,
        match="base_model_name_or_path: the adapter is for 'tiny-llama', expected 'other'",
    ):
        checkpoints.from_peft(str(tmp_path / "ours"), state, base_model_name_or_path="other")
    other_cfg = llama.Config.from_hf(
        {**ref.get_base_model().config.to_dict(), "rms_norm_eps": 1e-3}
    )
    other = lora.apply(
        llama.model(other_cfg), rank=RANK, alpha=ALPHA, targets=LLAMA_TARGETS
    )  # same shapes
    with pytest.raises(
        checkpoints.CheckpointError, match="for another base model: config field 'rms_norm_eps'"
    ):
        checkpoints.from_peft(str(tmp_path / "ours"), zf.init(other, adamw(), fp32_config()))
    with pytest.raises(checkpoints.CheckpointError, match="adapter_config.json': no such file"):
        checkpoints.from_peft(str(tmp_path / "nothing"), state)


def test_what_is_not_a_lora_model(tmp_path):
    hf_model("llama3").save_pretrained(tmp_path / "hf")
    _, plain = checkpoints.from_hf(str(tmp_path / "hf"), adamw(), fp32_config())
    for call in (checkpoints.to_peft, checkpoints.from_peft):
        with pytest.raises(TypeError, match="expected a state of a LoRA model"):
            call(plain, str(tmp_path / "x")) if call is checkpoints.to_peft else call(
                str(tmp_path / "x"), plain
            )
    with pytest.raises(TypeError, match="transform must return a zf.Model.*got dict"):
        checkpoints.from_hf(str(tmp_path / "hf"), adamw(), fp32_config(), transform=lambda m: {})
    with pytest.raises(ValueError, match="target 'attn.qkv' is not a linear"):
        checkpoints.from_hf(
            str(tmp_path / "hf"), adamw(), fp32_config(), transform=lora_transform(("attn.qkv",))
        )


transformers.logging.set_verbosity_error()
