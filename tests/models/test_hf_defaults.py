"""What a user of the Hugging Face path meets without asking: the dtype ``to_hf`` writes when not
told, the command line's stderr, and a Mistral whose sliding window covers the whole sequence or
less of it.

Tolerances: the dtype tests compare storage bitwise (fp32 and bf16 files -> fp32 masters -> the same
dtype is exact). The Mistral logits use tests/models/test_llama.py's bound (``rtol = atol = 1e-5``
on logits of size ~1, fp32 rounding); a window that cuts the sequence moves them by far more, which
the test checks too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import transformers
from hf_reference import SMALL, full_tree, randomize_
from hf_workers import adamw, fp32_config, save_hf
from reference import make_batches
from safetensors.torch import load_file

import checkpoints
import zinf_fn as zf
from layers import llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def weights(directory) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file of a directory, as stored."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


# -- to_hf's default dtype
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_to_hf_writes_the_dtype_from_hf_read(dtype, tmp_path):
    save_hf("llama3", tmp_path / "hf", dtype)
    model, state = checkpoints.from_hf(str(tmp_path / "hf"), adamw(), fp32_config())
    assert model.config.hf_dtype == str(dtype).removeprefix("torch.")
    checkpoints.to_hf(state, str(tmp_path / "out"))  # no dtype
    imported, exported = weights(tmp_path / "hf"), weights(tmp_path / "out")
    assert sorted(exported) == sorted(imported)
    for name, want in imported.items():
        assert want.dtype == dtype and exported[name].dtype == dtype, name
        assert torch.equal(exported[name], want), (
            name
        )  # bitwise: the file -> fp32 master -> the same dtype


def test_to_hf_writes_bf16_for_a_model_not_from_hf(tmp_path):
    cfg = llama.Config(vocab_size=64, d_model=32, n_layers=1, n_heads=4, d_ff=64, seq_len=8)
    state = zf.init(llama.model(cfg), adamw(), fp32_config(), seed=0)
    checkpoints.to_hf(state, str(tmp_path / "out"))
    assert {t.dtype for t in weights(tmp_path / "out").values()} == {torch.bfloat16}
    assert (
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).dtype
        == torch.bfloat16
    )


def test_cli_export_keeps_the_imported_dtype(tmp_path):
    from checkpoints.hf_cli import main

    save_hf("qwen2", tmp_path / "hf", torch.float32)
    main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--param-dtype", "fp32"])
    main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")])  # no --dtype
    imported, exported = weights(tmp_path / "hf"), weights(tmp_path / "out")
    assert all(
        torch.equal(exported[name], want) and exported[name].dtype == torch.float32
        for name, want in imported.items()
    )


def test_a_config_read_is_equal_whatever_its_dtype():
    """``hf_dtype`` says where the weights came from, not what the model computes: configs compare
    equal."""
    d = transformers.LlamaConfig(**SMALL).to_dict()
    assert llama.Config.from_hf({**d, "dtype": "float32"}) == llama.Config.from_hf(
        {**d, "torch_dtype": "bfloat16"}
    )
    assert (
        llama.Config.from_hf({**d, "torch_dtype": "bfloat16", "dtype": None}).hf_dtype == "bfloat16"
    )


# -- the command line
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", [["hf", "import", "--help"], ["hf", "export", "--help"], ["export", "--help"]]
)
def test_cli_prints_no_runpy_warning(command):
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run(
        [sys.executable, "-m", "checkpoints", *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "usage: python -m checkpoints " in run.stdout
    assert "Warning" not in run.stderr, run.stderr


def test_cli_names_its_commands():
    from checkpoints.__main__ import main

    assert main(["nonsense"]) == 2 and main([]) == 2


# -- Mistral's sliding window
# ------------------------------------------------------------------------------


def mistral(sliding_window: int | None) -> transformers.MistralForCausalLM:
    """A random fp32 Mistral (max_position_embeddings 16) with ``sliding_window``."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(**SMALL, head_dim=16, sliding_window=sliding_window)
    return randomize_(transformers.MistralForCausalLM(config).eval(), 0, "norm")


def logits(
    hf: torch.nn.Module, cfg: llama.Config, inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the engine's logits, transformers' logits) of ``inputs`` under ``hf``'s weights."""
    with torch.no_grad():
        return llama.logits(full_tree(hf.state_dict(), cfg.n_layers), cfg, inputs), hf(
            input_ids=inputs
        ).logits


@pytest.mark.parametrize("window", [16, 4096])
def test_mistral_window_at_least_the_sequence_is_full_attention(window, tmp_path):
    hf = mistral(window)
    cfg = llama.Config.from_hf(hf.config.to_dict())
    assert cfg.seq_len == 16 and cfg.family == "mistral"
    batch = make_batches(cfg, 1, batch_size=3, seed=0)[
        0
    ]  # T = seq_len = 16: every window position used
    got, want = logits(hf, cfg, batch["inputs"])
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    hf.save_pretrained(tmp_path)
    _, state = checkpoints.from_hf(
        str(tmp_path), adamw(), fp32_config()
    )  # the import accepts it too
    assert zf.eval_step(state, batch) == pytest.approx(
        torch.nn.functional.cross_entropy(
            want.view(-1, cfg.vocab_size), batch["targets"].view(-1)
        ).item(),
        rel=1e-5,
    )


def test_mistral_window_shorter_than_the_sequence_is_a_banded_mask(tmp_path):
    hf = mistral(8)
    cfg = llama.Config.from_hf(hf.config.to_dict())
    assert cfg.sliding_window == 8 and cfg.seq_len == 16
    long_inputs = torch.randint(
        0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2)
    )
    got, want = logits(hf, cfg, long_inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    full, _ = logits(hf, llama.Config.from_hf(mistral(None).config.to_dict()), long_inputs)
    assert (full - got).abs().max() > 1e-3  # the window is real: it changes 16-token logits
    hf.save_pretrained(tmp_path)
    model, _ = checkpoints.from_hf(str(tmp_path), adamw(), fp32_config())
    assert model.config == cfg
