"""The plain-PyTorch twin of ``layers.gpt``: an ``nn.Module`` GPT, tree <-> state_dict maps, test
batches.

``RefGPT`` is written with ``nn.Embedding`` / ``nn.LayerNorm`` / ``nn.Linear`` and nanoGPT-style
head splitting; it never calls ``layers/``, so agreeing with it is evidence, not a tautology. Its
parameters map one-to-one onto the functional full tree ``{"embed", "blocks": [...], "head"}``:

    embed.tok.w              <-> tok_emb.weight
    embed.pos.w              <-> pos_emb.weight
    blocks[i].<path>.w / .b  <-> blocks.{i}.<path>.weight / .bias
        for <path> in ln1, attn.qkv, attn.proj, ln2, mlp.fc, mlp.proj
    head.ln_f.w / .b         <-> ln_f.weight / ln_f.bias
    head.lm_head.w           <-> lm_head.weight

With ``Config(tie_embeddings=True)`` ``lm_head.weight`` *is* ``tok_emb.weight`` (one
``nn.Parameter``, as GPT-2 ties them): the state_dict has both names, ``named_parameters`` the
embedding only. The MLP's GELU follows ``Config.activation`` (``"gelu_new"``: transformers'
``NewGELUActivation``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from layers.gpt import Config

_LEAF_TO_NN = {"w": "weight", "b": "bias"}
_NN_TO_LEAF = {v: k for k, v in _LEAF_TO_NN.items()}
_EMBED_TO_NN = {"tok": "tok_emb", "pos": "pos_emb"}
_NN_TO_EMBED = {v: k for k, v in _EMBED_TO_NN.items()}


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``NewGELUActivation.forward``, written out (GPT-2's ``gelu_new``)."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)  # 3 x (B, T, D)
        h = self.n_heads
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))  # 3 x (B, H, T, Dh)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, Dh)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))  # (B, T, D)


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)

        self.act = _gelu_new if cfg.activation == "gelu_new" else nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class RefGPT(nn.Module):
    """GPT-2 style decoder; ``forward(inputs, targets)`` is the mean cross-entropy, as
    ``plain_loss``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def block_modules(self) -> nn.ModuleList:
        """The blocks in order, e.g. to run each under ``torch.utils.checkpoint``."""
        return self.blocks

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, D)."""
        return self.tok_emb(inputs) + self.pos_emb.weight[: inputs.shape[1]]

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(B, T, D) carry and (B, T) targets -> scalar mean cross-entropy, with fp32 logits."""
        logits = self.lm_head(self.ln_f(x)).float()  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        return self.head_loss(x, targets)


def names_from_tree(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """One layer's nested tree -> dotted nn names: ``{"qkv": {"w": t}}`` -> ``{"qkv.weight":
    t}``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(names_from_tree(value, f"{prefix}{key}."))
        else:
            out[prefix + _LEAF_TO_NN[key]] = value
    return out


def tree_from_names(sd: dict[str, torch.Tensor]) -> dict:
    """Dotted nn names -> one nested tree; the inverse of ``names_from_tree`` with no prefix."""
    tree: dict = {}
    for name, value in sd.items():
        _insert(tree, name.split("."), value)
    return tree


def _insert(tree: dict, path: list[str], value: torch.Tensor) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[_NN_TO_LEAF[path[-1]]] = value


def tree_to_state_dict(full: dict) -> dict[str, torch.Tensor]:
    """Full functional tree -> ``RefGPT`` state_dict names (the tensors themselves, not copies)."""
    out: dict[str, torch.Tensor] = {}
    for key, sub in full["embed"].items():
        out.update(names_from_tree(sub, f"{_EMBED_TO_NN[key]}."))
    for i, layer in enumerate(full["blocks"]):
        out.update(names_from_tree(layer, f"blocks.{i}."))
    out.update(names_from_tree(full["head"]))
    return out


def state_dict_to_tree(sd: dict[str, torch.Tensor], n_layers: int) -> dict:
    """``RefGPT`` state_dict (or any name -> tensor map, e.g. grads) -> full tree; inverts the
    above."""
    full: dict = {"embed": {}, "blocks": [{} for _ in range(n_layers)], "head": {}}
    for name, value in sd.items():
        path = name.split(".")
        if path[0] in _NN_TO_EMBED:
            _insert(full["embed"], [_NN_TO_EMBED[path[0]], *path[1:]], value)
        elif path[0] == "blocks":
            _insert(full["blocks"][int(path[1])], path[2:], value)
        elif path[0] in ("ln_f", "lm_head"):
            _insert(full["head"], path, value)
        else:
            raise ValueError(f"state_dict_to_tree: unexpected parameter name {name!r}")
    return full


def load_tree(module: RefGPT, full: dict) -> RefGPT:
    """Copy a full functional tree into ``module``'s parameters (strict: every name must match)."""
    module.load_state_dict(tree_to_state_dict(full), strict=True)
    return module


def tree_from_module(module: RefGPT) -> dict:
    """Detached copies of ``module``'s parameters as a full functional tree (a tied weight in both
    places)."""
    sd = {name: p.detach().clone() for name, p in module.state_dict().items()}
    return state_dict_to_tree(sd, module.cfg.n_layers)


def grad_tree(module: RefGPT) -> dict:
    """``module``'s ``.grad`` tensors as a full functional tree (after ``loss.backward()``)."""
    return state_dict_to_tree(
        {name: p.grad for name, p in module.named_parameters()}, module.cfg.n_layers
    )


def make_batches(
    cfg: Config, n: int, batch_size: int, seed: int, seq_len: int | None = None
) -> list[dict]:
    """``n`` deterministic batches ``{"inputs", "targets"}`` of shape (batch_size, seq_len or
    cfg.seq_len).

    Tokens are uniform over the vocabulary; ``targets`` is ``inputs`` shifted left by one position.
    """
    t = cfg.seq_len if seq_len is None else seq_len
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab_size, (batch_size, t + 1), generator=gen)  # (B, T+1)
        batches.append({"inputs": tokens[:, :-1].clone(), "targets": tokens[:, 1:].clone()})
    return batches
