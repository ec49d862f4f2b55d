"""The layer prefetcher's read issue on a thread of its own (``Prefetcher``'s ``issuer``): the
reads of each item are issued there in plan order, each fetch completes its own item's reads, the
caller hands each item over once (the issuer queues its fetch), an unplanned fetch runs behind the
fetches issued, an issue that fails raises at that item's ``get`` with every other read given back,
and a step on NVMe issues every read there and trains bitwise as in RAM."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import optree
import pytest
import torch
from engine_helpers import run_engine

import zinf_fn as zf
from zinf_fn.layout.units import Unit
from zinf_fn.overlap import fetch as fetch_module
from zinf_fn.overlap.plan import ROUTED, PassPlan
from zinf_fn.overlap.prefetch import Prefetcher


class IssueLog:
    """A fetcher whose ``start`` returns a token naming the unit (after ``delay`` seconds, raising
    ``error`` for the unit named ``fails``) and records the thread it ran on; ``fetch`` returns
    (unit name, the token it was handed)."""

    cancellable = True

    def __init__(self, delay: float = 0.0, fails: str | None = None):
        self.delay, self.fails = delay, fails
        self.starts: list[tuple[str, str]] = []  # (unit, thread name), in the order run
        self.released: list = []
        self.abandoned: list = []
        self.fetched: list[str] = []  # units, in the order their fetches ran
        self.lock = threading.Lock()

    def start(self, unit: Unit):
        time.sleep(self.delay)
        if unit.name == self.fails:
            raise OSError(5, f"reading row {unit.row} of {unit.group!r}: injected")
        with self.lock:
            self.starts.append((unit.name, threading.current_thread().name))
        return f"reads of {unit.name}"

    def fetch(self, unit: Unit, started=None):
        with self.lock:
            self.fetched.append(unit.name)
        return unit.name, started

    def release(self, layer):
        self.released.append(layer)

    def abandon(self, started):
        self.abandoned.append(started)


def blocks(n: int) -> list[Unit]:
    return [Unit(i + 1, "blocks", i) for i in range(n)]


def starter(fetcher: IssueLog, plan: PassPlan | list[Unit]):
    """The prefetcher's ``start``: the job issuing item j's reads, of ``plan`` as it is now."""

    def start(j: int):
        return functools.partial(fetcher.start, plan[j])

    return start


def serve(fetcher: IssueLog, plan: list[Unit], depth: int, issuer) -> list:
    """Every item of ``plan`` got in order through a prefetcher over ``fetcher``, then closed."""
    with ThreadPoolExecutor(1, thread_name_prefix="fetch") as executor:
        prefetcher = Prefetcher(
            PassPlan(plan), fetcher, depth, executor, starter(fetcher, plan), issuer=issuer
        )
        got = [prefetcher.get(j) for j in range(len(plan))]
        prefetcher.close()
    return got


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_reads_are_issued_on_the_issuer_in_plan_order_and_each_fetch_gets_its_own(depth):
    plan = blocks(5)
    on_caller = IssueLog()
    plain = serve(on_caller, plan, depth, None)
    issued = IssueLog(delay=0.005)  # slow issues: the caller would see them if it waited
    with ThreadPoolExecutor(1, thread_name_prefix="issuer") as issuer:
        got = serve(issued, plan, depth, issuer)
    # the same layers, each with its own reads, as when the caller issues them
    assert got == plain == [(u.name, f"reads of {u.name}") for u in plan]
    # every item's reads issued in plan order, none on the caller's thread
    assert [u for u, _ in issued.starts] == [u.name for u in plan]
    assert {thread for _, thread in issued.starts} == {"issuer_0"}
    assert {thread for _, thread in on_caller.starts} == {threading.current_thread().name}
    assert not issued.released and not issued.abandoned


class Submits(ThreadPoolExecutor):
    """A fetch thread that records the thread each job was queued from."""

    def __init__(self):
        super().__init__(1, thread_name_prefix="fetch")
        self.callers: list[str] = []

    def submit(self, fn, /, *args, **kwargs):
        self.callers.append(threading.current_thread().name)
        return super().submit(fn, *args, **kwargs)


def test_the_caller_hands_each_item_over_once_and_the_issuer_queues_its_fetch():
    plan = blocks(6)
    fetcher = IssueLog()
    with ThreadPoolExecutor(1, thread_name_prefix="issuer") as issuer, Submits() as executor:
        prefetcher = Prefetcher(
            PassPlan(plan), fetcher, 2, executor, starter(fetcher, plan), issuer=issuer
        )
        got = [prefetcher.get(j) for j in range(len(plan))]
        prefetcher.close()
    assert got == [(u.name, f"reads of {u.name}") for u in plan]
    # every fetch queued by the issuer, once its reads were issued: none by the caller
    assert executor.callers == ["issuer_0"] * len(plan)


def test_an_unplanned_fetch_runs_behind_the_fetches_issued():
    """With several ranks every fetch is a collective: the fetch thread runs them in the order the
    caller issued them, an unplanned one too, however late the issuer queues the planned ones."""
    plan = blocks(4)
    fetcher = IssueLog(delay=0.02)  # the planned fetches reach the fetch thread late
    with (
        ThreadPoolExecutor(1, thread_name_prefix="issuer") as issuer,
        ThreadPoolExecutor(1, thread_name_prefix="fetch") as executor,
    ):
        prefetcher = Prefetcher(
            PassPlan(plan), fetcher, 2, executor, starter(fetcher, plan), issuer=issuer
        )
        assert prefetcher.get(0)[0] == "blocks.0"  # blocks.1 and blocks.2 issued ahead
        extra = Unit(9, "head", 0)
        assert prefetcher.fetch_unplanned(extra) == ("head", None)
        rest = [prefetcher.get(j)[0] for j in (1, 2, 3)]
        prefetcher.close()
    assert rest == ["blocks.1", "blocks.2", "blocks.3"]
    assert fetcher.fetched == ["blocks.0", "blocks.1", "blocks.2", "head", "blocks.3"]


def test_a_failed_issue_raises_at_its_get_and_every_other_read_is_given_back():
    plan = blocks(5)
    fetcher = IssueLog(fails="blocks.2")
    with (
        ThreadPoolExecutor(1, thread_name_prefix="issuer") as issuer,
        ThreadPoolExecutor(1, thread_name_prefix="fetch") as executor,
    ):
        prefetcher = Prefetcher(
            PassPlan(plan), fetcher, 2, executor, starter(fetcher, plan), issuer=issuer
        )
        assert prefetcher.get(0)[0] == "blocks.0" and prefetcher.get(1)[0] == "blocks.1"
        # the error of the issue, as the caller's issue raised it, at the item it belongs to
        with pytest.raises(OSError, match="reading row 2 of 'blocks': injected"):
            prefetcher.get(2)
        prefetcher.close()
    # blocks.3, queued ahead and never taken, given back once: its layer released, or its fetch
    # cancelled with its reads abandoned (None: its issue too was cancelled before it ran)
    issued = "blocks.3" in [u for u, _ in fetcher.starts]
    given_back = fetcher.released + [("blocks.3", reads) for reads in fetcher.abandoned]
    assert given_back == [("blocks.3", "reads of blocks.3" if issued else None)]


def test_a_revision_before_its_issue_runs_leaves_each_fetch_its_own_reads():
    """The tile prefetcher's plan is revised as the ops tell their routing: a job queued on the
    issuer before a revision issues the item it was made for, so each fetch still completes its own
    item's reads, wherever the revision moved it."""
    plan = blocks(4)
    runs = PassPlan(plan)
    fetcher = IssueLog(delay=0.02)  # the jobs still queued when the revision comes
    with (
        ThreadPoolExecutor(1, thread_name_prefix="issuer") as issuer,
        ThreadPoolExecutor(1, thread_name_prefix="fetch") as executor,
    ):
        prefetcher = Prefetcher(runs, fetcher, 2, executor, starter(fetcher, runs), issuer=issuer)
        assert prefetcher.get(0) == ("blocks.0", "reads of blocks.0")  # 1 and 2 queued
        revised = [plan[0], plan[1], plan[3], plan[2]]
        prefetcher.revise(revised, 0, ROUTED)  # blocks.2's fetch moves to position 3
        got = [prefetcher.get(j) for j in (1, 2, 3)]
        prefetcher.close()
    assert got == [(u.name, f"reads of {u.name}") for u in revised[1:]]
    assert {thread for _, thread in fetcher.starts} == {"issuer_0"}


def test_settle_returns_once_the_reads_queued_so_far_are_issued():
    plan = blocks(4)
    fetcher = IssueLog(delay=0.02)
    with (
        ThreadPoolExecutor(1, thread_name_prefix="issuer") as issuer,
        ThreadPoolExecutor(1, thread_name_prefix="fetch") as executor,
    ):
        prefetcher = Prefetcher(
            PassPlan(plan), fetcher, 2, executor, starter(fetcher, plan), issuer=issuer
        )
        prefetcher.get(0)  # blocks.0 fetched; blocks.1 and blocks.2 queued on the issuer
        prefetcher.settle()
        assert [u for u, _ in fetcher.starts] == ["blocks.0", "blocks.1", "blocks.2"]
        prefetcher.close()


def test_a_step_on_nvme_issues_every_read_on_the_issue_thread_and_trains_as_in_ram(
    tmp_path, monkeypatch
):
    threads: set[str] = set()
    start = fetch_module.Fetcher.start

    def recorded(self, unit, derive=False):
        threads.add(threading.current_thread().name)
        return start(self, unit, derive)

    monkeypatch.setattr(fetch_module.Fetcher, "start", recorded)
    ram_losses, ram_final, _, _ = run_engine(zf.Config(prefetch_depth=2), steps=3)
    threads.clear()
    config = zf.Config(
        offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path), prefetch_depth=2
    )
    losses, final, _, _ = run_engine(config, steps=3)
    # every read issued on the issue thread, none on the compute thread
    assert threads == {"zinf-issue_0"}
    # bitwise: issuing reads on another thread moves no bit
    assert losses == ram_losses
    leaves, ram_leaves = optree.tree_leaves(final), optree.tree_leaves(ram_final)
    assert all(torch.equal(a, b) for a, b in zip(leaves, ram_leaves, strict=True))


def test_a_fetch_thread_shut_down_fails_the_get_and_gives_the_reads_back():
    plan = blocks(3)
    fetcher = IssueLog()
    executor = ThreadPoolExecutor(1, thread_name_prefix="fetch")
    executor.shutdown()
    with ThreadPoolExecutor(1, thread_name_prefix="issuer") as issuer:
        prefetcher = Prefetcher(
            PassPlan(plan), fetcher, 1, executor, starter(fetcher, plan), issuer=issuer
        )
        with pytest.raises(RuntimeError, match="after shutdown"):
            prefetcher.get(0)
        prefetcher.close()
    # each read issued was given back once: by its job (blocks.0) or by the prefetcher's close
    assert fetcher.abandoned == [f"reads of {u}" for u, _ in fetcher.starts]


class IssueClock:
    """A clock the prefetcher reads (``time.perf_counter``) that only an issue moves: one second
    each, on the thread that issues."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def start(self, fetcher: IssueLog, plan: list[Unit]):
        def start(j: int):
            def issue():
                self.now += 1.0
                return fetcher.start(plan[j])

            return issue

        return start


def test_a_get_counts_its_wait_apart_from_issuing_the_next_items(monkeypatch):
    """``wait_s`` is the time a get waited for its item, ``refill_s`` the time it then took to
    issue the window's next ones (the caller's own work): on a clock only issues move, the gets
    waited nothing and issued three items, one each after the first three."""
    from types import SimpleNamespace

    from zinf_fn.overlap import prefetch as prefetch_module

    clock = IssueClock()
    monkeypatch.setattr(prefetch_module, "time", SimpleNamespace(perf_counter=clock))
    plan, fetcher = blocks(5), IssueLog()
    with ThreadPoolExecutor(1, thread_name_prefix="fetch") as executor:
        prefetcher = Prefetcher(PassPlan(plan), fetcher, 2, executor, clock.start(fetcher, plan))
        prefetcher.refill()  # items 0 and 1 issued before any get
        got = [prefetcher.get(j) for j in range(len(plan))]
        prefetcher.close()
    assert got == [(u.name, f"reads of {u.name}") for u in plan]
    assert clock.now == 5.0
    assert prefetcher.wait_s == 0.0
    assert prefetcher.refill_s == 3.0
