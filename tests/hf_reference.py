"""Tiny random transformers models of the dense decoder families and the helpers that compare them
with ``layers.llama``.

transformers is the reference here, as ``reference.RefGPT`` is for the GPT: it never calls
``layers/``. Nothing is downloaded: every model is built from a config with random weights.

Loss convention: the engine's batch is ``{"inputs": (B, T), "targets": (B, T)}`` with ``targets``
already shifted (``targets[:, t]`` is the token after ``inputs[:, t]``) and the loss is the mean
over all B*T positions. HF shifts ``labels`` itself and drops the last position; passing
``shift_labels=targets`` (with ``labels`` only to switch the loss on) makes HF's ``ForCausalLMLoss``
use the targets as they are, so both sides compute ``F.cross_entropy(logits.float().view(-1, V),
targets.view(-1))``.
"""

from __future__ import annotations

import torch
import transformers

import zinf_fn as zf
from layers import decoder_names, llama, moe_names

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
GEMMA_LAYERS = ["sliding_attention", "full_attention"]
GEMMA_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
}

GPT_OSS_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4,
    "rope_theta": 150_000.0,
}
# the mixtures of experts: 4 experts of width 16, 2 per token
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.5)


def _gpt_oss(**sizes) -> transformers.GptOssConfig:
    """A small gpt-oss config (4 experts, heads of 16, a window of 4 then a full layer, YaRN), with
    ``sizes`` over ``SMALL``'s."""
    return transformers.GptOssConfig(
        **{**SMALL, **sizes},
        **MOE,
        num_local_experts=4,
        head_dim=16,
        sliding_window=4,
        layer_types=GEMMA_LAYERS,
        rope_parameters=dict(GPT_OSS_YARN),
    )


# name -> (transformers class, config kwargs): GQA everywhere (4 query heads share 2 key/value
# heads).
FAMILIES = {
    "llama3": (
        transformers.LlamaForCausalLM,
        lambda: transformers.LlamaConfig(
            **SMALL, rope_theta=500_000.0, rope_scaling=dict(LLAMA3_ROPE)
        ),
    ),
    "llama_linear": (
        transformers.LlamaForCausalLM,
        lambda: transformers.LlamaConfig(
            **SMALL, rope_scaling={"rope_type": "linear", "factor": 2.0}
        ),
    ),
    "llama_bias": (
        transformers.LlamaForCausalLM,  # attention_bias (q, k, v and o) and mlp_bias, default rope
        lambda: transformers.LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True),
    ),
    "qwen2": (
        transformers.Qwen2ForCausalLM,
        lambda: transformers.Qwen2Config(**SMALL, rope_theta=1_000_000.0),
    ),
    "mistral": (
        transformers.MistralForCausalLM,  # head_dim 16 != hidden/heads = 8, as Mistral Nemo does
        lambda: transformers.MistralConfig(**SMALL, head_dim=16, sliding_window=None),
    ),
    "llama_tied": (
        transformers.LlamaForCausalLM,  # tie_word_embeddings: lm_head.weight is embed_tokens.weight
        lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True),
    ),
    # the families of layers.hf_families beyond Llama's: q/k norms and biases; fused tensors;
    # Gemma's everything
    "qwen3": (
        transformers.Qwen3ForCausalLM,
        lambda: transformers.Qwen3Config(**SMALL, head_dim=16, attention_bias=True),
    ),
    "phi3": (
        transformers.Phi3ForCausalLM,  # its default pad_token_id 32000 is out of vocabulary
        lambda: transformers.Phi3Config(**SMALL, pad_token_id=0, eos_token_id=1, bos_token_id=2),
    ),
    "gemma3": (
        transformers.Gemma3ForCausalLM,  # a local (window 4) and a global layer, own ropes
        lambda: transformers.Gemma3TextConfig(
            **SMALL,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=4,
            layer_types=GEMMA_LAYERS,
            final_logit_softcapping=30.0,
            rope_parameters=GEMMA_ROPE,
        ),
    ),
    # Gemma 3's defaults: sliding_window_pattern 6 makes both layers local (window 4, rope theta
    # 1e4)
    "gemma3_local": (
        transformers.Gemma3ForCausalLM,
        lambda: transformers.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=4),
    ),
    # sliding windows of 4 in sequences of 16: every layer (Mistral), the layers from
    # max_window_layers on (Qwen2)
    "mistral_w4": (
        transformers.MistralForCausalLM,
        lambda: transformers.MistralConfig(**SMALL, sliding_window=4),
    ),
    "qwen2_w4": (
        transformers.Qwen2ForCausalLM,
        lambda: transformers.Qwen2Config(
            **SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=1
        ),
    ),
}
# the mixtures of experts (tests/models/test_moe_families.py): transformers holds their experts
# fused in memory (IN_MEMORY_MOE), per expert on disk
MOE_FAMILIES = {
    "qwen3_moe": (
        transformers.Qwen3MoeForCausalLM,
        lambda: transformers.Qwen3MoeConfig(
            **SMALL,
            **MOE,
            num_experts=4,
            moe_intermediate_size=16,
            head_dim=16,
            attention_bias=True,
        ),
    ),
    # a window of 4 on every layer (use_sliding_window), in sequences of 16
    "qwen3_moe_w4": (
        transformers.Qwen3MoeForCausalLM,
        lambda: transformers.Qwen3MoeConfig(
            **SMALL,
            **MOE,
            num_experts=4,
            moe_intermediate_size=16,
            use_sliding_window=True,
            sliding_window=4,
        ),
    ),
    "mixtral": (
        transformers.MixtralForCausalLM,
        lambda: transformers.MixtralConfig(
            **{**SMALL, "intermediate_size": 16}, **MOE, num_local_experts=4
        ),
    ),
    "olmoe": (
        transformers.OlmoeForCausalLM,  # whole-width q/k norms, pad_token_id 1 (its default)
        lambda: transformers.OlmoeConfig(
            **{**SMALL, "intermediate_size": 16}, **MOE, num_experts=4
        ),
    ),
    # q, k and v clamped to [-0.1, 0.1]: 90% of q and k and 40% of v clipped in the first layer
    "olmoe_clip": (
        transformers.OlmoeForCausalLM,
        lambda: transformers.OlmoeConfig(
            **{**SMALL, "intermediate_size": 16}, **MOE, num_experts=4, clip_qkv=0.1
        ),
    ),
    # sinks, q/k/v/o biases, a clamped SwiGLU with biases, YaRN, a window of 4 then a full layer
    "gpt_oss": (transformers.GptOssForCausalLM, lambda: _gpt_oss(intermediate_size=16)),
    # expert widths a multiple of MXFP4's 32-value blocks (tests the packed checkpoint)
    "gpt_oss_i32": (transformers.GptOssForCausalLM, _gpt_oss),
    # the load-balancing loss on (output_router_logits), coefficient 0.5 so that it shows
    "qwen3_moe_aux": (
        transformers.Qwen3MoeForCausalLM,
        lambda: transformers.Qwen3MoeConfig(
            **SMALL, **MOE, num_experts=4, moe_intermediate_size=16, output_router_logits=True
        ),
    ),
}


# GPT2LMHeadModel (tests/models/test_gpt2_hf.py): tied head, Conv1D weights, learned positions
GPT2_SMALL = dict(
    vocab_size=96,
    n_positions=16,
    n_embd=32,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A random fp32 HF model of ``family`` (a key of FAMILIES or MOE_FAMILIES, or "gpt2") in eval
    mode; biases and norm weights random too (not 0 and 1), so a swapped or dropped bias or norm
    cannot hide behind its initial value."""
    if family == "gpt2":
        return gpt2(seed)
    cls, make_config = {**FAMILIES, **MOE_FAMILIES}[family]
    torch.manual_seed(seed)
    return randomize_(cls(make_config()).eval(), seed, "norm")


def gpt2(seed: int = 0, **changes) -> transformers.GPT2LMHeadModel:
    """A random fp32 GPT-2 of GPT2_SMALL with ``changes`` to its config; biases and layernorm
    weights random too, so a swapped one cannot hide."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**{**GPT2_SMALL, **changes})
    return randomize_(transformers.GPT2LMHeadModel(config).eval(), seed, ".ln_")


def randomize_(model: torch.nn.Module, seed: int, norm_marker: str) -> torch.nn.Module:
    """Draw ``model``'s biases (``* 0.1``) and norm weights (``1 + 0.1 * N(0, 1)``; the parameters
    whose name contains ``norm_marker``) from ``seed + 1``, in place; returns ``model``."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif norm_marker in name:
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.1)
    return model


def engine_config(hf: torch.nn.Module) -> llama.Config:
    """The ``llama.Config`` of an HF model, through its ``config.json`` dict as ``from_hf`` will
    read it."""
    return llama.Config.from_hf(hf.config.to_dict())


# an MoE model's in-memory tensor (after ``model.layers.{i}.mlp.``) -> its leaf (after ``mlp.``):
# Qwen3-MoE, Mixtral and OLMoE hold their experts fused, gate rows first, as layers.moe does
IN_MEMORY_MOE = {
    "gate.weight": "router.w",
    "experts.gate_up_proj": "experts.gate_up.w",
    "experts.down_proj": "experts.down.w",
}


def engine_weights(state_dict: dict, cfg: llama.Config) -> dict[str, torch.Tensor]:
    """An HF state_dict of ``cfg``'s family -> ``{engine key path: tensor}``: its names through the
    family's table, a fused tensor cut into its parts (a tied head's ``lm_head.weight`` is the
    embedding, as the engine's ``zf.gather_params`` shows it)."""
    out, covered = _fused_on_disk(state_dict, cfg)
    for name, value in state_dict.items():
        if name in covered:
            continue
        layer, _, rest = name.partition(".mlp.")
        if cfg.moe is not None and rest in IN_MEMORY_MOE:  # transformers' fused in-memory experts
            out[f"blocks.{layer.split('.')[-1]}.mlp.{IN_MEMORY_MOE[rest]}"] = value
            continue
        parts = decoder_names.fused_parts(cfg, name)
        if parts:
            pieces = value.split([rows for _, rows in parts])
            out.update({path: piece for (path, _), piece in zip(parts, pieces, strict=True)})
        else:
            out[decoder_names.hf_to_ours(name, cfg.family)] = value
    return out


def hf_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A transformers model's weights by the engine's key paths (``engine_weights`` of its
    state_dict: fused tensors cut, experts as stacked leaves)."""
    return engine_weights(
        {n: t.detach() for n, t in model.state_dict().items()}, engine_config(model)
    )


def _fused_on_disk(state_dict: dict, cfg: llama.Config) -> tuple[dict, set]:
    """gpt-oss's experts, router and sinks (in memory as on disk) through its ``moe_names``
    rules: ``({key path: tensor}, the HF names used)``; ``({}, set())`` for other families."""
    if cfg.family != "gpt_oss":
        return {}, set()
    rules = moe_names.RULES[cfg.family]
    out = {}
    covered = set()
    for i in range(cfg.n_layers):
        prefix = f"model.layers.{i}."

        def get(name: str, prefix: str = prefix) -> torch.Tensor:
            return state_dict[prefix + name]

        leaves = moe_names.import_layer(rules, get, cfg.moe.n_experts)
        out.update({f"blocks.{i}.{path}": t for path, t in leaves.items()})
        covered.update(prefix + name for name in moe_names.hf_names(rules, cfg.moe.n_experts))
    return out, covered


def full_tree(state_dict: dict, n_layers: int, cfg: llama.Config | None = None) -> dict:
    """An HF state_dict -> the engine's full tree ``{"embed", "blocks": [...], "head"}`` through the
    name map (of ``cfg``'s family, ``engine_weights``; None: Llama's)."""
    full: dict = {"embed": {}, "blocks": [{} for _ in range(n_layers)], "head": {}}
    paths = (
        engine_weights(state_dict, cfg)
        if cfg is not None
        else {llama.hf_to_ours(name): value for name, value in state_dict.items()}
    )
    for name, value in paths.items():
        path = name.split(".")
        tree, rest = (
            (full["blocks"][int(path[1])], path[2:])
            if path[0] == "blocks"
            else (full[path[0]], path[1:])
        )
        for key in rest[:-1]:
            tree = tree.setdefault(key, {})
        tree[rest[-1]] = value
    return full


def tree_paths(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """A full tree -> ``{key path: tensor}`` with the engine's paths (``blocks.1.attn.q.w``)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(tree_paths(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def hf_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """HF's own loss of ``batch`` under the engine's convention (see the module docstring)."""
    targets = batch["targets"].contiguous()
    return model(input_ids=batch["inputs"], labels=targets, shift_labels=targets).loss


def train_engine(state, batches: list) -> tuple:
    """``zf.train_step`` over ``batches``: (the final state, the loss of every step, the final
    master weights by key path)."""
    losses = []
    for batch in batches:
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
    return state, losses, tree_paths(zf.gather_params(state))
