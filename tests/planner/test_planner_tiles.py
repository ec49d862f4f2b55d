"""The planner chooses the tiles: ``zf.auto_config`` given a factory of tile counts picks the fewest
tiles under which a placement fits the budgets, and prints every tile count it weighed beside the
placements.

The checks are independent of auto_config's own search: each combination's least host peak is taken
over every plain placement with ``zf.estimate`` (the same estimate ``zf.init`` checks a config
against). No test here asserts a wall time (the machine's speeds are given, not measured).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import zinf_fn as zf
from layers import gpt
from zinf_fn.planner import TilesChoice
from zinf_fn.planner.machine import Machine
from zinf_fn.planner.sizes import plan_config
from zinf_fn.planner.timing import predict

CFG = gpt.Config(
    vocab_size=256, d_model=256, n_heads=4, n_layers=2, seq_len=32
)  # the MLP: 2/3 of a block
COUNTS = (1, 2, 4)
MACHINE = Machine(1e9, 1e9, 1e10, 1e10)  # disk read / write, copy B/s, FLOP/s: no calibration run
PLACES = ("none", "cpu", "nvme")


def factory(mlp_tiles, head_tiles):
    return gpt.model(dataclasses.replace(CFG, mlp_tiles=mlp_tiles, head_tiles=head_tiles))


def batch():
    tokens = torch.zeros(2, CFG.seq_len + 1, dtype=torch.long)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def least_peak(mlp_tiles, head_tiles, nvme_path) -> int:
    """The smallest peak host memory of any plain placement of these tiles (CPU compute: "none" is
    "cpu")."""
    return min(
        zf.estimate(
            factory(mlp_tiles, head_tiles),
            zf.adamw(),
            zf.Config(offload_params=p, offload_optimizer=o, nvme_path=nvme_path),
        ).host_peak
        for p, o in itertools.product(PLACES[1:], PLACES[1:])
    )


def test_auto_config_chooses_the_fewest_tiles_that_fit(tmp_path, capsys):
    path = str(tmp_path)
    budget = least_peak(
        4, 1, path
    )  # MLP tiles bound a block's buffers: 4 fit, and untiled does not
    assert least_peak(1, 1, path) > budget
    choice = zf.auto_config(
        factory,
        zf.adamw(),
        nvme_path=path,
        host_memory_budget=budget,
        machine=MACHINE,
        tile_counts=COUNTS,
    )
    assert isinstance(choice, TilesChoice)
    total = sum(choice.tiles.values())
    weighed = [t for t in itertools.product(COUNTS, COUNTS) if sum(t) <= total]
    assert all(
        least_peak(*t, path) > budget for t in weighed if sum(t) < total
    )  # fewer tiles do not fit
    assert (
        zf.estimate(choice.model, zf.adamw(), choice.config).host_peak <= budget
    )  # the choice does
    out = capsys.readouterr().out
    for mlp, head in weighed:  # every combination weighed is printed, with a row per placement
        rows = [line for line in out.splitlines() if f"mlp_tiles={mlp} head_tiles={head} " in line]
        assert len(rows) >= len(PLACES) ** 2
    chosen = [line for line in out.splitlines() if line.startswith("* ")]
    assert (
        len(chosen) == 1
        and f"mlp_tiles={choice.tiles['mlp_tiles']} head_tiles={choice.tiles['head_tiles']}"
        in chosen[0]
        and "DOES NOT FIT" not in chosen[0]
    )
    assert "mlp_tiles=4 head_tiles=4" not in out  # nothing beyond the chosen total is built
    state = zf.init(choice.model, zf.adamw(), choice.config)  # and it trains, tiled
    state, metrics = zf.train_step(state, batch())
    assert (
        metrics["loss"] > 0
        and metrics["tile_fetches_prefetched"] + metrics["tile_fetches_on_demand"] > 0
    )
    zf.close(state)


def test_with_a_batch_each_tile_count_is_timed(capsys):
    """With a sample batch every row has its predicted seconds; a tiled model is timed through the
    engine's tiled path (tiling.held), and its tile fetches add the per-unit cost."""
    choice = zf.auto_config(
        lambda mlp_tiles: factory(mlp_tiles, 1),
        zf.adamw(),
        batch=batch(),
        machine=MACHINE,
        tile_counts=(1,),
    )
    assert choice.tiles == {"mlp_tiles": 1}
    rows = [line for line in capsys.readouterr().out.splitlines() if "mlp_tiles=1 " in line]
    assert rows and all("step" in line and "not timed" not in line for line in rows)
    costly = MACHINE._replace(unit_overhead_s=1e-3)
    untiled, tiled = (plan_config(factory(t, 1), zf.adamw(), zf.Config(), batch()) for t in (1, 4))
    assert untiled.work.tile_fetches == (0, 0)
    # 2 blocks of 2 tiled leaves x 4 tiles: forward 8 each; backward 4 recomputed (mlp.fc: the
    # block's last linear, mlp.proj, is not, as the planner learns on one block, as the engine's
    # first step does: planner.compute.recomputed_leaves) + 8; the head and embedding are untiled.
    assert tiled.work.tile_fetches == (2 * 8, 2 * 12)
    gap = (
        predict(tiled.estimate, tiled.work, costly).step
        - predict(tiled.estimate, tiled.work, MACHINE).step
    )
    units = (
        CFG.n_layers + 2
    )  # fetched in forward; one fewer in backward (the head is not refetched)
    assert gap == pytest.approx(1e-3 * (units + units - 1 + 16 + 24), rel=1e-6)


def test_auto_config_tiles_errors(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"no tile counts and placement fit the budgets(.|\n)*mlp_tiles=2 "
        r"head_tiles=2(.|\n)*Raise the budgets",
    ):
        zf.auto_config(
            factory,
            zf.adamw(),
            host_memory_budget=1 << 20,
            machine=MACHINE,
            tile_counts=(1, 2),
            verbose=False,
        )
    with pytest.raises(TypeError, match="a zf.Model or a factory of tile counts"):
        zf.auto_config(CFG, zf.adamw(), machine=MACHINE)
    with pytest.raises(TypeError, match=r"names each count as a parameter.*\*counts"):
        zf.auto_config(lambda *counts: factory(*counts), zf.adamw(), machine=MACHINE)
    with pytest.raises(TypeError, match=r"the factory returned Config for \{'mlp_tiles': 1\}"):
        zf.auto_config(lambda mlp_tiles: CFG, zf.adamw(), machine=MACHINE)


def test_counts_the_factory_refuses_are_listed_and_skipped(capsys):
    """gpt.Config refuses more head tiles than vocabulary rows: those counts are listed with the
    reason."""
    small = dataclasses.replace(CFG, vocab_size=2)
    choice = zf.auto_config(
        lambda head_tiles: gpt.model(dataclasses.replace(small, head_tiles=head_tiles)),
        zf.adamw(),
        machine=MACHINE,
        tile_counts=(4, 1),
    )
    assert choice.tiles == {"head_tiles": 1}
    out = capsys.readouterr().out
    assert "head_tiles=1 " in out and "head_tiles=4" not in out  # 1 fits, so 4 is never built
    with pytest.raises(
        ValueError, match=r"head_tiles=4 +refused by the factory: ValueError: .*head_tiles"
    ):
        zf.auto_config(
            lambda head_tiles: gpt.model(dataclasses.replace(small, head_tiles=head_tiles)),
            zf.adamw(),
            host_memory_budget=1 << 20,
            machine=MACHINE,
            tile_counts=(4,),
            verbose=False,
        )


def test_command_line_weighs_the_tiles(monkeypatch, capsys):
    """``python -m zinf_fn.planner --auto --weigh-tiles mlp,head``: the factory's counts are the
    named ones."""
    from zinf_fn.planner import __main__ as cli

    monkeypatch.setattr(cli, "calibrate", lambda path: MACHINE)  # no calibration run in a test
    argv = [
        "--d-model",
        "64",
        "--layers",
        "2",
        "--heads",
        "2",
        "--vocab",
        "64",
        "--seq",
        "16",
        "--batch",
        "2",
        "--auto",
        "--tile-counts",
        "1,2",
    ]
    cli.main([*argv, "--weigh-tiles", "mlp,head"])
    out = capsys.readouterr().out
    assert "mlp_tiles=1 head_tiles=1 " in out and "chosen: tiles mlp_tiles=1 head_tiles=1" in out
    with pytest.raises(SystemExit, match="gpt models tile attn, mlp, head; got 'mlp,vocab'"):
        cli.main([*argv, "--weigh-tiles", "mlp,vocab"])


def test_kept_blocks_plan_no_recompute_fetches():
    """With room for every block's activations (``Config.keep_activations``), the planned tile
    fetches of the reverse scan are the backward's alone: 2 blocks of 2 tiled leaves x 4 tiles,
    8 each, no recompute (as the engine fetches: tests/tiling/test_kept_tiles.py)."""
    kept = plan_config(factory(4, 1), zf.adamw(), zf.Config(keep_activations=1 << 40), batch())
    assert kept.work.tile_fetches == (2 * 8, 2 * 8)


def test_kept_activations_are_planned_for_tiled_blocks_too():
    """``Config.keep_activations`` is a budget of every block's tapes, tiled or not
    (``scan.tape.Kept``): the estimate counts it, up to every block's activations, for both."""
    config = zf.Config(keep_activations=1 << 40)
    for t in (1, 4):
        est = plan_config(factory(t, 1), zf.adamw(), config, batch(), timed=False).estimate
        layer = est.working["layer activations"]
        assert est.working["kept activations"] == layer * CFG.n_layers > 0
