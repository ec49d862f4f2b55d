"""Pure functional layers (``init``/``apply`` pairs over dict pytrees) and the GPT model built from them."""

from layers import attention, embedding, gpt, linear, mlp, norm
from layers.batch import check_batch, check_tokens
from layers.norm import layernorm, layernorm_init, rmsnorm, rmsnorm_init

__all__ = [
    "attention",
    "check_batch",
    "check_tokens",
    "embedding",
    "gpt",
    "layernorm",
    "layernorm_init",
    "linear",
    "mlp",
    "norm",
    "rmsnorm",
    "rmsnorm_init",
]
