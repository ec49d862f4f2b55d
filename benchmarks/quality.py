"""Training quality of compressed optimizer states: the README's GPT trained with each state format.

The model, corpus and schedule are ``zinf-fn train``'s (``layers/gpt.py``: 4 layers, d_model 128,
4 heads, 128 tokens, byte vocabulary; Python's standard-library sources; batch 16; AdamW lr 3e-3
with 30 warm-up steps and a cosine to 10 %, b2 0.95, weight decay 0.1 off norms and biases;
global-norm clip 1.0). Each seed fixes the initialisation and the data order, the same for every
variant. The loop is plain (``PlainTrainer``: autograd over ``zf.plain_loss``) with the optimizer
update done by ``optim.compressed.adamw_piece_`` over each parameter tensor (flattened, zero-padded
to a multiple of 256, one piece, ``unit_seed`` its index); the model computes with the bf16 copy
upcast to fp32, as the engine does with ``param_dtype=bf16`` on CPU. Variants:

    fp32_rne    fp32 master and moments, copy rounded to nearest even (``.to(bfloat16)``): today's
    run fp32        fp32 master and moments, copy rounded ties away
    (``remainder.to_bf16_ties_away``) remainder   bf16 copy + 16-bit remainder master, fp32 moments:
    must equal ``fp32`` bitwise int8        remainder master, int8 moments (leaves under 4096
    elements keep fp32 moments) bf16        remainder master, bf16 moments with stochastic rounding
    (same rule)

Last line: JSON with the final held-out loss (mean of 4 fixed held-out batches) of each variant and
seed, ``int8_gap_nats`` / ``bf16_gap_nats`` (mean over seeds, minus ``fp32``'s), ``*_gap_sigma``
(that gap over the sample standard deviation of ``fp32``'s seeds), ``remainder_gap_nats`` (to
``fp32_rne``) and ``remainder_bitwise`` (every step's loss and the final parameters of ``remainder``
equal ``fp32``'s). The curves go to ``docs/quality_curves.png``. To run the engine instead of the
plain loop, replace ``PlainTrainer`` by a class with the same ``step`` / ``eval`` (``zf.train_step``
/ ``zf.eval_step``).

    python benchmarks/quality.py --quick   # d_model 64, 2 layers, 64 tokens, 200 steps x 3 seeds x
    5 variants python benchmarks/quality.py           # train_gpt's model (d_model 128, 4 layers,
    128 tokens), 300 steps
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import zinf_fn as zf  # noqa: E402
from layers import gpt  # noqa: E402
from zinf_cli import corpus as data  # noqa: E402
from zinf_cli.schedules import decays, warmup_then  # noqa: E402
from zinf_fn.optim import DecaySpans, clip_coefficient, formats  # noqa: E402
from zinf_fn.optim import compressed as C  # noqa: E402
from zinf_fn.optim.remainder import to_bf16_ties_away  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    master: str  # formats.MasterFormat kind
    moments: str  # formats.MomentsFormat kind
    ties_away: bool  # the copy's rounding (a remainder master's copy is always ties away)


VARIANTS = (
    Variant("fp32_rne", "fp32", "fp32", False),
    Variant("fp32", "fp32", "fp32", True),
    Variant("remainder", "remainder", "fp32", True),
    Variant("int8", "remainder", "int8", True),
    Variant("bf16", "remainder", "bf16", True),
)
HYPER = C.AdamWHyper(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def leaves(tree, prefix=""):
    """[(key path, tensor)] of a tree of dicts and lists, in a fixed order."""
    if isinstance(tree, dict):
        return [x for k in tree for x in leaves(tree[k], f"{prefix}{k}.")]
    if isinstance(tree, (list, tuple)):
        return [x for i, t in enumerate(tree) for x in leaves(t, f"{prefix}{i}.")]
    return [(prefix[:-1], tree)]


def rebuild(tree, values, pos=None):
    """``tree``'s structure with its leaves replaced, in ``leaves`` order, by ``values``."""
    pos = pos if pos is not None else [0]
    if isinstance(tree, dict):
        return {k: rebuild(v, values, pos) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [rebuild(v, values, pos) for v in tree]
    pos[0] += 1
    return values[pos[0] - 1]


class Leaf:
    """One parameter tensor's optimizer state: its padded flat master, moments and bf16 copy."""

    def __init__(self, index: int, path: str, value: torch.Tensor, variant: Variant):
        self.index, self.path, self.shape, self.numel = index, path, value.shape, value.numel()
        padded = -(-self.numel // formats.BLOCK) * formats.BLOCK
        flat = torch.zeros(padded)
        flat[: self.numel] = value.reshape(-1)
        self.master = C.init_master(formats.MasterFormat(variant.master), flat)
        kind = variant.moments if formats.compressed_leaf(None, path, self.numel) else "fp32"
        self.moments = C.init_moments(formats.MomentsFormat(kind), padded)
        self.decay = None if decays(path) else DecaySpans((), padded)
        self.ties_away = variant.ties_away
        if isinstance(self.master, C.RemainderMaster):
            self.copy16 = self.master.param  # the master's high half: updated by the kernel
        else:
            self.copy16 = to_bf16_ties_away(flat) if self.ties_away else flat.to(torch.bfloat16)

    def param(self) -> torch.Tensor:
        """The compute parameter: the bf16 copy upcast to fp32, in the leaf's shape."""
        return self.copy16[: self.numel].float().view(self.shape)

    def update(self, grad: torch.Tensor, step: int, lr: float) -> None:
        g = torch.zeros(self.copy16.numel())
        g[: self.numel] = grad.reshape(-1)
        copy = (
            self.copy16
            if self.ties_away and not isinstance(self.master, C.RemainderMaster)
            else None
        )
        C.adamw_piece_(
            g,
            self.master,
            self.moments,
            HYPER,
            step,
            lr,
            element_offset=0,
            unit_seed=self.index,
            copy16=copy,
            decay=self.decay,
        )
        if not self.ties_away:
            self.copy16.copy_(self.master)  # torch's cast: round to nearest even


class PlainTrainer:
    """The plain loop: autograd over ``zf.plain_loss`` of the bf16 copies upcast, clipping, per-leaf
    update."""

    def __init__(self, model: zf.Model, cfg: gpt.Config, variant: Variant, seed: int, args):
        gen = torch.Generator().manual_seed(seed)
        tree = {
            "embed": model.embed.init(gen),
            "blocks": [model.block.init(gen, i) for i in range(cfg.n_layers)],
            "head": model.head.init(gen),
        }
        self.model, self.tree, self.clip = model, tree, args.clip
        self.leaves = [
            Leaf(i, path, value.float(), variant) for i, (path, value) in enumerate(leaves(tree))
        ]
        self.schedule = warmup_then("cosine", args.lr, args.warmup, args.steps)

    def _params(self, grad: bool):
        values = [leaf.param().requires_grad_(grad) for leaf in self.leaves]
        return values, rebuild(self.tree, values)

    def step(self, batch: dict, step: int) -> float:
        values, params = self._params(True)
        loss = zf.plain_loss(self.model, params, batch)
        grads = torch.autograd.grad(loss, values)
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads])
        ).item()
        scale = clip_coefficient(norm, self.clip) if self.clip else 1.0
        for leaf, g in zip(self.leaves, grads, strict=True):
            leaf.update(g * scale if scale < 1.0 else g, step, self.schedule(step))
        return float(loss.detach())

    @torch.no_grad()
    def eval(self, batches: list) -> float:
        _, params = self._params(False)
        return statistics.fmean(float(zf.plain_loss(self.model, params, b)) for b in batches)

    def param_bits(self) -> list[torch.Tensor]:
        return [leaf.copy16.view(torch.int16).clone() for leaf in self.leaves]


def train(variant: Variant, seed: int, args, corpus) -> dict:
    """One run: its per-step train losses, held-out losses every ``eval_every`` steps, and final
    bits."""
    cfg = gpt.Config(
        vocab_size=256, d_model=args.d_model, n_heads=4, n_layers=args.layers, seq_len=args.seq_len
    )
    trainer = PlainTrainer(gpt.model(cfg), cfg, variant, seed, args)
    train_bytes, held_out = corpus
    stream = data.batches(train_bytes, args.batch_size, cfg.seq_len, seed)
    evals = data.batches(held_out, args.batch_size, cfg.seq_len, 1234)
    eval_batches = [next(evals) for _ in range(4)]
    losses, heldout = [], []
    for step in range(args.steps):
        losses.append(trainer.step(next(stream), step))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            heldout.append((step + 1, trainer.eval(eval_batches)))
    return {"losses": losses, "heldout": heldout, "bits": trainer.param_bits()}


def gap(runs: dict, name: str, base: str) -> tuple[float, float]:
    """(mean final held-out loss of ``name`` minus ``base``'s, that gap over ``base``'s seed
    std)."""
    final = {k: [r["heldout"][-1][1] for r in v] for k, v in runs.items()}
    diff = statistics.fmean(final[name]) - statistics.fmean(final[base])
    return diff, diff / statistics.stdev(final[base])


def bitwise_equal(a: list, b: list) -> bool:
    return all(
        x["losses"] == y["losses"]
        and all(torch.equal(p, q) for p, q in zip(x["bits"], y["bits"], strict=True))
        for x, y in zip(a, b, strict=True)
    )


def plot(runs: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, seeds in runs.items():
        n = len(seeds[0]["losses"])
        mean = [statistics.fmean(r["losses"][i] for r in seeds) for i in range(n)]
        smooth, ema = [], mean[0]
        for x in mean:
            ema = 0.9 * ema + 0.1 * x
            smooth.append(ema)
        left.plot(range(1, n + 1), smooth, label=name)
        steps = [s for s, _ in seeds[0]["heldout"]]
        right.plot(
            steps,
            [statistics.fmean(r["heldout"][i][1] for r in seeds) for i in range(len(steps))],
            marker="o",
            label=name,
        )
    left.set(title="train loss (mean of seeds, EMA 0.9)", xlabel="step", ylabel="nats/byte")
    right.set(title="held-out loss (mean of seeds)", xlabel="step", ylabel="nats/byte")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smaller GPT (d_model 64, 2 layers, 64 tokens), 200 "
        "steps: ~5-10 minutes on 2 busy cores (the default is train_gpt's model and 300 steps)",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "quality_curves.png"))
    args = p.parse_args()
    for name, quick, full in (
        ("steps", 200, 300),
        ("d_model", 64, 128),
        ("layers", 2, 4),
        ("seq_len", 64, 128),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    corpus = data.split(data.load_corpus(None))
    runs, t0 = {}, time.perf_counter()
    for variant in VARIANTS:
        runs[variant.name] = [train(variant, seed, args, corpus) for seed in range(args.seeds)]
        finals = [round(r["heldout"][-1][1], 4) for r in runs[variant.name]]
        print(
            f"{variant.name:10s} final held-out {finals}  ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    plot(runs, args.plot)
    figures = {
        "metric": "optimizer_state_quality",
        "steps": args.steps,
        "seeds": args.seeds,
        "model": f"d{args.d_model} L{args.layers} T{args.seq_len} B{args.batch_size}",
        "final_heldout": {k: [round(r["heldout"][-1][1], 4) for r in v] for k, v in runs.items()},
    }
    for name in ("int8", "bf16"):
        nats, sigma = gap(runs, name, "fp32")
        figures |= {f"{name}_gap_nats": round(nats, 4), f"{name}_gap_sigma": round(sigma, 2)}
    figures["remainder_gap_nats"] = round(gap(runs, "remainder", "fp32_rne")[0], 4)
    figures["remainder_bitwise"] = bitwise_equal(runs["remainder"], runs["fp32"])
    figures["seconds"] = round(time.perf_counter() - t0)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
