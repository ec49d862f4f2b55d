"""Restore at another world size, placement and partition mode: resharding is slicing.

A checkpoint written at world 2 is restored at worlds 1, 2 and 4 (one written at 4 at world 1), on
every placement, and at world 2 in "broadcast" partition mode, which saves it again for world 1. The
restored parameters are gathered and compared *bitwise* with what the writer gathered: each rank
reads exactly its slice, so nothing may change. The next steps' losses are compared with the
writer's uninterrupted run: bitwise at the same world size and mode (same kernels, same order, one
thread per process), and to 1e-5 relative across world sizes or modes, where the gradient mean over
ranks sums the same per-row terms in another order (fp32 rounding, ~1e-7 per step, well inside 1e-5
after two steps).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from ckpt_workers import (
    config,
    full_params,
    model,
    optimizer,
    tensors,
    train,
    write_then_restore_worker,
)
from dist_utils import run_world
from engine_helpers import batches

import checkpoints

HAS_NVME = importlib.util.find_spec("zinf_fn.offload.nvme") is not None
PLACEMENTS = ["none", "cpu", *(["nvme"] if HAS_NVME else [])]
STEPS, MORE = 3, 2


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def placement_config(placement: str, tmp_path, name: str):
    if placement != "nvme":
        return config(placement)
    (tmp_path / name).mkdir()
    return config(placement, nvme_path=str(tmp_path / name))


def test_restore_at_any_world_size_and_placement(tmp_path):
    w2_path, w4_path = str(tmp_path / "written_at_2"), str(tmp_path / "written_at_4")
    # world 2 writes, then restores its own checkpoint on another placement: the same training,
    # bitwise; and once more in "broadcast" partition mode (each rank holds whole layers), saving
    # from there
    bc_path = str(tmp_path / "written_in_broadcast_mode")
    written2, at2, bc = tensors(
        run_world(2, write_then_restore_worker, w2_path, STEPS, MORE, w2_path, "none", bc_path)[0]
    )
    assert checkpoints.read_manifest(w2_path)["world_size"] == 2
    assert checkpoints.read_manifest(bc_path)["config"]["partition"] == "broadcast"
    assert at2["step"] == STEPS + MORE
    for kind in ("master", "param"):
        assert same(at2["restored"][kind], written2["saved"][kind]), kind
        assert same(bc["restored"][kind], written2["saved"][kind]), kind
    assert at2["losses"] == written2["losses"][STEPS:]
    # broadcast mode reduces gradients to the owner instead of reduce-scattering: equal to rounding
    assert bc["losses"] == pytest.approx(written2["losses"][STEPS:], rel=1e-5)

    # a world-4 run writes a checkpoint (for 4 -> 1), and restores the world-2 one
    written4, at4 = tensors(
        run_world(4, write_then_restore_worker, w4_path, STEPS, MORE, w2_path, "cpu")[0]
    )
    for kind in ("master", "param"):
        assert same(at4["restored"][kind], written2["saved"][kind]), kind
    assert at4["losses"] == pytest.approx(written2["losses"][STEPS:], rel=1e-5)
    assert checkpoints.read_manifest(w4_path)["world_size"] == 4

    # world 2 -> world 1, 4 -> world 1 and broadcast-written -> world 1, every placement
    data = batches(STEPS + MORE)[STEPS:]
    for placement in PLACEMENTS:
        for i, (path, written) in enumerate(
            ((w2_path, written2), (w4_path, written4), (bc_path, written2))
        ):
            cfg = placement_config(placement, tmp_path, f"nvme{i}")
            state = checkpoints.restore(path, model(), optimizer(), cfg)
            assert same(full_params(state), written["saved"]["master"]), (path, placement)
            assert same([x.float() for x in full_params(state, "param")], written["saved"]["param"])
            _, losses = train(state, data)
            assert losses == pytest.approx(written["losses"][STEPS:], rel=1e-5), (path, placement)
