"""The reverse scan against autograd through the plain loop, the memory contract, fetch counts."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import optree
import pytest
import torch
from engine_helpers import CFG, batches, run_engine
from engine_internals import tape_tensors
from reference import make_batches

import zinf_fn as zf
from layers import gpt
from zinf_fn.layout.units import units
from zinf_fn.scan import ScanOptions, backward_scan, forward_scan, head_step
from zinf_fn.state import view
from zinf_fn.tree import flat_spec


class _Layer:
    def __init__(self, unit, tree):
        self.unit, self.tree = unit, tree


def _full_params(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": model.embed.init(gen),
        "blocks": [model.block.init(gen, i) for i in range(model.n_layers)],
        "head": model.head.init(gen),
    }


def _tree_of(full, unit):
    return full["blocks"][unit.row] if unit.group == "blocks" else full[unit.group]


class _MemoryIO:
    """The scan's I/O (``zinf_fn.scan.ScanIO``) over in-memory trees, every gradient kept."""

    options = ScanOptions()

    def __init__(self, full, plan: list, specs: dict):
        self.full = full
        self.plan = plan
        self.specs = specs
        self.grads: dict[str, torch.Tensor] = {}

    def get(self, i):
        return _Layer(self.plan[i], _tree_of(self.full, self.plan[i]))

    def release(self, layer):
        pass

    def recorded(self, layer, kept):
        pass

    def grad_buffer(self, unit):
        return torch.zeros(self.specs[unit.group].numel)

    def emit_grad(self, unit, flat):
        self.grads[unit.name] = flat

    def spec_of(self, unit):
        return self.specs[unit.group]

    def frozen_of(self, unit):
        return ()


# the scans alone, without a step to count the targets: the head's mean loss (no TokenLoss)
MEAN_HEAD = dataclasses.replace(CFG, token_loss=False)


def _scan_grads(model, full, micro_batches):
    """Run forward_scan / head_step / backward_scan over in-memory trees, capturing the emitted
    grads."""
    all_units = units(model.n_layers)
    plan = all_units + list(reversed(all_units[:-1]))
    specs = {u.group: flat_spec(_tree_of(full, u)) for u in all_units}
    io = _MemoryIO(full, plan, specs)
    carries, bounds = forward_scan(model, io, micro_batches, keep_boundaries=True, check=True)
    losses, d_carries, d_tied = head_step(model, io, carries, micro_batches)
    backward_scan(model, io, bounds, d_carries, micro_batches, d_tied)
    return losses, io.grads, specs


@pytest.mark.parametrize("k", [1, 3])
def test_reverse_scan_equals_autograd_plain_loop(k):
    """Every unit's gradient from the reverse scan equals autograd through zf.plain_loss.

    Both run the same fp32 kernels per block; only the micro-batch sum order could differ (it does
    not), so the comparison is exact up to 1e-6 absolute slack for the k>1 mean.
    """
    model = gpt.model(MEAN_HEAD)
    full = _full_params(model)
    batch = make_batches(CFG, 1, 6, seed=3)[0]
    micro = [
        dict(zip(batch, vals, strict=True))
        for vals in zip(*(v.chunk(k) for v in batch.values()), strict=True)
    ]
    losses, grads, specs = _scan_grads(model, full, micro)

    leaves = optree.tree_leaves(full)
    for leaf in leaves:
        leaf.requires_grad_(True)
    ref_loss = sum(zf.plain_loss(model, full, mb) for mb in micro) / k
    ref_grads = torch.autograd.grad(ref_loss, leaves)
    ref = dict(zip([id(x) for x in leaves], ref_grads, strict=True))
    assert float(torch.stack(losses).mean()) == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    for unit in units(model.n_layers):
        spec, tree = specs[unit.group], _tree_of(full, unit)
        for leaf_spec, leaf in zip(spec.leaves, optree.tree_leaves(tree), strict=True):
            got = grads[unit.name][leaf_spec.offset : leaf_spec.offset + leaf_spec.numel].view(
                leaf_spec.shape
            )
            torch.testing.assert_close(
                got, ref[id(leaf)], rtol=0, atol=1e-6, msg=f"{unit.name}.{leaf_spec.path}"
            )


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_at_most_depth_plus_one_layers_materialised(depth, monkeypatch):
    """Count live materialisations independently of the fetcher's own counter: wrap fetch and
    release."""
    from zinf_fn.overlap.fetch import Fetcher

    live, peak = [0], [0]
    fetch, release = Fetcher.fetch, Fetcher.release

    def counting_fetch(self, unit, started=None):
        layer = fetch(self, unit, started)
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        return layer

    def counting_release(self, layer):
        live[0] -= 1
        release(self, layer)

    monkeypatch.setattr(Fetcher, "fetch", counting_fetch)
    monkeypatch.setattr(Fetcher, "release", counting_release)
    _, _, _, state = run_engine(zf.Config(prefetch_depth=depth, offload_params="cpu"), steps=3)
    assert peak[0] == depth + 1
    assert live[0] == 0
    assert view(state).counters().peak_live_layers == depth + 1


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fetch_traffic_does_not_grow_with_grad_accum(k):
    """Layer-major accumulation: each unit is fetched once forward and once backward per step, any
    k."""
    config = zf.Config(grad_accum=k, offload_params="cpu", offload_optimizer="cpu")
    state = zf.init(gpt.model(CFG), zf.adamw(), config)
    state, metrics = zf.train_step(state, batches(1, batch_size=8)[0])
    n_units = CFG.n_layers + 2
    assert metrics["fetches"] == 2 * n_units - 1  # the head is fetched once
    state = zf.init(
        gpt.model(CFG), zf.adamw(), zf.Config(offload_params="cpu", offload_optimizer="cpu")
    )
    state, single = zf.train_step(state, batches(1, batch_size=8)[0])
    assert metrics["bytes_fetched"] == single["bytes_fetched"] > 0


def test_pull_back_keeps_the_vjp_contract():
    """pull_back against torch.func.vjp: same outputs and gradients, bitwise; zeros for an unused
    input and for an input whose only output needs no gradient; shared-counter rows stay usable."""
    from zinf_fn.scan import pull_back

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 6, generator=gen)  # two leaves are views of one array, like a tier row
    w, unused, x = rows[0].view(2, 3), rows[1], torch.randn(4, 2, generator=gen)
    d_y, d_c = torch.randn(4, 3, generator=gen), torch.randn(4, generator=gen)

    def f(params, inputs, write_other_row=False):
        (xi,) = inputs
        y = torch.tanh(xi @ params[0])
        if (
            write_other_row
        ):  # between forward and backward another row changes in place (the updater)
            with torch.no_grad():
                rows[2].add_(1.0)
        return y, torch.ones(4) * 2.0

    out, (d_params, d_in) = pull_back(lambda p, i: f(p, i, True), [[w, unused], [x]], (d_y, d_c))
    ref_out, vjp_fn = torch.func.vjp(f, [w, unused], [x])
    ref_params, ref_in = vjp_fn((d_y, d_c))
    assert all(torch.equal(a, b) for a, b in zip(out, ref_out, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(d_params + d_in, ref_params + ref_in, strict=True))
    assert torch.equal(d_params[1], torch.zeros(6))
    assert not any(t.requires_grad for t in (*out, *d_params, *d_in))


def test_tape_equals_pull_back_and_keeps_no_memory():
    """A block recorded in forward (tape.Tape) and pulled back later, on refetched copies of its
    inputs, gives bitwise the gradients of a recompute from scratch; the graph keeps no input or
    output memory."""
    from zinf_fn.scan.tape import Tape, pull_back

    gen = torch.Generator().manual_seed(1)
    w, b, x = (torch.randn(*s, generator=gen) for s in ((8, 8), (8,), (4, 8)))
    dy = torch.randn(4, 8, generator=gen)

    def f(params, inputs):
        (xi,) = inputs
        h = torch.tanh(xi @ params[0] + params[1])
        return (xi + h @ params[0],)  # a trailing matmul and residual add: what the recompute skips

    tape = Tape(f, [[w, b], [x]])
    inputs, outputs = tape_tensors(tape)
    assert all(t.untyped_storage().nbytes() == t.element_size() for t in inputs)
    assert all(t.untyped_storage().nbytes() == t.element_size() for t in outputs)
    out, (d_params, d_in) = pull_back(f, [[w, b], [x]], (dy,))
    assert torch.equal(tape.outputs[0], out[0])
    got_params, got_in = tape.pull_back([[w.clone(), b.clone()], [x.clone()]], (dy,))
    assert all(torch.equal(a, c) for a, c in zip(got_params + got_in, d_params + d_in, strict=True))
    with pytest.raises(RuntimeError, match="already pulled back"):
        tape.pull_back([[w, b], [x]], (dy,))


def test_tape_refuses_a_recompute_that_runs_other_ops():
    """The recompute must save what the recorded run saved, position by position (shape and
    dtype)."""
    from zinf_fn.scan.tape import Tape

    calls = []

    def f(
        params, inputs
    ):  # the second run (the recompute) takes tanh of one row: its saved output differs
        calls.append(1)
        h = inputs[0] @ params[0]
        return (h.tanh() if len(calls) == 1 else h[:1].tanh(),)

    w, x = torch.randn(3, 3), torch.randn(2, 3)
    tape = Tape(f, [[w], [x]])
    with pytest.raises(RuntimeError, match="a recorded block must run the same ops"):
        tape.pull_back([[w], [x]], (torch.ones(2, 3),))


def test_a_training_step_does_not_import_dynamo():
    """The tape's hooks are its own: torch.utils.checkpoint imports torch._dynamo on its first call
    (~75 MiB resident), which an all-NVMe run's host memory would count. A fresh process, one step
    of a tiled GPT."""
    code = (
        "import sys, torch, zinf_fn as zf\nfrom layers import gpt\n"
        "cfg = gpt.Config(vocab_size=64, d_model=64, n_heads=2, n_layers=2, seq_len=16, "
        "mlp_tiles=2)\n"
        "s = zf.init(gpt.model(cfg), zf.adamw(lr=1e-3), zf.Config())\nt = torch.zeros(2, 17, "
        "dtype=torch.long)\n"
        "s, m = zf.train_step(s, {'inputs': t[:, :-1], 'targets': t[:, 1:]})\n"
        "assert m['loss'] > 0\nprint('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.stdout.strip() == "False"


def _indexed_gpt():
    """A GPT whose block i scales its residual update by (1 + i) / 2: the same tree in every layer,
    a computation that depends on the layer (as a sliding-window or a full-attention layer does)."""
    model = gpt.model(MEAN_HEAD)

    def apply(params, carry, i):
        out = model.block.apply(params, carry)
        return carry + (out - carry) * ((1 + i) / 2)

    return model._replace(block=zf.Stage(model.block.init, apply), layer_index=True)


def test_a_block_that_takes_its_layer_index_scans_as_the_plain_loop():
    """``Model(layer_index=True)``: the scan calls ``block.apply(params, carry, i)`` with each
    block's own index, in forward and in the backward's recompute; gradients equal autograd through
    zf.plain_loss (the same fp32 kernels per block: 1e-6 absolute, as the test above), and differ
    from the model that ignores the index (so the index reached every call)."""
    model = _indexed_gpt()
    full = _full_params(model)
    micro = [make_batches(CFG, 1, 3, seed=4)[0]]
    losses, grads, specs = _scan_grads(model, full, micro)
    leaves = optree.tree_leaves(full)
    for leaf in leaves:
        leaf.requires_grad_(True)
    ref_loss = zf.plain_loss(model, full, micro[0])
    ref = dict(zip([id(x) for x in leaves], torch.autograd.grad(ref_loss, leaves), strict=True))
    assert float(losses[0]) == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    unindexed = model._replace(layer_index=False, block=gpt.model(MEAN_HEAD).block)
    plain = zf.plain_loss(unindexed, full, micro[0])
    # ~400 ulp of a loss of ~4: the index changed the computation
    assert abs(float(plain.detach()) - float(ref_loss.detach())) > 1e-5
    for unit in units(model.n_layers):
        spec, tree = specs[unit.group], _tree_of(full, unit)
        for leaf_spec, leaf in zip(spec.leaves, optree.tree_leaves(tree), strict=True):
            got = grads[unit.name][leaf_spec.offset : leaf_spec.offset + leaf_spec.numel].view(
                leaf_spec.shape
            )
            torch.testing.assert_close(
                got, ref[id(leaf)], rtol=0, atol=1e-6, msg=f"{unit.name}.{leaf_spec.path}"
            )
