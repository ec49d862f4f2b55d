"""``checkpoints.from_hf`` against transformers: directories written by ``save_pretrained`` in, for
a Llama with GQA (llama3 rope) and a Qwen2 (qkv bias); the logits and loss of the imported model,
and training after the import (the export of the trained model, world 1 vs world 2, too).

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

The export on its own: test_hf_export.py; bad input: test_hf_errors.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hf_reference import hf_loss, tree_paths
from hf_workers import (
    PARITY_FAMILIES,
    SMALL_SHARDS,
    adamw,
    assert_world_two_trains_like_world_one,
    fp32_config,
    import_train_export,
    save_hf,
)
from reference import make_batches

import checkpoints
import zinf_fn as zf
from layers import llama

MODEL_TYPE = {"llama3": "llama", "qwen2": "qwen2"}


def hf_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An HF model's state_dict by the engine's key paths, fp32."""
    return {llama.hf_to_ours(n): t.detach().float() for n, t in model.state_dict().items()}


# -- logits and loss -------------------------------------------------------------------------------


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


# -- training --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_training_after_from_hf_equals_transformers_adamw(family, placement, tmp_path):
    _, losses, _ = import_train_export(family, placement, tmp_path, SMALL_SHARDS)
    assert losses[-1] < losses[0]


def test_world_two_trains_like_world_one_and_writes_the_same_files(tmp_path):
    assert_world_two_trains_like_world_one("qwen2", tmp_path)
