"""``tiling.expert_swiglu``: a frozen expert's ``down(silu(gate) * up)`` as one autograd node over
the engine's tile sources, against its twin (the two ``tiling.expert_linear`` calls, bitwise: the
same products in the same order) and against the weights decoded then ``F.linear``.

The decoded reference sums each product in MKL's order, the fused kernel in its own: each product
differs by at most ``2 * terms * 2**-24`` of its terms' magnitudes (the bound of
tests/tiling/test_nf4_linear.py), below 1e-5 relative at these widths (64), and the silu between
them has a slope below 1.1; so a relative 1e-5 of the output's scale holds the chain with a margin
(about 1e-7 seen), while a wrong code, scale or rounding shows at the 1e-2 level.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from layers import moe
from zinf_fn import tiling
from zinf_fn.formats import codebook, nf4_linear
from zinf_fn.tiling.held import HeldTiles

E = 4  # experts
D = 64  # model width
WIDTH = 64  # one expert's width, I


def _experts(seed: int, coded: bool) -> dict[str, list]:
    """E experts' gate_up (1, 2I, D) and down (1, D, I) tiles, bf16 values stored NF4 (``coded``:
    as the engine lends them) or those values decoded to fp32 tensors (a frozen decoded tile)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list] = {"gate_up": [], "down": []}
    for name, shape in (("gate_up", (1, 2 * WIDTH, D)), ("down", (1, D, WIDTH))):
        for _ in range(E):
            w = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            stored = codebook.encode_leaf("nf4", w)
            tile = nf4_linear.CodedMatrix(stored, shape, torch.bfloat16)
            out[name].append(tile if coded else tile.decoded(torch.float32).view(shape))
    return out


class _Logged(HeldTiles):
    """A held source that logs each fetch as (its name, the tile) into a shared list."""

    def __init__(self, name: str, tiles: list, log: list):
        super().__init__(tiling.RowTiles(tuple(tiles)), torch.zeros(0))
        self.name, self.log = name, log

    def fetch(self, t: int):
        self.log.append((self.name, t))
        return super().fetch(t)


def _sources(experts: dict, log: list) -> tuple[_Logged, _Logged]:
    return _Logged("gate_up", experts["gate_up"], log), _Logged("down", experts["down"], log)


def _twin(x: torch.Tensor, gate_up, down, e: int) -> torch.Tensor:
    """The two expert_linear calls and the activation between them."""
    gate, up = tiling.expert_linear(x, gate_up, e).chunk(2, dim=-1)
    return tiling.expert_linear(F.silu(gate) * up, down, e)


def _run(op, sources, x: torch.Tensor, g: torch.Tensor, e: int):
    """(y, dx) of ``op`` on a fresh leaf copy of ``x``, backward from ``g``."""
    x = x.clone().requires_grad_(True)
    y = op(x, *sources, e)
    y.backward(g)
    return y.detach(), x.grad


@pytest.mark.parametrize("coded", [True, False], ids=["codes", "decoded"])
@pytest.mark.parametrize("rows", [0, 1, 2, 5])
def test_the_one_node_is_the_two_expert_linear_calls_bitwise(coded, rows):
    """Forward and dx bitwise the twin's, each weight fetched once a pass as the twin fetches it
    (forward gate_up then down, backward down then gate_up), in one autograd node."""
    experts = _experts(0, coded)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(rows, D, generator=gen), torch.randn(rows, D, generator=gen)
    fused_log, twin_log = [], []
    fused = _run(tiling.expert_swiglu, _sources(experts, fused_log), x, g, 2)
    twin = _run(_twin, _sources(experts, twin_log), x, g, 2)
    assert torch.equal(fused[0], twin[0]) and torch.equal(fused[1], twin[1])
    assert fused_log == twin_log == [("gate_up", 2), ("down", 2), ("down", 2), ("gate_up", 2)]
    leaf = torch.randn(rows, D, requires_grad=True)
    y = tiling.expert_swiglu(leaf, *_sources(experts, []), 2)
    assert [type(f).__name__ for f, _ in y.grad_fn.next_functions if f] == ["AccumulateGrad"]


def test_the_one_node_is_decode_then_f_linear():
    """Against the weights decoded and autograd through ``F.linear``: the module's tolerance."""
    experts = _experts(2, coded=True)
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(3, D, generator=gen), torch.randn(3, D, generator=gen)
    y, dx = _run(tiling.expert_swiglu, _sources(experts, []), x, g, 1)
    dense = [experts[name][1].decoded(torch.float32) for name in ("gate_up", "down")]
    ref = x.clone().requires_grad_(True)
    gate, up = F.linear(ref, dense[0]).chunk(2, dim=-1)
    y_ref = F.linear(F.silu(gate) * up, dense[1])
    y_ref.backward(g)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5 * y_ref.abs().max().item())
    torch.testing.assert_close(dx, ref.grad, rtol=1e-5, atol=1e-5 * ref.grad.abs().max().item())


def test_through_moe_the_experts_are_fetched_as_by_the_two_calls():
    """``moe.experts_apply`` over frozen coded experts (one node each) fetches the same tiles in the
    same order, forward and backward, as the two-call path (biases, all zero, keep a block on
    it): an expert no token chose is fetched in neither pass; outputs and dx bitwise."""
    cfg = moe.Config(n_experts=E, top_k=1, d_model=D, d_ff=WIDTH)
    experts = _experts(4, coded=True)
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(6, D, generator=gen), torch.randn(6, D, generator=gen)
    chosen = torch.tensor([[3], [0], [3], [3], [0], [0]])
    routing = moe.Routing(torch.zeros(6, E), torch.rand(6, 1, generator=gen), chosen)
    results, logs = [], []
    for bias in (False, True):
        logs.append([])
        gate_up, down = _sources(experts, logs[-1])
        params = {"gate_up": {"w": gate_up}, "down": {"w": down}}
        if bias:
            params["gate_up"]["b"] = torch.zeros(E, 2 * WIDTH)
            params["down"]["b"] = torch.zeros(E, D)
        results.append(_run(_apply_moe(cfg, params, routing), (), x, g, None))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert logs[0] == logs[1]
    assert {t for _, t in logs[0]} == {0, 3} and len(logs[0]) == 8  # 2 experts x 2 weights x 2


def _apply_moe(cfg: moe.Config, params: dict, routing: moe.Routing):
    """``moe.experts_apply`` as an op of ``(x, e)`` for ``_run`` (e unused)."""

    def apply(x: torch.Tensor, e) -> torch.Tensor:
        return moe.experts_apply(cfg, params, x, routing)

    return apply


def test_a_trained_or_mismatched_expert_is_refused_or_takes_the_twin():
    """A source whose anchor needs a gradient (the expert trains) takes the two calls; gate_up and
    down passed the wrong way round is a ValueError naming the shapes."""
    experts = _experts(6, coded=False)
    gate_up, down = _sources(experts, [])
    with pytest.raises(ValueError, match="pass gate_up first"):
        tiling.expert_swiglu(torch.randn(2, D), down, gate_up, 0)
    gate_up.anchor = torch.zeros(0, requires_grad=True)
    y = tiling.expert_swiglu(torch.randn(2, D, requires_grad=True), gate_up, down, 0)
    assert type(y.grad_fn).__name__ == "_ExpertLinearBackward"


def test_a_layers_experts_as_one_node_are_the_expert_calls_bitwise(monkeypatch):
    """``tiling.experts_swiglu`` over lent experts (one node; experts of few rows two at once, one
    on the side thread) against one ``expert_swiglu`` call per expert: outputs and dx bitwise, the
    same fetches in the same order (forward gate_up then down of each expert in turn, backward
    down then gate_up from the last), an expert without rows (over several ranks) included, one
    of more rows than a one-thread product (``nf4_kernels.ONE_THREAD_ROWS``) computed here."""
    threads, started = [], threading.Event()
    inner = nf4_linear.CodedMatrix.linear

    def linear(self, x, b=None):  # the next expert waits until the first started on the side
        threads.append((x.shape[0], threading.current_thread().name))
        started.set() if x.shape[0] == 3 else started.wait(10)
        return inner(self, x, b)

    monkeypatch.setattr(nf4_linear.CodedMatrix, "linear", linear)
    experts, counts, chosen = _experts(7, coded=True), (3, 0, 40, 2), (0, 1, 2, 3)
    gen = torch.Generator().manual_seed(8)
    x, g = torch.randn(sum(counts), D, generator=gen), torch.randn(sum(counts), D, generator=gen)
    one_log, each_log = [], []

    def each(x, gate_up, down, e):
        rows = torch.split(x, counts)
        return torch.cat([tiling.expert_swiglu(r, gate_up, down, e) for e, r in enumerate(rows)])

    def one(x, gate_up, down, e):
        return tiling.experts_swiglu(x, counts, gate_up, down, chosen)

    together = _run(one, _sources(experts, one_log), x, g, None)
    by_rows = dict(threads)  # who computed each expert's forward products
    apart = _run(each, _sources(experts, each_log), x, g, None)
    assert torch.equal(together[0], apart[0]) and torch.equal(together[1], apart[1])
    forward = [(name, e) for e in chosen for name in ("gate_up", "down")]
    backward = [(name, e) for e in reversed(chosen) for name in ("down", "gate_up")]
    assert one_log == forward + backward and each_log == one_log
    if torch.get_num_threads() > 1:  # the first expert (3 rows) went to the idle side thread
        assert by_rows[3].startswith("zinf-side") and started.is_set()
    assert by_rows[40] == threading.main_thread().name
    with pytest.raises(ValueError, match="a row count per expert"):
        tiling.experts_swiglu(x, counts[:3], *_sources(experts, []), chosen)
