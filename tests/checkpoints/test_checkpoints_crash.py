"""SIGKILL at random points of a save: ``latest()`` always finds a complete, restorable checkpoint.

Each trial forks a process (from a forkserver that has imported torch once, so a trial costs
milliseconds, not an interpreter start) that resumes from ``latest(root)`` and then alternates one
training step and one ``save(..., keep=2)``, until it is killed with SIGKILL just before the k-th
file-system call its saves make (``ckpt_workers.die_at_fs_call``; k drawn at random, from a seed,
over about a save and a half: before the commit, during it, while retention deletes the oldest
checkpoint, in the next save). The kill point is a count of progress, not a delay, so a loaded
machine changes nothing. The test counts the hidden directories the kills leave behind, to show that
it exercised what it claims. After every kill the newest checkpoint is restored and compared bitwise
with an uninterrupted run at its step: resuming from it is exact.
"""

from __future__ import annotations

import os
import random
import signal

import torch
from ckpt_workers import config, local_rows, model, optimizer, save_until_killed, train
from dist_utils import forkserver, one_thread
from engine_helpers import batches

import checkpoints
import zinf_fn as zf
from checkpoints.restore import open_arrays

TRIALS = 20
# Hidden directories a kill inside save() leaves: the save's own (.tmp-), or retention's (keep=2
# deletes by renaming out of sight first: .deleting-; overwrite moves the old one aside: .old-).
IN_SAVE = (".tmp-", ".deleting-", ".old-")
N_BATCHES = 8
# The kill comes before file-system call k of the saves, k uniform in [1, KILL_RANGE]: a save of the
# test GPT makes ~290 with its checksums (~130 until its commit), so ~70% of the trials commit a
# save first.
KILL_RANGE = 460


class Reference:
    """The uninterrupted run, stepped on demand: rows of every saved state kind at each step."""

    def __init__(self):
        self.state = zf.init(model(), optimizer(), config("cpu", param_dtype=torch.float32))
        self.rows = {0: local_rows(self.state)}
        self.data = batches(N_BATCHES)

    def at(self, step: int) -> dict:
        while self.state.step < step:
            self.state, _ = train(self.state, [self.data[self.state.step % N_BATCHES]])
            self.rows[self.state.step] = local_rows(self.state)
        return self.rows[step]


def test_sigkill_during_save_never_exposes_a_partial_checkpoint(tmp_path):
    with one_thread():  # the worker computes with one thread: the same kernels, bitwise
        _run_trials(tmp_path / "ckpts")


def _run_trials(root):
    reference = Reference()
    checkpoints.save(root / "step_000000", reference.state)
    ctx = forkserver()  # its preload: ckpt_workers, torch.func and dynamo (they import slowly)
    rng = random.Random(0)
    killed_mid_save, steps, leftovers = 0, [0], set()
    for trial in range(TRIALS):
        kill_at = rng.randint(1, KILL_RANGE)
        proc = ctx.Process(target=save_until_killed, args=(str(root), N_BATCHES, kill_at))
        proc.start()
        proc.join()  # sync: the worker kills itself at its kill point
        assert proc.exitcode == -signal.SIGKILL, (
            f"trial {trial}: exit code {proc.exitcode}, not killed at {kill_at}"
        )
        new = {n for n in os.listdir(root) if n.startswith(".")} - leftovers
        killed_mid_save += any(mark in n for n in new for mark in IN_SAVE)
        leftovers |= new
        path = checkpoints.latest(root)
        assert path is not None, os.listdir(root)
        visible = [os.path.join(root, n) for n in os.listdir(root) if not n.startswith(".")]
        for other in visible:  # every visible checkpoint is whole: manifest, arrays, every chunk
            open_arrays(other, checkpoints.read_manifest(other), None)
        step = checkpoints.read_manifest(path)["step"]
        restored = checkpoints.restore(
            path, model(), optimizer(), config("cpu", param_dtype=torch.float32)
        )
        assert restored.step == step
        want = reference.at(step)
        got = local_rows(restored)
        assert [k for k in want if not torch.equal(want[k], got[k])] == [], f"step {step} differs"
        steps.append(step)
    assert killed_mid_save >= TRIALS // 4, (
        f"only {killed_mid_save} of {TRIALS} kills landed mid-save"
    )
    assert steps[-1] >= TRIALS // 2, f"the runs made little progress: {steps}"
