"""``checkpoints.to_hf`` against transformers: directories ``from_pretrained`` loads, sharded as
``save_pretrained`` shards them (the shard plan against huggingface_hub's), the config it writes,
and the command line's import and export. Storage moves (fp32 export of an fp32 import, bf16
through the fp32 master and back) are compared bitwise.

The import: test_hf_import.py; bad input: test_hf_errors.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from hf_reference import FAMILIES
from hf_workers import PARITY_FAMILIES, SMALL_SHARDS, adamw, fp32_config, save_hf

import checkpoints
from checkpoints.hf_shards import parse_size, plan_shards
from checkpoints.safetensors_io import Entry
from layers import llama

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


# -- the files -------------------------------------------------------------------------------------


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


def _tiled_llama(tmp_path):
    """(the HF model saved under tmp_path/hf, its import as a tiled state: mlp_tiles=2,
    head_tiles=3, embed_tiles=2)."""
    hf = save_hf("llama3", tmp_path / "hf")
    _, state = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config("cpu"),
        overrides={"mlp_tiles": 2, "head_tiles": 3, "embed_tiles": 2},
    )
    return hf, state


def test_to_hf_bf16_single_file_and_tiled_model(tmp_path):
    """A tiled model (mlp_tiles=2, head_tiles=3, embed_tiles=2) exports its weights whole; bf16 is
    the master rounded."""
    hf, state = _tiled_llama(tmp_path)
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


# -- the command line ------------------------------------------------------------------------------


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


def test_cli_export_reads_tiling_from_the_manifest_and_needs_a_config(tmp_path):
    from checkpoints.hf_cli import main

    hf, state = _tiled_llama(tmp_path)
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
