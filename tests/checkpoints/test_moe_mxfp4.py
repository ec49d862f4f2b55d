"""checkpoints.mxfp4: gpt-oss's MXFP4 experts dequantized as transformers does, and the refusal of
other quantization configs.

The reference is transformers' own ``integrations.mxfp4.convert_moe_packed_tensors`` on blocks and
scales this test packs (random codes, exponents around the bias); dequantization is a table lookup
and an exact power-of-two scaling, so the comparison is bitwise, in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from checkpoints import CheckpointError, mxfp4
from layers import moe_names

E, ROWS, GROUPS = 3, 10, 2  # 3 experts, 10 output rows, 2 blocks of 32 input features
SCALE_LOW, SCALE_HIGH = 117, 137  # exponents -10 .. 9: every value stays a normal number in bf16


def packed(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, ROWS, GROUPS, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(
        SCALE_LOW, SCALE_HIGH, (E, ROWS, GROUPS), generator=gen, dtype=torch.uint8
    )
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers(dtype):
    blocks, scales = packed(0)
    want = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    got = mxfp4.dequantize(blocks, scales, dtype)
    assert got.shape == want.shape == (E, GROUPS * 32, ROWS)
    assert got.dtype == dtype and torch.equal(got, want)


class DictWeights:
    """A checkpoint's tensors from a dict, with ``hf_files.HFWeights``' interface."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def get(self, name):
        return self.tensors[name]

    def locate(self, name):
        return f"tensor {name!r} of the test's dict"


def test_packed_experts_read_as_unquantized():
    """A gpt-oss layer whose gate_up_proj and down_proj are packed reads, through the name map, as
    the stacked leaves of the dequantized tensors."""
    gate_up = packed(1)  # gate_up_proj: 2I = 10 rows over D = 64
    down = packed(2)
    tensors = {
        "mlp.experts.gate_up_proj_blocks": gate_up[0],
        "mlp.experts.gate_up_proj_scales": gate_up[1],
        "mlp.experts.down_proj_blocks": down[0],
        "mlp.experts.down_proj_scales": down[1],
        "mlp.router.weight": torch.randn(E, 64),
    }
    weights = mxfp4.Mxfp4Weights(DictWeights(tensors))
    assert sorted(weights.names()) == [
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
        "mlp.router.weight",
    ]
    assert weights.shape("mlp.experts.gate_up_proj") == (E, 64, ROWS)
    fused = convert_moe_packed_tensors(*gate_up, dtype=torch.float32)  # (E, D, 2I) input x output
    gate_up = moe_names.import_rule(moe_names.GPT_OSS[2], weights.get, E)  # (E, 2I, D)
    assert torch.equal(gate_up, torch.cat((fused[..., 0::2], fused[..., 1::2]), -1).mT)
    assert torch.equal(weights.get("mlp.router.weight"), tensors["mlp.router.weight"])


def test_unpaired_blocks_are_refused():
    blocks, _ = packed(3)
    with pytest.raises(CheckpointError, match="gate_up_proj.*partner"):
        mxfp4.Mxfp4Weights(DictWeights({"mlp.experts.gate_up_proj_blocks": blocks}))


UNKNOWN = [{"quant_method": "gptq", "bits": 4}, {"quant_method": "bitsandbytes"}, {}]


@pytest.mark.parametrize("quant", UNKNOWN)
def test_unknown_quantization_is_refused_by_field(quant):
    with pytest.raises(CheckpointError, match=r"quantization_config\.quant_method"):
        mxfp4.quantization({"model_type": "gpt_oss", "quantization_config": quant})


def test_known_quantization():
    assert mxfp4.quantization({"model_type": "qwen3_moe"}) is None
    packed_config = {"quant_method": "mxfp4"}
    gpt_oss = {"model_type": "gpt_oss", "quantization_config": packed_config}
    assert mxfp4.quantization(gpt_oss) == "mxfp4"
    with pytest.raises(CheckpointError, match="model_type 'llama'"):
        mxfp4.quantization({"model_type": "llama", "quantization_config": packed_config})
