"""The stream primitives (``zinf_fn.overlap.window``, ``zinf_fn.overlap.stream``) on their own: the
plain loops they equal, their bounds, and that every item goes back when a pass fails."""

from __future__ import annotations

import pytest

from zinf_fn.io.futures import done, failed
from zinf_fn.overlap.stream import InFlight
from zinf_fn.overlap.window import Window


class Log:
    """Issues items as futures of their index and records what is issued and dropped."""

    def __init__(self, fail: int | None = None):
        self.issued, self.dropped, self.fail = [], [], fail

    def issue(self, j: int):
        self.issued.append(j)
        return failed(OSError(f"item {j}")) if j == self.fail else done(j)

    def drop(self, ticket) -> None:
        self.dropped.append(ticket)
        ticket.result()


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_window_in_order_equals_the_plain_loop_and_stays_depth_ahead(depth):
    log, n = Log(), 7
    window = Window(range(n), log.issue, log.drop, depth)
    got = []
    for j in range(n):
        got.append(window.take(j).result())
        window.advance(j + 1)
        assert window.outstanding == min(
            depth, n - j - 1
        )  # exactly the next `depth` items in flight
    assert got == list(range(n)) and log.issued == list(range(n)) and not log.dropped
    assert (window.prefetched, window.on_demand) == ((n - 1, 1) if depth else (0, n))


def test_window_drops_what_falls_out_of_it_and_close_gives_everything_back_on_error():
    log = Log(fail=3)
    window = Window(range(10), log.issue, log.drop, depth=3)
    window.advance(0)  # 0, 1, 2 issued
    assert window.take(0).result() == 0
    window.advance(5)  # 1, 2 mispredicted: dropped; 5, 6, 7 issued
    assert [t.result() for t in log.dropped] == [1, 2] and window.wasted == 2
    window.advance(2)  # a cursor moved back (the tile prefetcher's wrap): 2, 3, 4 again
    assert sorted(log.issued[-3:]) == [2, 3, 4]
    window.close()  # item 3 failed: still dropped, its error swallowed
    assert window.outstanding == 0 and len(log.dropped) == 2 + 6


def test_window_keep_behind_keeps_items_a_slower_taker_still_wants():
    log = Log()
    window = Window(range(6), log.issue, log.drop, depth=2, keep_behind=True)
    window.advance(0)
    window.take(1)  # a second worker takes 1 before the first takes 0
    window.advance(2)
    assert window.take(0).result() == 0 and not log.dropped and window.on_demand == 0


def test_inflight_retires_oldest_first_within_its_limit_and_raises_its_error():
    retired = []

    def retire(ticket):
        retired.append(ticket)
        if ticket == "bad":
            raise OSError("write failed")

    queue = InFlight(retire, limit=2)
    for t in ("a", "b", "c", "bad", "d"):
        queue.put(t)  # each put past two in flight retires the oldest
    assert retired == ["a", "b", "c"] and len(queue) == 2
    with pytest.raises(OSError, match="write failed"):
        queue.put("e")  # retires "bad": its error reaches the caller
    queue.drain()
    assert retired == ["a", "b", "c", "bad", "d", "e"] and len(queue) == 0
    queue.put("bad")
    queue.put("f")
    with pytest.raises(OSError, match="write failed"):
        queue.drain()  # retires both, then raises the first error
    assert retired[-2:] == ["bad", "f"] and len(queue) == 0


def test_inflight_by_weight_keeps_its_newest_operation_however_heavy():
    retired = []
    queue = InFlight(retired.append, limit=100, weight=lambda t: t)
    queue.put(60)
    queue.put(300)  # over the budget: the older one retires, the heavy newest runs on
    assert retired == [60] and len(queue) == 1
    queue.put(10)
    assert retired == [60, 300]
    queue.drain()
    assert retired == [60, 300, 10]
