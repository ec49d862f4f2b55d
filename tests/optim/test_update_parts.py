"""The parts the updater and the prefetcher are made of, on their own: the bounds of ``InFlight``'s
retire loop as the write-behind and the updates' backlog ask it, the named transfers of the
write-behind, the one prefetcher of layers and tiles, the update queue and the decay-span cache."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zinf_fn.io.buffers import BufferPool
from zinf_fn.io.futures import done
from zinf_fn.layout.units import Unit
from zinf_fn.observe.trace import WaitClock
from zinf_fn.offload.tiers import MemoryTier
from zinf_fn.offload.transfers import Transfer, Write
from zinf_fn.optim.decay import decay_spans
from zinf_fn.optim.queue import UpdateQueue
from zinf_fn.overlap.plan import ROUTED, PassPlan
from zinf_fn.overlap.prefetch import Prefetcher
from zinf_fn.overlap.stream import InFlight, WriteBehind, fits
from zinf_fn.tree import flat_spec


def test_press_retires_the_oldest_past_keep_unless_they_fit_in_the_room():
    retired = []
    queue = InFlight(retired.append, limit=100)
    for nbytes in (10, 20, 30, 40):
        queue.put(nbytes)
    queue.press(
        keep=2, fits=lambda older: sum(older) <= 30
    )  # 10 + 20 beyond the newest two: they fit the room
    assert retired == [] and len(queue) == 4
    queue.press(
        keep=2, fits=lambda older: sum(older) <= 25
    )  # 30 > 25: the oldest retires, then 20 fits
    assert retired == [10] and len(queue) == 3
    queue.press(keep=2, fits=lambda older: not older)  # no room: back to keep
    assert retired == [10, 20] and len(queue) == 2


def test_wait_running_waits_for_the_oldest_unfinished_until_limit_run():
    futures = [Future() for _ in range(4)]
    waited = []

    def retire(f):
        waited.append(futures.index(f))
        if not f.done():
            f.set_result(None)  # the "wait" of a running operation: here it completes at once

    queue = InFlight(retire, limit=10, finished=lambda f: f.done())
    for f in futures:
        queue.put(f)
    futures[1].set_result(None)
    queue.wait_running(2)  # 0 (running) is waited for, 1 (finished) retires free, 2 and 3 run on
    assert waited == [0, 1] and len(queue) == 2
    queue.wait_running(2)
    assert waited == [0, 1]


def test_retire_oldest_retires_exactly_one():
    retired = []
    queue = InFlight(retired.append, limit=10)
    queue.retire_oldest()  # nothing queued: nothing to do
    for t in "abc":
        queue.put(t)
    queue.retire_oldest()
    assert retired == ["a"] and len(queue) == 2


def test_write_behind_gives_pooled_buffers_back_once_written():
    pool = BufferPool()
    tier = MemoryTier("cpu", torch.device("cpu"))
    tier.allocate("x.master", 2, 8, torch.float32)
    writes = WriteBehind(pool, limit=1)
    for row in range(2):
        buf = pool.take(4, torch.float32, torch.device("cpu")).fill_(row + 1)
        writes.put([Write(tier, "x.master", row, buf, pooled=True, start=4)])
    assert writes.buffers_held <= 2
    writes.drain()
    assert writes.buffers_held == 0 and pool.out == 0
    assert tier.view("x.master", 1).tolist() == [0.0] * 4 + [2.0] * 4


class FakeFetcher:
    """Fetches a unit as its name; records fetches, reads started, releases and the reads of
    fetches abandoned (cancelled before they ran); the fetch of a unit named in ``gates`` waits for
    its event. Its fetches involve no other rank: one queued may be cancelled."""

    cancellable = True

    def __init__(self, gates: dict | None = None):
        self.fetched, self.started, self.released, self.abandoned = [], [], [], []
        self.gates = gates or {}
        self.lock = threading.Lock()

    def start(self, unit, derive=False):
        self.started.append((unit.name, derive))
        return done(None), None

    def fetch(self, unit, started=None):
        if unit.name in self.gates:
            self.gates[unit.name].wait(10)
        with self.lock:
            self.fetched.append(unit.name)
        return unit.name

    def release(self, layer):
        self.released.append(layer)

    def abandon(self, started):
        self.abandoned.append(started)


def units(n: int) -> list[Unit]:
    return [Unit(i + 1, "blocks", i) for i in range(n)]


def test_one_prefetcher_serves_a_plan_in_order_with_reads_started_ahead():
    fetcher, plan = FakeFetcher(), units(4)
    with ThreadPoolExecutor(1) as executor:
        prefetcher = Prefetcher(
            PassPlan(plan),
            fetcher,
            2,
            executor,
            start=lambda j: functools.partial(fetcher.start, plan[j], derive=j > 1),
        )
        assert [prefetcher.get(j) for j in range(4)] == [
            "blocks.0",
            "blocks.1",
            "blocks.2",
            "blocks.3",
        ]
        prefetcher.close()
    assert fetcher.started[-2:] == [("blocks.2", True), ("blocks.3", True)] and not fetcher.released
    assert (prefetcher.prefetched, prefetcher.on_demand, prefetcher.wasted) == (3, 1, 0)


def test_one_prefetcher_follows_a_revised_plan_and_serves_unplanned_units_on_demand():
    # blocks.1's fetch waits until the revision is made: blocks.2's, queued behind it, has not begun
    gate = threading.Event()
    fetcher, plan = FakeFetcher({"blocks.1": gate}), units(4)
    with ThreadPoolExecutor(1) as executor:
        prefetcher = Prefetcher(
            PassPlan(plan), fetcher, 2, executor
        )  # tiles: no reads started ahead
        assert prefetcher.get(0) == "blocks.0"  # 1, 2 issued
        revised = [plan[0], plan[1], plan[3], plan[2]]
        prefetcher.revise(revised, 0, ROUTED)
        # the fetch of blocks.2 dropped is cancelled, never run (nor waited for): its reads given
        # back (none started here), nothing to release
        assert prefetcher.wasted == 1 and fetcher.abandoned == [None] and not fetcher.released
        gate.set()
        # the plan before the pass is a value the revision left as it was
        assert prefetcher.plan.planned == units(4) and prefetcher.plan.now == revised
        assert (
            prefetcher.fetch_unplanned(Unit(9, "head", 0)) == "head" and prefetcher.unplanned == 1
        )
        assert prefetcher.get(1) == "blocks.1" and prefetcher.get(2) == "blocks.3"
        prefetcher.close()
    # blocks.2, issued again at the end, given back: released once fetched, or abandoned
    assert not fetcher.started and len(fetcher.released) + len(fetcher.abandoned) == 2
    assert fetcher.fetched.count("blocks.2") == len(fetcher.released)


def test_update_queue_runs_inline_without_workers_and_bounds_its_backlog_with_them():
    ran = []
    inline = UpdateQueue(0, limit_bytes=0, waits=WaitClock())
    inline.submit(ran.append, 1, "now")
    assert ran == ["now"]
    gate = threading.Event()
    queue = UpdateQueue(1, limit_bytes=100, waits=WaitClock())
    queue.submit(lambda: (gate.wait(), ran.append("a")), 60)
    queue.submit(lambda: ran.append("b"), 30)
    gate.set()
    queue.wait_backlog(0)  # sync: both ran
    assert ran == ["now", "a", "b"]
    queue.wait()
    queue.close()


def test_decay_spans_merge_touching_leaves_within_this_ranks_range():
    spec = flat_spec({"w": torch.zeros(4), "b": torch.zeros(2), "v": torch.zeros(4)})
    spans = decay_spans(spec, "blocks.0.", (2, 10), lambda path: not path.endswith(".b"))
    paths = {leaf.path: (leaf.offset, leaf.numel) for leaf in spec.leaves}
    decayed = [range(o, o + n) for p, (o, n) in paths.items() if not p.endswith("b")]
    want = sorted(i - 2 for r in decayed for i in r if 2 <= i < 10)
    got = sorted(i for lo, hi in spans.spans for i in range(lo, hi))
    assert got == want and spans.numel == 8
    assert decay_spans(spec, "blocks.0.", (0, 10), None) is None


def test_a_write_behind_room_counts_buffers_size_by_size():
    """``stream.fits``: older write groups fit a room of buffers per (numel, dtype); a size the room
    does not name (a 16-bit copy beside the rows read) rides along with its group, a group of none
    of its sizes does not fit."""

    def group(*sizes):
        return [Transfer(torch.empty(n, dtype=dtype), None, True) for n, dtype in sizes]

    row, copy = (8, torch.float32), (8, torch.bfloat16)
    two_pieces = [group(row, row, copy), group(row, row, copy)]
    assert fits(two_pieces, {row: 4})
    assert not fits(two_pieces, {row: 3})
    assert not fits([group(copy)], {row: 4})  # nothing of the room's sizes
    assert not fits(two_pieces, {})  # no room at all
