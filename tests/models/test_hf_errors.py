"""``checkpoints.from_hf`` and ``to_hf`` on bad input: a directory with a missing, misnamed or
misshapen tensor, an index that points elsewhere, a config the engine cannot express, and what
``to_hf`` cannot write. Each is a ValueError (a ``CheckpointError`` from ``from_hf``) naming the
file, the tensor and what was expected.

The import: test_hf_import.py; the export: test_hf_export.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hf_workers import SMALL_SHARDS, adamw, fp32_config, save_hf

import checkpoints
import zinf_fn as zf
from layers import gpt


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


# -- from_hf: the tensors --------------------------------------------------------------------------


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


# -- from_hf: the config and the directory ---------------------------------------------------------


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


# -- to_hf -----------------------------------------------------------------------------------------


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
