"""LoRA over a frozen base stored bf16, int8 or NF4 (``zf.Config(frozen_storage=)``): bytes a step
moves, and loss.

A small GPT is first trained whole (``--pretrain`` steps, every parameter, in RAM) on a learnable
synthetic language (each next token a fixed function of the last, with 10 % noise), so the base is a
trained one, not random weights. That base is then loaded into a LoRA model (``layers.lora``, rank
``--rank`` on ``--targets``) once per storage, the base on NVMe, the adapters' optimizer states in
RAM, and each trains ``--steps`` steps on the same batches from the same adapters:

    bytes_per_param_<storage>   the bytes a LoRA step reads and writes through its tiers
    (``state_bytes_moved``)
                                per parameter of the frozen base (the same count for every storage)
    loss0_<storage>             the loss of the first step: the quantized base's cost before any
    training loss_<storage>              the mean loss of the last ``--last`` steps
    loss_delta_<storage>        loss_<storage> - loss_bf16

    python benchmarks/frozen_storage.py --dir /work/bench-x/frozen   # d_model 256, 4 layers; ~1 min
    on 2 cores

Last line: JSON {"metric": "nf4_loss_delta", "value": ..., "bytes_per_param_bf16": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import optree
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zinf_fn as zf  # noqa: E402
from layers import gpt, lora  # noqa: E402
from zinf_fn.state import units, view  # noqa: E402
from zinf_fn.tree import path_str  # noqa: E402

STORAGES = ("bf16", "int8", "nf4")


def batches(cfg: gpt.Config, n: int, batch: int, seed: int) -> list[dict]:
    """``n`` batches of the synthetic language: x[t] = (7 x[t-1] + 3) mod V, each token replaced by
    a uniform one with probability 0.1 (a bigram a trained base predicts well, not perfectly: the
    best loss is about 0.9)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
        for t in range(1, cfg.seq_len + 1):
            nxt = (7 * x[:, t - 1] + 3) % cfg.vocab_size
            noise = torch.rand(batch, generator=gen) < 0.1
            x[:, t] = torch.where(noise, x[:, t], nxt)
        out.append({"inputs": x[:, :-1], "targets": x[:, 1:]})
    return out


def pretrained(cfg: gpt.Config, args) -> dict:
    """The base: every parameter of the GPT trained ``--pretrain`` steps (fp32 masters,
    gathered)."""
    state = zf.init(gpt.model(cfg), zf.adamw(lr=3e-3, weight_decay=0.0), zf.Config(), seed=0)
    for batch in batches(cfg, args.pretrain, args.batch, seed=1):
        state, metrics = zf.train_step(state, batch)
    print(f"pretrained: loss {metrics['loss']:.4f} after {args.pretrain} steps", flush=True)
    return zf.gather_params(state)


def load_base_(state, base: dict) -> None:
    """Every base weight of ``state``'s LoRA model set from ``base`` (the adapters keep their init:
    ``lora``'s B is zero, so the step-0 model is the base); rows written as init writes them (a
    quantized base: its codes)."""
    v = view(state)
    params = zf.gather_params(state)
    for unit in units(v.n_layers):
        tree = params[unit.group][unit.row] if unit.group == "blocks" else params[unit.group]
        ours = base[unit.group][unit.row] if unit.group == "blocks" else base[unit.group]
        given = {
            path_str(p): x for p, x in zip(*optree.tree_flatten_with_path(ours)[:2], strict=True)
        }
        own = {
            path_str(p): x for p, x in zip(*optree.tree_flatten_with_path(tree)[:2], strict=True)
        }
        v.load_unit_(unit, lambda path, given=given, own=own: given.get(path, own[path]))


def run(cfg: gpt.Config, base: dict, storage: str, path: str, args) -> dict:
    """One storage's LoRA run: (bytes moved per step, first loss, every loss)."""
    lm = lora.apply(
        gpt.model(cfg), rank=args.rank, alpha=2.0 * args.rank, targets=tuple(args.targets)
    )
    Path(path, storage).mkdir()
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="cpu",
        nvme_path=f"{path}/{storage}",
        frozen_storage=storage,
    )
    state = zf.init(lm, zf.adamw(lr=args.lr, weight_decay=0.0), config, seed=0)
    load_base_(state, base)
    losses, moved = [], []
    for batch in batches(cfg, args.steps, args.batch, seed=2):
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
        moved.append(metrics["state_bytes_moved"])
    v = view(state)
    # the frozen groups' parameters (a quantized row's leaves, not its bytes:
    # ``FrozenCodes.values_numel``)
    params = sum(
        v.frozen.codes.values_numel(name, g.spec.numel) * g.rows
        for name, g in v.groups.items()
        if v.is_frozen(name)
    )
    v.close()
    return {"moved": statistics.median(moved[1:]), "params": params, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--pretrain", type=int, default=300, help="steps of the full training that makes the base"
    )
    parser.add_argument("--steps", type=int, default=60, help="LoRA steps of each storage")
    parser.add_argument(
        "--last", type=int, default=10, help="the final steps whose mean loss is reported"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument(
        "--targets", nargs="+", default=["attn.qkv"], help="the adapted block linears"
    )
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="directory for the NVMe tiers (created)"
    )
    args = parser.parse_args()
    cfg = gpt.Config(
        vocab_size=256,
        d_model=args.d_model,
        n_heads=max(1, args.d_model // 64),
        n_layers=args.layers,
        seq_len=args.seq,
    )
    base = pretrained(cfg, args)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path = tempfile.mkdtemp(prefix="frozen-", dir=args.dir)
    try:
        runs = {s: run(cfg, base, s, path, args) for s in STORAGES}
    finally:
        shutil.rmtree(path, ignore_errors=True)
    base_params = runs["bf16"]["params"]
    assert all(
        r["params"] == base_params for r in runs.values()
    )  # internal: one base, whatever its storage
    final = {s: statistics.mean(r["losses"][-args.last :]) for s, r in runs.items()}
    out = {"metric": "nf4_loss_delta", "value": round(final["nf4"] - final["bf16"], 5)}
    for s, r in runs.items():
        out.update(
            {
                f"bytes_per_param_{s}": round(r["moved"] / base_params, 3),
                f"loss0_{s}": round(r["losses"][0], 5),
                f"loss_{s}": round(final[s], 5),
                f"loss_delta_{s}": round(final[s] - final["bf16"], 5),
            }
        )
    out.update(
        base_params=base_params,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        rank=args.rank,
        targets=args.targets,
        pretrain_steps=args.pretrain,
        lora_steps=args.steps,
        last=args.last,
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
