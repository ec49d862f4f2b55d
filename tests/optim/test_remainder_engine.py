"""The engine with a remainder master (``Config(master="remainder")``): the optimizer tier keeps an
int16 remainder row, the bf16 param row is the master's high half.

Its fp32 twin is ``Config(param_rounding="ties_away")``: the same updates on the same fp32 masters,
whose copies round ties away as the remainder's split does; the two must agree bit for bit, in every
placement. Against today's fp32 run (copies rounded to nearest even) the copies differ on exact ties
only.
"""

from __future__ import annotations

import pytest
import torch
from compressed_helpers import train
from engine_helpers import BETAS, CFG, EPS, LR, WD, batches

import zinf_fn as zf
from layers import gpt
from zinf_fn.optim.remainder import split_master
from zinf_fn.state import view

STEPS = 3
PIECE = 4096  # the smallest piece (2048 elements): a block's rows are cut in several pieces


def _opt():
    return zf.adamw(lr=LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)


def _config(tmp_path, params: str, optimizer: str, **kw) -> zf.Config:
    nvme = "nvme" in (params, optimizer, kw.get("spill_optimizer", "")[-4:])
    if nvme:
        tmp_path.mkdir(parents=True, exist_ok=True)
    return zf.Config(
        offload_params=params,
        offload_optimizer=optimizer,
        optimizer_piece_bytes=PIECE,
        nvme_path=str(tmp_path) if nvme else None,
        **kw,
    )


def _trajectory(config: zf.Config, data) -> tuple[list[float], list[dict], dict, list[dict]]:
    """(losses, the 16-bit params at init and after each step, the final master, the master after
    each step)."""
    state = zf.init(gpt.model(CFG), _opt(), config, seed=0)
    losses, params, masters = [], [zf.gather_params(state, "param")], []
    for batch in data:
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
        params.append(zf.gather_params(state, "param"))
        masters.append(zf.gather_params(state, "master"))
    zf.close(state)
    return losses, params, masters[-1], masters


def _flat(tree) -> torch.Tensor:
    leaves, _ = torch.utils._pytree.tree_flatten(tree)
    return torch.cat([x.reshape(-1) for x in leaves])


PLACEMENTS = [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu")]


@pytest.mark.parametrize("params,optimizer", PLACEMENTS)
@pytest.mark.parametrize(
    "extra", [{}, {"grad_accum": 2}, {"clip_grad_norm": 0.5}], ids=["plain", "accum", "clip"]
)
def test_remainder_equals_ties_away_fp32_bitwise(tmp_path, params, optimizer, extra):
    data = batches(STEPS)
    got = _trajectory(_config(tmp_path / "r", params, optimizer, master="remainder", **extra), data)
    want = _trajectory(
        _config(tmp_path / "f", params, optimizer, param_rounding="ties_away", **extra), data
    )
    assert got[0] == want[0]  # losses
    for step, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
        assert torch.equal(_flat(a), _flat(b)), f"params differ after step {step}"
    assert torch.equal(
        _flat(got[2]), _flat(want[2])
    )  # the joined master is the fp32 master, bitwise


def test_remainder_close_to_todays_fp32(tmp_path):
    """Today's copies round to nearest even, the remainder's ties away: from one fp32 master they
    differ only where the master is an exact tie (low half 0x8000), by one bf16 ulp. Step 1 starts
    from the same master in both runs (no init master here is a tie: checked), so its masters agree
    bitwise and its copies differ on the ties alone; later steps compute with those few copies moved
    by an ulp, so their losses agree to a few float roundings (1e-7 relative seen; 1e-5 allowed)."""
    data = batches(STEPS)
    got = _trajectory(_config(tmp_path, "cpu", "cpu", master="remainder"), data)
    want = _trajectory(_config(tmp_path, "cpu", "cpu"), data)
    assert (
        torch.equal(_flat(got[1][0]), _flat(want[1][0])) and got[0][0] == want[0][0]
    )  # no tie at init
    master = _flat(got[3][0])
    assert torch.equal(master, _flat(want[3][0]))  # step 1: the same fp32 update
    a, b = _flat(got[1][1]).float(), _flat(want[1][1]).float()
    ulp = (
        ((master.abs().view(torch.int32) >> 23) - 7)
        .clamp(min=1)
        .bitwise_left_shift(23)
        .view(torch.float32)
    )
    ties = (master.view(torch.int32) & 0xFFFF) == 0x8000
    assert bool(ties.any())  # this seed makes 3 ties in step 1: the check below is not vacuous
    assert bool(((a - b).abs() <= ulp).all()) and not bool((a != b)[~ties].any())
    for x, y in zip(got[0], want[0], strict=True):
        assert abs(x - y) <= 1e-5 * abs(y)


def test_remainder_rows_and_sizes(tmp_path):
    config = _config(tmp_path, "cpu", "cpu", master="remainder")
    state = zf.init(gpt.model(CFG), _opt(), config, seed=0)
    v = view(state)
    assert v.kinds() == ["param", "remainder", "opt.0", "opt.1"]
    assert v.dtype("remainder") == torch.int16 and v.dtype("param") == torch.bfloat16
    fp32 = zf.init(gpt.model(CFG), _opt(), _config(tmp_path, "cpu", "cpu"), seed=0)
    elements = sum(v.shard_numel(r.group) for r in v.rows())
    assert (
        view(fp32).state_bytes() - v.state_bytes() == 2 * elements
    )  # 4 bytes of master -> 2 of remainder
    # zf.init wrote the rows by split: the stored halves are the fp32 master's
    master = view(fp32).gather_row("master", v.rows()[0].unit)
    param, remainder = split_master(master)
    assert torch.equal(v.gather_row("remainder", v.rows()[0].unit), remainder)
    assert torch.equal(v.gather_row("param", v.rows()[0].unit), param.float())
    est = zf.estimate(gpt.model(CFG), _opt(), config)
    assert est.states[("cpu", "remainder")] == 2 * elements and ("cpu", "master") not in est.states
    assert "remainder" in est.table() and "\nmaster" not in est.table()


def test_remainder_nvme_traffic_follows_the_sizes(tmp_path):
    """bytes_per_param counts what moves: the planner's NVMe traffic equals the engine's
    counters."""
    config = _config(tmp_path, "nvme", "nvme", master="remainder")
    est = zf.estimate(gpt.model(CFG), _opt(), config)
    state = zf.init(gpt.model(CFG), _opt(), config, seed=0)
    for batch in batches(2):
        state, metrics = zf.train_step(state, batch)
    zf.flush(state)
    moved = metrics["bytes_read.nvme"] + metrics["bytes_written.nvme"]
    assert moved == est.moved["nvme"]
    zf.close(state)


def test_unsupported_formats_are_refused_at_init():
    with pytest.raises(ValueError, match="param_dtype=torch.bfloat16"):
        zf.Config(master="remainder", param_dtype=torch.float32)
    with pytest.raises(ValueError, match="param_rounding"):
        zf.Config(master="remainder", param_rounding="nearest_even")
    with pytest.raises(ValueError, match="moments='int4'.*'int8'"):
        zf.adamw(moments="int4")


def test_remainder_with_spilled_optimizer_rows(tmp_path):
    """Units 0-1 update in place (host memory), the rest streamed (NVMe): one run, both
    strategies."""
    data = batches(STEPS)
    kw = {"spill_optimizer": "2:nvme", "update_workers": 2}
    got = _trajectory(_config(tmp_path / "r", "cpu", "cpu", master="remainder", **kw), data)
    want = _trajectory(
        _config(tmp_path / "f", "cpu", "cpu", param_rounding="ties_away", **kw), data
    )
    assert got[0] == want[0]
    assert torch.equal(_flat(got[2]), _flat(want[2]))


@pytest.mark.parametrize(
    "master,moments,per_param",
    [
        ("fp32", "fp32", 28),
        ("remainder", "fp32", 26),
        ("fp32", "bf16", 20),
        ("remainder", "bf16", 18),
        ("fp32", "int8", 16 + 1 / 16),
        ("remainder", "int8", 14 + 1 / 16),
    ],
)
def test_bytes_per_param_on_nvme(tmp_path, master, moments, per_param):
    """What moves per parameter with every state on NVMe: the 16-bit copy read for forward (2) and
    written (2); an fp32 master read and written (8), lent to the backward fetch (which casts it
    instead of reading the copy); a remainder master's remainder (4) and its high half, the param
    row, read once for the backward fetch and the update together (2: lent, ``RowKinds.lent_kind``);
    m and v read and written, 16 (fp32), 8 (bf16) or 4 (int8 codes) plus their scales, 2 x 4 bytes
    read and written per block of 256 (1/16)."""
    config = zf.Config(
        offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path), master=master
    )
    opt = zf.adamw(moments=moments, compress=lambda path, numel: True)
    state = zf.init(gpt.model(CFG), opt, config)
    v = view(state)
    held = sum(v.shard_numel(r.group) for r in v.rows())
    for batch in batches(2):
        state, metrics = zf.train_step(state, batch)
        assert metrics["state_bytes_moved"] == per_param * held
        assert metrics["bytes_per_param"] == per_param
    zf.close(state)


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_remainder_with_tiled_leaves(tmp_path, placement):
    """Tile rows (``zinf_fn.tiling``) are updated as their gradients complete, outside the pass's
    order: their remainder and param pieces are read on demand; the run is the fp32 twin's,
    bitwise."""
    import dataclasses

    cfg = dataclasses.replace(CFG, attn_tiles=2, mlp_tiles=3, head_tiles=5)
    data = batches(2)
    out = []
    for kw in ({"master": "remainder"}, {"param_rounding": "ties_away"}):
        state = zf.init(
            gpt.model(cfg), _opt(), _config(tmp_path / str(len(out)), placement, placement, **kw)
        )
        state, losses, _ = train(state, data)
        out.append((losses, _flat(zf.gather_params(state, "master"))))
        zf.close(state)
    assert out[0][0] == out[1][0] and torch.equal(out[0][1], out[1][1])
