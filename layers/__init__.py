"""Pure functional layers (``init``/``apply`` pairs over dict pytrees) and the models built from
them (GPT, Llama)."""

from layers import attention, embedding, gpt, gpt2_hf, linear, llama, lora, mlp, norm, rope
from layers.batch import check_batch, check_tokens
from layers.norm import layernorm, layernorm_init, rmsnorm, rmsnorm_init

__all__ = [
    "attention",
    "check_batch",
    "check_tokens",
    "embedding",
    "gpt",
    "gpt2_hf",
    "layernorm",
    "layernorm_init",
    "linear",
    "llama",
    "lora",
    "mlp",
    "norm",
    "rmsnorm",
    "rmsnorm_init",
    "rope",
]
