"""``tiling.two_at_once.each``: jobs computed two at once, one on the side thread, against the plain
loop: the same results, every fetch in order on the calling thread, every input released once
(after its job), and a failing job's error raised with nothing left held."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
from dist_utils import one_thread

from zinf_fn.overlap import tile_runs
from zinf_fn.tiling import two_at_once


class _Jobs:
    """Jobs j -> j * j, each input a token fetched and released, logged with the thread."""

    def __init__(self, fail: int | None = None, gated: bool = True):
        self.fetched, self.released, self.computed = [], [], {}
        self.fail = fail
        self.lock, self.started, self.gated = threading.Lock(), threading.Event(), gated

    def fetch(self, j: int):
        self.fetched.append((j, threading.current_thread().name))
        return ("held", j)

    def compute(self, j: int, held):
        assert held == ("held", j) and (j, held) not in self.released
        with self.lock:
            self.computed[j] = threading.current_thread().name
        # job 1 (here) waits for job 0 to start (on the side thread, which runs on a free core)
        if self.gated:
            self.started.set() if j == 0 else self.started.wait(10) if j == 1 else None
        if j == self.fail:
            raise RuntimeError(f"job {j} failed")
        return j * j

    def release(self, j: int, held):
        assert held == ("held", j)
        self.released.append((j, threading.current_thread().name))


@contextlib.contextmanager
def _two_threads():
    """torch at two threads at least, so ``each`` has a side thread beside this one."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_each_is_the_loop_its_fetches_and_releases_on_this_thread():
    jobs = _Jobs()
    out = two_at_once.each(9, jobs.fetch, jobs.compute, jobs.release, lambda j, held: j != 4)
    main = threading.current_thread().name
    assert out == [j * j for j in range(9)]
    assert jobs.fetched == [(j, main) for j in range(9)]
    assert sorted(jobs.released) == [(j, main) for j in range(9)]
    assert jobs.computed[4] == main  # refused: here
    if torch.get_num_threads() > 1:  # the first job goes to the idle side thread
        assert jobs.computed[0].startswith("zinf-side")


def test_a_side_job_not_started_is_computed_here():
    """Where the side thread has not started its job when this thread has nothing else to do (it
    runs only on a free core, and here it is kept busy), this thread computes it: no wait."""
    jobs, gate = _Jobs(gated=False), threading.Event()
    blocker = two_at_once.side_thread().submit(gate.wait, 10)  # the side thread busy
    try:
        out = two_at_once.each(2, jobs.fetch, jobs.compute, jobs.release, lambda j, held: True)
    finally:
        gate.set()
        blocker.result()
    main = threading.current_thread().name
    assert out == [0, 1] and jobs.computed == {0: main, 1: main}
    assert sorted(jobs.released) == [(0, main), (1, main)]


def test_the_side_thread_takes_the_next_waiting_job_itself():
    """A job waiting for the side thread is taken by it as soon as its job before ends, while this
    thread computes another: job 0 on the side thread; job 1 waits for it there (fetched once job
    0 has started); this thread's job waits until the side thread has computed job 1."""
    started, side_did_1 = threading.Event(), threading.Event()
    computed, main = {}, threading.current_thread().name

    def fetch(j):
        if j == 1:
            assert started.wait(10)
        return j

    def compute(j, held):
        computed[j] = threading.current_thread().name
        if j == 0:
            started.set()
        elif j == 1:
            side_did_1.set()
        else:
            assert side_did_1.wait(10)  # no one but the side thread computes job 1 meanwhile
        return j

    with _two_threads():
        out = two_at_once.each(3, fetch, compute, lambda j, held: None, lambda j, held: True)
    assert out == [0, 1, 2]
    assert computed[0].startswith("zinf-side") and computed[1].startswith("zinf-side")
    assert computed[2] == main


def test_at_most_three_jobs_inputs_are_out_at_once():
    """The fetcher's demand counts three jobs' inputs out (``tile_runs.EXPERTS_AT_ONCE``): the side
    thread's, one waiting for it, this thread's. A side thread that finishes each job at once
    while this thread fetches the next (slowly) never leaves more out: its finished jobs' inputs
    are released before each fetch."""
    lock, out, most = threading.Lock(), [0], [0]

    def fetch(j):
        time.sleep(0.001)
        with lock:
            out[0] += 1
            most[0] = max(most[0], out[0])
        return j

    def compute(j, held):
        if not threading.current_thread().name.startswith("zinf-side"):
            time.sleep(0.002)
        return j

    def release(j, held):
        with lock:
            out[0] -= 1

    with _two_threads():
        got = two_at_once.each(30, fetch, compute, release, lambda j, held: True)
    assert got == list(range(30)) and out[0] == 0
    assert most[0] <= tile_runs.EXPERTS_AT_ONCE == 3


def test_one_thread_or_one_job_computes_everything_here():
    main = threading.current_thread().name
    with one_thread():
        jobs = _Jobs()
        assert two_at_once.each(3, jobs.fetch, jobs.compute, jobs.release, lambda j, h: True) == [
            0,
            1,
            4,
        ]
    assert set(jobs.computed.values()) == {main}
    jobs = _Jobs()
    assert two_at_once.each(1, jobs.fetch, jobs.compute, jobs.release, lambda j, h: True) == [0]
    assert jobs.computed == {0: main}


@pytest.mark.parametrize("fail", [0, 1, 3])
def test_a_failing_job_raises_and_leaves_nothing_held(fail):
    """Job 0 runs on the side thread (with two threads), the others here; whichever fails, its
    error comes out and every input fetched is released once, the side job's after it ended."""
    jobs = _Jobs(fail)
    with pytest.raises(RuntimeError, match=f"job {fail} failed"):
        two_at_once.each(5, jobs.fetch, jobs.compute, jobs.release, lambda j, held: True)
    fetched = [j for j, _ in jobs.fetched]
    assert sorted(j for j, _ in jobs.released) == fetched
    assert fetched == list(range(len(fetched))) and fail in fetched


def test_torch_on_one_thread_keeps_the_side_thread():
    """Within ``torch_on_one_thread(True)`` torch's ops on this thread run on one thread while
    ``each`` still hands a job to the side thread (it counts the threads torch had); nested, it
    changes nothing; after, torch's count is back. ``False``, or torch on one thread already:
    nothing changes, and with one thread no job goes to the side."""
    before = torch.get_num_threads()
    with two_at_once.torch_on_one_thread(False):
        assert torch.get_num_threads() == before
    with two_at_once.torch_on_one_thread(True):
        assert torch.get_num_threads() == 1 and two_at_once.threads() == before
        with two_at_once.torch_on_one_thread(True):
            assert torch.get_num_threads() == 1 and two_at_once.threads() == before
        assert two_at_once.threads() == before
        jobs = _Jobs()
        out = two_at_once.each(3, jobs.fetch, jobs.compute, jobs.release, lambda j, held: True)
    assert out == [0, 1, 4] and torch.get_num_threads() == before == two_at_once.threads()
    if before > 1:
        assert jobs.computed[0].startswith("zinf-side")
    main = threading.current_thread().name
    with one_thread(), two_at_once.torch_on_one_thread(True):
        assert two_at_once.threads() == 1
        jobs = _Jobs(gated=False)
        two_at_once.each(3, jobs.fetch, jobs.compute, jobs.release, lambda j, held: True)
    assert set(jobs.computed.values()) == {main}
