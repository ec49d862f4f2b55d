"""Restore at another world size and placement: resharding is slicing.

A checkpoint written at world 2 is restored at worlds 1, 2 and 4 (one written at 4 at world 1), on every
placement. The restored parameters are gathered and compared *bitwise* with what the writer gathered:
each rank reads exactly its slice, so nothing may change. The next steps' losses are compared with the
writer's uninterrupted run: bitwise at the same world size (same kernels, same order, one thread per
process), and to 1e-5 relative across world sizes, where the gradient mean over ranks sums the same
per-row terms in another order (fp32 rounding, ~1e-7 per step, well inside 1e-5 after two steps).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from ckpt_workers import config, full_params, model, optimizer, tensors, train, write_then_restore_worker
from dist_utils import run_world
from engine_helpers import batches

import checkpoints

HAS_NVME = importlib.util.find_spec("zinf_fn.nvme") is not None
PLACEMENTS = ["none", "cpu", *(["nvme"] if HAS_NVME else [])]
STEPS, MORE = 3, 2


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def placement_config(placement: str, tmp_path):
    if placement != "nvme":
        return config(placement)
    (tmp_path / "nvme").mkdir(exist_ok=True)   # nvme_path must exist: the tier creates only its run folders
    return config(placement, nvme_path=str(tmp_path / "nvme"))


def test_restore_at_any_world_size_and_placement(tmp_path):
    w2_path, w4_path = str(tmp_path / "written_at_2"), str(tmp_path / "written_at_4")
    # world 2 writes, then restores its own checkpoint on another placement: the same training, bitwise
    written2, at2 = tensors(run_world(2, write_then_restore_worker, w2_path, STEPS, MORE, w2_path, "none")[0])
    assert checkpoints.read_manifest(w2_path)["world_size"] == 2
    assert at2["step"] == STEPS + MORE
    for kind in ("master", "param"):
        assert same(at2["restored"][kind], written2["saved"][kind]), kind
    assert at2["losses"] == written2["losses"][STEPS:]

    # a world-4 run writes a checkpoint (for 4 -> 1), and restores the world-2 one
    written4, at4 = tensors(run_world(4, write_then_restore_worker, w4_path, STEPS, MORE, w2_path, "cpu")[0])
    for kind in ("master", "param"):
        assert same(at4["restored"][kind], written2["saved"][kind]), kind
    assert at4["losses"] == pytest.approx(written2["losses"][STEPS:], rel=1e-5)
    assert checkpoints.read_manifest(w4_path)["world_size"] == 4

    # world 2 -> world 1 and world 4 -> world 1, every placement
    data = batches(STEPS + MORE)[STEPS:]
    for placement in PLACEMENTS:
        for path, written in ((w2_path, written2), (w4_path, written4)):
            state = checkpoints.restore(path, model(), optimizer(), placement_config(placement, tmp_path))
            assert same(full_params(state), written["saved"]["master"]), (path, placement)
            assert same([x.float() for x in full_params(state, "param")], written["saved"]["param"])
            _, losses = train(state, data)
            assert losses == pytest.approx(written["losses"][STEPS:], rel=1e-5), (path, placement)
