"""Trackers: the TensorBoard events of ``report_to=tensorboard``, read back with tensorboard's own
event reader, hold the values of ``metrics.jsonl`` (as float32, what an event stores)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import TINY_GPT, zinf_fn

from zinf_cli.trackers import open_trackers

KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "io_wait_s", "disk_read_gb_s", "peak_rss_gib")


def test_tensorboard_events_equal_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = zinf_fn("train", *TINY_GPT, "steps=4", "report_to=tensorboard", f"run_dir={tmp_path}")
    assert run.returncode == 0, run.stderr
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in KEYS:
        got = [(e.step, e.value) for e in events.Scalars(f"train/{key}")]
        assert got == [(r["step"], float(np.float32(r[key]))) for r in records], key


def test_an_unknown_tracker_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"report_to: expected some of \['tensorboard', 'wandb', "
                                         r"'mlflow'\], got 'comet'"):
        open_trackers(["comet"], str(tmp_path))
