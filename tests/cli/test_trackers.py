"""Trackers: the TensorBoard events of ``report_to=tensorboard``, read back with tensorboard's own
event reader, hold the values of ``metrics.jsonl`` (as float32, what an event stores). The runs are
no test of a process: in this one (``zinf_fn_here``), but W&B's (its service and settings are
per-process state)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import TINY_GPT, wandb_history, zinf_fn, zinf_fn_here

from zinf_cli.trackers import open_trackers

KEYS = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "model_flops_per_s",
    "io_wait_s",
    "disk_read_gb_s",
    "peak_rss_gib",
)


def test_tensorboard_events_equal_metrics_jsonl(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = zinf_fn_here(
        capsys, "train", *TINY_GPT, "steps=4", "report_to=tensorboard", f"run_dir={tmp_path}"
    )
    assert run.returncode == 0, run.stderr
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in KEYS:
        got = [(e.step, e.value) for e in events.Scalars(f"train/{key}")]
        assert got == [(r["step"], float(np.float32(r[key]))) for r in records], key


def test_wandb_offline_run_holds_the_values_of_metrics_jsonl(tmp_path):
    """W&B is no dependency of the project, a dev one (``.[dev]``): offline, the run's own record
    file read back."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run = zinf_fn("train", *TINY_GPT, "steps=3", "report_to=wandb", f"run_dir={tmp_path}", env=env)
    assert run.returncode == 0, run.stderr
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    history = wandb_history(tmp_path)
    assert [row["_step"] for row in history] == [r["step"] for r in records]
    for row, record in zip(history, records, strict=True):
        assert {k: row[k] for k in record if k != "step"} == {
            k: v for k, v in record.items() if k != "step"
        }


def test_mlflow_run_holds_the_values_of_metrics_jsonl(tmp_path, monkeypatch, capsys):
    """MLflow is no dependency of the project, a dev one (``mlflow-skinny`` in ``.[dev]``): a
    tracking directory of the test's own, read back through MLflow's client."""
    import mlflow

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # no database needed
    run = zinf_fn_here(
        capsys, "train", *TINY_GPT, "steps=3", "report_to=mlflow", f"run_dir={tmp_path / 'run'}"
    )
    assert run.returncode == 0, run.stderr
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    client = mlflow.tracking.MlflowClient(uri)
    (logged,) = client.search_runs(["0"])
    assert logged.info.run_name == "run"  # the run directory's name
    for key in KEYS:
        history = client.get_metric_history(logged.info.run_id, key)
        assert [(m.step, m.value) for m in history] == [(r["step"], r[key]) for r in records], key


def test_an_unknown_tracker_is_refused_by_name(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"report_to: expected some of \['tensorboard', 'wandb', "
        r"'mlflow'\], got 'comet'",
    ):
        open_trackers(["comet"], str(tmp_path))


def tiny_llama(lora_rank: int):
    """(cfg, model) of a two-layer Llama of seq_len 16, LoRA on q and v when ``lora_rank``; its
    heads 24 wide, so its query width (48) is not d_model (32), as in Gemma 3 and Qwen3."""
    from layers import llama, lora

    cfg = llama.Config(
        vocab_size=64, d_model=32, n_heads=2, head_dim=24, n_layers=2, seq_len=16, d_ff=64
    )
    model = llama.model(cfg)
    if lora_rank:
        model = lora.apply(model, rank=lora_rank, targets=("attn.q", "attn.v"))
    return cfg, model


def palm_count(cfg, model, lora_rank: int, length: int) -> int:
    """One token's FLOPs by hand from the model's own trees: 6 per weight of a trained matmul, 4 of
    a frozen one (no weight gradient), none for the embedding, plus 12 * layers * n_heads *
    head_dim * length for attention over a row of ``length`` positions."""
    import torch

    from zinf_fn.tree import flat_spec

    gen = torch.Generator().manual_seed(0)
    block = [leaf for leaf in flat_spec(model.block.init(gen, 0)).leaves if len(leaf.shape) >= 2]
    head_leaves = flat_spec(model.head.init(gen)).leaves
    head = sum(leaf.numel for leaf in head_leaves if len(leaf.shape) >= 2)
    adapters = sum(leaf.numel for leaf in block if "lora" in leaf.path)
    base = sum(leaf.numel for leaf in block if "lora" not in leaf.path)
    trained = 4 if lora_rank else 6  # a LoRA model trains its adapters only
    matmuls = cfg.n_layers * (trained * base + 6 * adapters) + trained * head
    return matmuls + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * length


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_model_flops_per_token_is_palms_count(lora_rank):
    """``model_flops_per_s``' count per token, against the hand count at the model's seq_len."""
    import zinf_fn as zf
    from zinf_cli.loop import flops_per_token

    cfg, model = tiny_llama(lora_rank)
    state = zf.init(model, zf.adamw())
    assert flops_per_token(state).at(cfg.seq_len) == palm_count(cfg, model, lora_rank, cfg.seq_len)
    zf.close(state)


def test_a_shorter_batch_counts_attention_at_its_own_length():
    """A step's ``model_flops_per_s`` over its ``tokens_per_s`` is the hand count at the batch's
    length (8), not at the model's seq_len (16): a bucketed batch attends over its own rows only."""
    import torch

    import zinf_fn as zf
    from zinf_cli.loop import flops_per_token, timed_step

    cfg, model = tiny_llama(0)
    state = zf.init(model, zf.adamw())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=gen)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}  # (2, 8)
    state, record = timed_step(state, batch, 0, flops_per_token(state))
    per_token = record["model_flops_per_s"] / record["tokens_per_s"]
    # both figures divide by the same seconds: equal to a few ulps of the division's rounding
    assert per_token == pytest.approx(palm_count(cfg, model, 0, 8), rel=1e-12)
    assert per_token != pytest.approx(palm_count(cfg, model, 0, cfg.seq_len), rel=1e-3)
    zf.close(state)
