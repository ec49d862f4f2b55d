"""``checkpoints.from_hf`` / ``to_hf`` against transformers: directories written by
``save_pretrained`` in, directories ``from_pretrained`` loads out, for a Llama with GQA (llama3
rope) and a Qwen2 (qkv bias).

Tolerances (the reasoning of tests/models/test_llama.py, whose reference runs these tests reuse):
- Logits: both sides run the same fp32 ops on the same fp32 values (a bf16 or fp16 file is compared
  with the HF model holding the same values, upcast: bf16/fp16 -> fp32 is exact), so they agree
  bitwise here; the bound is fp32 rounding, ``rtol = atol = 1e-5`` on logits of size ~1, so that a
  transformers release that reorders a sum does not fail a correct import, while a wrong or
  misplaced tensor moves them 1e-2.
- Training, world 1: the engine equals autograd + ``torch.optim.AdamW`` bitwise here; bounds 1e-5
  relative on losses and 1e-5 absolute on weights (0.3% of one step's move at lr 3e-3).
- Training, world 2: gradients are averaged over ranks in another order, so as in
  tests/partition/test_distributed.py (measured ~1.8e-5 on weights, 1.5e-7 on losses): weights 1e-4,
  losses 1e-6 relative.
- Storage moves (from_hf -> to_hf in fp32, world 1 vs world 2 files) are compared bitwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers
from hf_reference import FAMILIES, hf_loss, tree_paths
from hf_workers import (
    adamw,
    assert_world_two_trains_like_world_one,
    fp32_config,
    import_train_export,
    save_hf,
)
from reference import make_batches

import checkpoints
import zinf_fn as zf
from checkpoints.hf_shards import parse_size, plan_shards
from checkpoints.safetensors_io import Entry
from layers import gpt, llama

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PARITY_FAMILIES = ["llama3", "qwen2"]
MODEL_TYPE = {"llama3": "llama", "qwen2": "qwen2"}
SMALL_SHARDS = "20KB"  # the 12 KB embedding and lm_head, 4-8 KB layer tensors: 7 shards


def hf_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An HF model's state_dict by the engine's key paths, fp32."""
    return {llama.hf_to_ours(n): t.detach().float() for n, t in model.state_dict().items()}


# -- import: logits and loss -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "shards"),
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.float16, None),
        (torch.float32, SMALL_SHARDS),
    ],
)
@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_from_hf_logits_equal_transformers(family, dtype, shards, tmp_path):
    hf = save_hf(family, tmp_path, dtype, shards or "50GB")
    if shards:
        assert (
            len(
                set(
                    json.loads((tmp_path / "model.safetensors.index.json").read_text())[
                        "weight_map"
                    ].values()
                )
            )
            >= 2
        )
    # the same (bf16-representable) values in fp32, as the engine's fp32 masters hold them, read
    # as a user would: from_pretrained computes the rope buffers in fp32 (a bf16 model's .float()
    # keeps them rounded)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    model, state = checkpoints.from_hf(str(tmp_path), adamw(), fp32_config())
    assert (
        model.config == llama.Config.from_hf(hf.config.to_dict())
        and model.config.family == MODEL_TYPE[family]
    )
    params = zf.gather_params(state)
    assert tree_paths(params).keys() == hf_weights(hf).keys()
    for path, want in hf_weights(hf).items():
        assert torch.equal(tree_paths(params)[path], want), path
    batch = make_batches(model.config, 1, batch_size=3, seed=0)[0]
    with torch.no_grad():
        want, want_loss = hf(input_ids=batch["inputs"]).logits, hf_loss(hf, batch)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(
        llama.logits(params, model.config, batch["inputs"]), want, rtol=1e-5, atol=1e-5
    )
    assert zf.eval_step(state, batch) == pytest.approx(want_loss.item(), rel=1e-5)


# -- import: training ------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_training_after_from_hf_equals_transformers_adamw(family, placement, tmp_path):
    _, losses, _ = import_train_export(family, placement, tmp_path, SMALL_SHARDS)
    assert losses[-1] < losses[0]


# -- export ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_to_hf_shards_as_save_pretrained_does(family, tmp_path):
    hf = save_hf(family, tmp_path / "hf", max_shard_size=SMALL_SHARDS)
    _, state = checkpoints.from_hf(str(tmp_path / "hf"), adamw(), fp32_config())
    files = checkpoints.to_hf(state, str(tmp_path / "out"), "fp32", max_shard_size=SMALL_SHARDS)
    theirs = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    ours = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert (
        ours == theirs and len(set(ours["weight_map"].values())) >= 2
    )  # same split, names, total_size
    assert sorted(files) == sorted(os.listdir(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(back) is type(hf) and back.dtype == torch.float32
    for name, want in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], want), name  # fp32 export: bitwise
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert llama.Config.from_hf(config) == llama.Config.from_hf(hf.config.to_dict())


def test_to_hf_bf16_single_file_and_tiled_model(tmp_path):
    """A tiled model (mlp_tiles=2, head_tiles=3, embed_tiles=2) exports its weights whole; bf16 is
    the master rounded."""
    hf = save_hf("llama3", tmp_path / "hf")
    _, state = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config("cpu"),
        overrides={"mlp_tiles": 2, "head_tiles": 3, "embed_tiles": 2},
    )
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model-00001-of-00002.safetensors").write_bytes(
        b"an earlier export's shard"
    )
    files = checkpoints.to_hf(
        state,
        str(tmp_path / "out"),
        torch.bfloat16,  # the import was fp32
        hf_config={**hf.config.to_dict(), "eos_token_id": 7},
    )
    assert (
        sorted(files)
        == sorted(os.listdir(tmp_path / "out"))
        == ["config.json", "model.safetensors"]
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert back.dtype == torch.bfloat16 and back.config.eos_token_id == 7  # kept from hf_config
    for name, want in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], want.to(torch.bfloat16)), name


def test_world_two_trains_like_world_one_and_writes_the_same_files(tmp_path):
    assert_world_two_trains_like_world_one("qwen2", tmp_path)


def test_cli_import_then_export_round_trip(tmp_path):
    hf = save_hf("qwen2", tmp_path / "hf", torch.bfloat16, max_shard_size=SMALL_SHARDS)
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = lambda *args: subprocess.run(
        [sys.executable, "-m", "checkpoints", "hf", *args],
        cwd=ROOT,
        env=env,  # noqa: E731
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    run(
        "import",
        str(tmp_path / "hf"),
        str(tmp_path / "ckpt"),
        "--placement",
        "nvme",
        "--nvme-path",
        str(tmp_path / "nvme"),
    )
    assert (
        checkpoints.read_manifest(str(tmp_path / "ckpt"))["extra"]["hf_config"]["model_type"]
        == "qwen2"
    )
    # the export: no test of a process (the import was one), in this one
    from checkpoints.__main__ import main

    status = main(
        [
            "hf",
            "export",
            str(tmp_path / "ckpt"),
            str(tmp_path / "out"),
            "--dtype",
            "bf16",
            "--max-shard-size",
            "20KB",
        ]
    )
    assert status == 0
    assert json.loads(
        (tmp_path / "out" / "model.safetensors.index.json").read_text()
    ) == json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    for name, want in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], want), (
            name
        )  # bf16 -> fp32 master -> bf16: exact


# -- the config and the shard plan -----------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_to_hf_round_trips_through_transformers(family):
    cfg = llama.Config.from_hf(FAMILIES[family][1]().to_dict())
    written = cfg.to_hf()
    assert llama.Config.from_hf(written) == cfg
    parsed = transformers.AutoConfig.for_model(**written)
    assert (
        type(parsed) is type(FAMILIES[family][1]())
        and llama.Config.from_hf(parsed.to_dict()) == cfg
    )


def test_config_to_hf_refuses_biases_the_family_cannot_express():
    with pytest.raises(ValueError, match="family 'llama' cannot express biases.*o_bias': False"):
        llama.Config(qkv_bias=True).to_hf()  # Qwen2's layout under a Llama config
    with pytest.raises(ValueError, match="family must be one of"):
        llama.Config(family="gpt2")


def test_parse_size():
    assert (
        parse_size("5GB") == 5 * 10**9
        and parse_size("500MB") == 5 * 10**8
        and parse_size(" 2GiB") == 2 << 30
    )
    assert parse_size("1.5kib") == 1536 and parse_size(123) == 123
    for bad in ("5G", "GB", "-1GB", 0, "0MB", 1.5, True):
        with pytest.raises(ValueError, match="max_shard_size: expected"):
            parse_size(bad)


def test_plan_matches_huggingface_hub_including_oversized_tensors():
    from huggingface_hub import split_torch_state_dict_into_shards

    gen = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 40, (30,), generator=gen)] + [
        100,
        3,
        200,
        5,
    ]  # 2 over the limit
    state_dict = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}
    for limit in (64 * 4, 150 * 4, 10**6):
        split = split_torch_state_dict_into_shards(state_dict, max_shard_size=limit)
        plan = plan_shards(
            [Entry(n, tuple(t.shape), t.dtype) for n, t in state_dict.items()], limit
        )
        assert {file: [e.name for e in shard] for file, shard in plan} == split.filename_to_tensors


# -- bad input: a ValueError naming the file, the tensor and what was expected ---------------------


def _rewrite(path, change) -> None:
    """Apply ``change`` to the tensors of the safetensors file ``path`` and write it back as HF
    would."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _sharded(tmp_path, family: str = "qwen2"):
    save_hf(family, tmp_path, max_shard_size=SMALL_SHARDS)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    return index, index["weight_map"]


def _edited_index_error(tmp_path, edit) -> str:
    """``from_hf``'s error after ``edit(weight_map, tmp_path)`` changed a sharded qwen2's index (and
    files)."""
    index, weight_map = _sharded(tmp_path)
    edit(weight_map, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return _from_hf_error(tmp_path)


def _from_hf_error(directory) -> str:
    with pytest.raises(ValueError) as err:
        checkpoints.from_hf(str(directory), adamw(), fp32_config())
    assert isinstance(err.value, checkpoints.CheckpointError)
    return str(err.value)


def test_missing_shard_file(tmp_path):
    _, weight_map = _sharded(tmp_path)
    shard = weight_map["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / shard).unlink()
    message = _from_hf_error(tmp_path)
    assert "model.safetensors.index.json" in message and f"names shard {shard!r}" in message
    assert "model.layers.1.mlp.up_proj.weight" in message and "does not exist; expected" in message


def test_wrong_shape(tmp_path):
    _, weight_map = _sharded(tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(tmp_path / weight_map[name], lambda t: t.update({name: torch.zeros(3, 32)}))
    message = _from_hf_error(tmp_path)
    assert (
        f"blocks.1.attn.k.w: shape (3, 32) in tensor {name!r} of "
        f"{str(tmp_path / weight_map[name])!r}"
        in message
    )
    assert "the model wants (16, 32)" in message


def test_tensor_in_no_shard(tmp_path):
    name = "model.layers.0.self_attn.q_proj.bias"
    message = _edited_index_error(
        tmp_path, lambda wm, d: _rewrite(d / wm.pop(name), lambda t: t.pop(name))
    )
    assert f"tensor {name!r} is in no shard; expected all 27 tensors of the qwen2 model" in message
    assert "model.safetensors.index.json" in message


def test_index_names_a_shard_that_lacks_the_tensor(tmp_path):
    name, other = "model.norm.weight", "model-00001-of-00007.safetensors"  # the embedding's shard
    message = _edited_index_error(tmp_path, lambda wm, d: wm.update({name: other}))
    assert (
        f"puts tensor {name!r} in {other!r}, but that shard has no such tensor; expected it among"
        in message
    )


def test_unexpected_tensor_and_skipped_buffers(tmp_path):
    save_hf("llama3", tmp_path)
    inv_freq = (
        "model.layers.0.self_attn.rotary_emb.inv_freq"  # older transformers saved these buffers
    )
    _rewrite(tmp_path / "model.safetensors", lambda t: t.update({inv_freq: torch.ones(4)}))
    checkpoints.from_hf(str(tmp_path), adamw(), fp32_config())  # skipped, not an error
    # a bias this Llama (attention_bias false) does not have
    bias = "model.layers.0.self_attn.q_proj.bias"
    _rewrite(tmp_path / "model.safetensors", lambda t: t.update({bias: torch.ones(32)}))
    message = _from_hf_error(tmp_path)
    assert (
        "tensor 'model.layers.0.self_attn.q_proj.bias' of" in message
        and "model.safetensors" in message
    )
    assert "not a parameter of the llama model" in message


@pytest.mark.parametrize(
    ("family", "changes", "expected"),
    [
        (
            "llama3",
            {"model_type": "gpt_neox"},
            r"model_type: expected one of \('llama', 'mistral', 'qwen2', 'qwen3', 'phi3', "
            r"'gemma3_text', "
            r"'qwen3_moe', 'mixtral', 'olmoe', 'gpt_oss', 'gpt2'\), got 'gpt_neox'",
        ),
        (
            "mistral",
            {"sliding_window": -8},
            r"sliding_window: expected null or a positive int, got -8",
        ),
        (
            "qwen2",
            {"attention_dropout": 0.1},
            r"attention_dropout: expected None or 0 or 0.0 \(not "
            r"computed",
        ),
        (
            "llama3",
            {"num_local_experts": 8},
            r"num_local_experts: mixture-of-experts is not supported; expected",
        ),
    ],
)
def test_unsupported_config(tmp_path, family, changes, expected):
    save_hf(family, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    message = _from_hf_error(tmp_path)
    assert message.startswith(str(tmp_path / "config.json")), message
    assert re.search(expected, message), message


def test_not_an_hf_directory(tmp_path):
    assert "config.json': no such file; expected the transformers config.json" in _from_hf_error(
        tmp_path
    )
    save_hf("qwen2", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert "neither model.safetensors nor model.safetensors.index.json; expected" in _from_hf_error(
        tmp_path
    )
    outside = {"model.norm.weight": "../x.safetensors"}
    message = _edited_index_error(tmp_path / "sharded", lambda wm, d: wm.update(outside))
    assert "expected the name of a .safetensors file in the same directory" in message


def test_to_hf_refuses_what_it_cannot_write(tmp_path):
    save_hf("llama3", tmp_path / "hf")
    _, state = checkpoints.from_hf(str(tmp_path / "hf"), adamw(), fp32_config())
    with pytest.raises(
        ValueError, match=r"dtype must be one of \['bf16', 'fp16', 'fp32'\].*got 'int8'"
    ):
        checkpoints.to_hf(state, str(tmp_path / "out"), "int8")
    with pytest.raises(ValueError, match="max_shard_size: expected .*got '5 gigs'"):
        checkpoints.to_hf(state, str(tmp_path / "out"), max_shard_size="5 gigs")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(FileExistsError):
        checkpoints.to_hf(state, str(tmp_path / "a_file"))
    custom = zf.init(
        gpt.model(gpt.Config(n_layers=1))._replace(config=None), adamw()
    )  # no HF family
    with pytest.raises(TypeError, match="expected a state of a layers.llama or layers.gpt model"):
        checkpoints.to_hf(custom, str(tmp_path / "out"))
    no_bias = zf.init(
        gpt.model(gpt.Config(n_layers=1, bias=False)), adamw()
    )  # GPT-2's Conv1D has biases
    with pytest.raises(ValueError, match=r"expected gpt.Config\(bias=True\)"):
        checkpoints.to_hf(no_bias, str(tmp_path / "out"))


def test_cli_export_reads_tiling_from_the_manifest_and_needs_a_config(tmp_path):
    from checkpoints.hf_cli import main

    hf = save_hf("llama3", tmp_path / "hf")
    _, state = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config("cpu"),
        overrides={"mlp_tiles": 2, "head_tiles": 3, "embed_tiles": 2},
    )
    checkpoints.save(str(tmp_path / "ckpt"), state)  # saved without extra["hf_config"]
    with pytest.raises(
        checkpoints.CheckpointError, match=r"no extra\['hf_config'\].*expected --hf-config"
    ):
        main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    main(
        [
            "export",
            str(tmp_path / "ckpt"),
            str(tmp_path / "out"),
            "--dtype",
            "fp32",
            "--hf-config",
            str(tmp_path / "hf" / "config.json"),
        ]
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    for name, want in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], want), name
