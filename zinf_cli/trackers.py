"""Where a run's per-step records go: ``metrics.jsonl`` always; TensorBoard, W&B, MLflow on request.

A tracker is anything with ``write(record)`` and ``close()`` (``Tracker``); a record is a flat dict
with an integer ``"step"`` and numbers. No tracker is a required dependency: asking for one that is
not installed is an error that says what to install.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

TRACKERS = ("tensorboard", "wandb", "mlflow")


class Tracker(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line (train steps, evaluations). Opened at ``step``,
    it keeps the records up to that step and drops later ones (a resumed run writes them again).
    ``write=False`` (ranks other than 0): the records are kept in memory only."""

    def __init__(self, path: str, step: int = 0, write: bool = True):
        self.path, self.records, self.writes = path, [], write
        if write and step and os.path.isfile(path):
            with open(path) as f:
                self.records = [r for r in map(json.loads, f) if r["step"] <= step]
        if write:
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records)

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self.writes:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


class TensorBoard:
    """TensorBoard event files under ``directory``: one scalar per record key, ``train/<key>``."""

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(directory)

    def write(self, record: dict) -> None:
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(f"train/{key}", value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run (``wandb.init(project=..., dir=run_dir)``), logged at each record's step."""

    def __init__(self, run_dir: str, name: str):
        import wandb

        self.run = wandb.init(project="zinf-fn", name=name, dir=run_dir)

    def write(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run (the tracking URI MLflow is configured with), metrics at each record's step."""

    def __init__(self, name: str):
        import mlflow

        self.mlflow = mlflow
        mlflow.start_run(run_name=name)

    def write(self, record: dict) -> None:
        metrics = {k: v for k, v in record.items() if k != "step"}
        self.mlflow.log_metrics(metrics, step=record["step"])

    def close(self) -> None:
        self.mlflow.end_run()


def open_trackers(names: list[str] | None, run_dir: str) -> list[Tracker]:
    """The trackers ``names`` asks for (``report_to``), writing under ``run_dir``."""
    out = []
    for name in names or ():
        if name not in TRACKERS:
            raise ValueError(f"report_to: expected some of {list(TRACKERS)}, got {name!r}")
        try:
            out.append(_opened(name, run_dir))
        except ImportError as e:
            raise ValueError(f"report_to {name}: {e}; install it (pip install {name}) or leave "
                             f"{name} out of report_to") from e
    return out


def _opened(name: str, run_dir: str) -> Tracker:
    label = os.path.basename(os.path.abspath(run_dir))
    if name == "tensorboard":
        return TensorBoard(os.path.join(run_dir, "tensorboard"))
    if name == "wandb":
        return WandB(run_dir, label)
    return MLflow(label)


class Trackers:
    """``metrics.jsonl`` (its records kept: ``records``) and the other trackers, written as one."""

    def __init__(self, log: MetricsLog, others: list[Tracker]):
        self.log, self.others = log, others

    @property
    def records(self) -> list[dict]:
        return self.log.records

    def write(self, record: dict) -> None:
        self.log.write(record)
        for tracker in self.others:
            tracker.write(record)

    def close(self) -> None:
        for tracker in self.others:
            tracker.close()
