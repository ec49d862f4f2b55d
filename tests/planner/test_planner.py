"""The planner: the estimate's bytes are what init allocates, configs that do not fit fail before
init, calibration is cached, auto_config returns a config that fits. No test here asserts a wall
time."""

from __future__ import annotations

import collections
import dataclasses
import json
import os

import pytest
import torch
from engine_helpers import CFG
from engine_internals import allocated

import zinf_fn as zf
from layers import gpt
from zinf_fn.planner import fit
from zinf_fn.planner import machine as calibration


def model():
    return gpt.model(CFG)


CONFIGS = [
    dict(),
    dict(offload_params="cpu", offload_optimizer="cpu"),
    dict(offload_params="nvme", offload_optimizer="nvme", clip_grad_norm=1.0),
    dict(
        offload_params="cpu",
        spill_params="2:nvme",
        offload_optimizer="cpu",
        spill_optimizer="3:nvme",
    ),
    dict(param_dtype=torch.float32),
]


@pytest.mark.parametrize("kw", CONFIGS, ids=str)
def test_estimate_bytes_equal_what_init_allocates(kw, tmp_path):
    config = zf.Config(nvme_path=str(tmp_path), **kw)
    est = zf.estimate(model(), zf.adamw(), config)
    state = zf.init(model(), zf.adamw(), config)
    assert {k: v for k, v in est.states.items() if v} == allocated(state)
    zf.close(state)


def test_estimate_with_a_batch_adds_activations_and_prints_a_table(tmp_path):
    tokens = torch.zeros(4, CFG.seq_len + 1, dtype=torch.long)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    plain = zf.estimate(model(), zf.adamw(), zf.Config())
    est = zf.estimate(model(), zf.adamw(), zf.Config(), batch)
    assert est.working["boundary carries"] == (CFG.n_layers + 1) * 4 * CFG.seq_len * CFG.d_model * 4
    assert est.host_peak > plain.host_peak
    assert "peak host" in est.table() and "master" in est.table()


def test_budget_too_small_raises_before_init_with_the_table(tmp_path):
    config = zf.Config(
        offload_params="nvme",
        offload_optimizer="cpu",
        nvme_path=str(tmp_path),
        host_memory_budget=1 << 16,
    )
    with pytest.raises(ValueError, match=r"host_memory_budget(.|\n)*master(.|\n)*peak host"):
        zf.init(model(), zf.adamw(), config)
    assert not os.path.exists(
        tmp_path / "rank0"
    )  # nothing was allocated, not even the tier's directory


def test_disk_too_small_raises_before_init(tmp_path, monkeypatch):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(fit.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1000))
    config = zf.Config(offload_optimizer="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"free space .* under nvme_path"):
        zf.init(model(), zf.adamw(), config)
    assert not os.path.exists(tmp_path / "rank0")


def test_auto_spills_the_optimizer_to_fit_the_host_budget(tmp_path):
    deep = gpt.model(dataclasses.replace(CFG, n_layers=8))
    full = zf.estimate(deep, zf.adamw(), zf.Config(offload_optimizer="cpu"))
    opt_bytes = full.tier_bytes("cpu")
    budget = full.host_peak - opt_bytes // 2  # about half the optimizer rows fit in RAM
    config = zf.Config(offload_optimizer="auto", host_memory_budget=budget, nvme_path=str(tmp_path))
    est = zf.estimate(deep, zf.adamw(), config)
    assert est.config.offload_optimizer == "cpu" and est.config.spill_optimizer is not None
    assert 0 < est.tier_bytes("cpu") < opt_bytes and est.host_peak <= budget
    state = zf.init(deep, zf.adamw(), config)
    assert state.config == est.config and "cpu+nvme" in zf.plan(state)
    zf.close(state)


def test_calibrate_writes_its_cache_and_reuses_it(tmp_path, monkeypatch):
    # the probe's real runs (both placements, in fresh interpreters) with 2 warm and 2 timed steps
    # each, not the 6 + 6 and 6 + 10 that make its medians steady: most of the test's time was
    # those steps and the planner's timing of the layers before each
    short = calibration.ProbeSteps(warm=2, timed=2)
    monkeypatch.setattr(calibration, "PROBE_STEPS", {"memory": short, "nvme": short})
    machine = zf.calibrate(str(tmp_path), disk_bytes=16 << 20)
    path = calibration.cache_path(str(tmp_path))
    assert path == os.path.join(str(tmp_path), "zinf-calibration.json")
    with open(path) as f:
        assert json.load(f) == machine._asdict()
    assert (
        min(machine.disk_read_bps, machine.disk_write_bps, machine.copy_bps, machine.matmul_flops)
        > 0
    )
    assert (
        machine.runtime_rss_bytes >= 0
        and 0 <= machine.disk_exposed <= 1
        and machine.unit_overhead_s >= 0
    )
    monkeypatch.setattr(
        calibration, "_copy_bps", lambda *a: pytest.fail("measured again despite the cache")
    )
    assert zf.calibrate(str(tmp_path)) == machine
    os.unlink(path)  # deleting the file measures again
    monkeypatch.setattr(calibration, "_copy_bps", lambda *a: 1.0)
    monkeypatch.setattr(calibration, "_probe", lambda *a: {})  # the probe runs were covered above
    assert zf.calibrate(str(tmp_path), disk_bytes=16 << 20).copy_bps == 1.0


def test_auto_config_returns_a_config_that_fits(tmp_path, capsys):
    tokens = torch.zeros(4, CFG.seq_len + 1, dtype=torch.long)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    all_nvme = zf.Config(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))
    machine = calibration.Machine(1e9, 1e9, 1e10, 1e10)
    budget = zf.estimate(
        model(), zf.adamw(), all_nvme, batch
    ).host_peak  # some placements do not fit
    config = zf.auto_config(
        model(),
        zf.adamw(),
        nvme_path=str(tmp_path),
        host_memory_budget=budget,
        batch=batch,
        machine=machine,
    )
    assert "chosen" in capsys.readouterr().out
    assert zf.estimate(model(), zf.adamw(), config, batch).host_peak <= budget
    state = zf.init(model(), zf.adamw(), config)
    state, metrics = zf.train_step(state, batch)
    assert metrics["loss"] > 0
    zf.close(state)
    with pytest.raises(ValueError, match="no placement fits"):
        zf.auto_config(
            model(), zf.adamw(), host_memory_budget=1 << 10, machine=machine, verbose=False
        )
