"""SIGTERM during a run: the step finishes, a checkpoint is saved, the process exits 0, and a run
resumed from that checkpoint is bitwise the run that was never interrupted."""

from __future__ import annotations

import os
import signal
import time

from cli_helpers import TINY_GPT, metrics, start
from dist_utils import one_thread

from zinf_cli import main

# far more than the child runs between its 3rd record and the signal: it stops after step 4 or 5
# (measured beside other jobs), so 120 leaves it ~115 steps (~2 s) of this process's lag before it
# would finish (a shared CI machine may hold this process back that long); every step the resumed
# and the whole runs take is paid twice in this process
STEPS = 120
COMMON = (*TINY_GPT, f"steps={STEPS}", "warmup=5", "save_every=100000")  # no periodic save


def _wait_for_steps(run_dir, n: int, proc, timeout: float = 300) -> None:
    """Until ``run_dir/metrics.jsonl`` has ``n`` records (the loop and its signal handler run)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.isfile(path) and len(open(path).readlines()) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{path}: fewer than {n} records before the run ended or {timeout} s")


def test_sigterm_saves_and_resume_is_the_uninterrupted_run(tmp_path):
    cut = tmp_path / "cut"
    proc = start("train", *COMMON, f"run_dir={cut}")
    _wait_for_steps(cut, 3, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    stopped = metrics(cut)[-1]["step"]
    assert 3 <= stopped < STEPS and f"stopping after step {stopped}" in output
    assert os.path.isdir(cut / f"step_{stopped:06d}")  # saved at the step it stopped after
    # the resumed and the uninterrupted runs are no test of a process: in this one, with the
    # child's one thread (OMP_NUM_THREADS=1)
    with one_thread():
        assert main(["train", *COMMON, f"run_dir={cut}", f"resume={cut}"]) == 0
        assert main(["train", *COMMON, f"run_dir={tmp_path / 'whole'}"]) == 0
    assert metrics(cut) == metrics(tmp_path / "whole")  # losses, lrs, grad norms: bitwise
