"""The frozen-leaf tests' shared parts (tests/engine/test_frozen*.py): trainable predicates, the
engine run and its nn.Module + AdamW reference, the unchanged-frozen-leaves check, and two recorders
(the rows a tier writes, the matmuls a pull-back runs)."""

from __future__ import annotations

import optree
import torch
from engine_helpers import BETAS, CFG, EPS, LR, WD, batches, reference_steps
from reference import RefGPT, load_tree, tree_to_state_dict
from torch.utils._python_dispatch import TorchDispatchMode

import zinf_fn as zf
from layers import gpt
from zinf_fn.tree import path_str

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def embed_and_norms_frozen(path: str) -> bool:
    return not (path.startswith("embed.") or ".ln" in path)


def only_mlp_trains(path: str) -> bool:
    return ".mlp." in path


def run_frozen(config: zf.Config, trainable, steps: int = 6, optimizer=None):
    opt = optimizer or zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    state = zf.init(gpt.model(CFG)._replace(trainable=trainable), opt, config, seed=0)
    initial, initial16 = zf.gather_params(state), zf.gather_params(state, "param")
    losses = []
    for batch in batches(steps):
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
    return losses, zf.gather_params(state), initial, (initial16, zf.gather_params(state, "param"))


def run_frozen_reference(
    initial: dict, trainable, steps: int = 6, grad_accum: int = 1, clip: float | None = None
):
    """nn.Module + AdamW(fused) over the trainable parameters; the frozen ones
    ``requires_grad=False``."""
    model = load_tree(RefGPT(CFG), initial)
    paths = optree.tree_map_with_path(lambda p, _: path_str(p), initial)
    path_of = tree_to_state_dict(paths)  # nn name -> engine key path
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(path_of[name]))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    return reference_steps(model, opt, batches(steps), grad_accum, clip, params)


def assert_frozen_unchanged(before: dict, after: dict, trainable) -> None:
    changed = []
    paths, leaves, _ = optree.tree_flatten_with_path(before)
    for path, x, y in zip(paths, leaves, optree.tree_leaves(after), strict=True):
        if not trainable(path_str(path)) and not torch.equal(x, y):
            changed.append(path_str(path))
    assert not changed, f"frozen leaves changed: {changed}"


class RowWrites:
    """Records the (key, row) of every ``write_`` a tier gets, and forwards every call."""

    def __init__(self, inner):
        self.inner, self.rows = inner, set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write_(self, key, row, src, start=0):
        self.rows.add((key, row))
        return self.inner.write_(key, row, src, start)


class Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))
