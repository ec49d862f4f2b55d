"""Where a step's time goes: a tiny span recorder (Chrome trace JSON) and an I/O busy clock.

``Tracer(path)`` records complete spans (``ph: "X"``) per thread -- compute, read, write, gather,
update and the waits of the compute thread -- and appends them to ``path`` after every step, keeping
the file a valid JSON array that Perfetto (ui.perfetto.dev) and chrome://tracing open. When tracing
is off the runtime holds ``NULL_TRACER``, whose ``span`` returns one shared do-nothing context: the
cost of an untraced span is a method call.

``BusyClock`` measures the wall time during which at least one I/O request was executing (the union
of the I/O spans over every thread); the runtime reports it next to the time compute waited on I/O,
and their difference is the I/O that ran hidden behind compute.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple


class _NullSpan:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL_SPAN = _NullSpan()


class NullTracer:
    enabled = False

    def span(self, cat: str, name: str, **args):
        return _NULL_SPAN

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


NULL_TRACER = NullTracer()


class _Span:
    __slots__ = ("tracer", "cat", "name", "args", "t0")

    def __init__(self, tracer, cat, name, args):
        self.tracer, self.cat, self.name, self.args = tracer, cat, name, args

    def __enter__(self):
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        self.tracer.record(self.cat, self.name, self.t0, time.perf_counter_ns(), self.args)
        return False


class Tracer:
    """Records spans from any thread; ``flush`` appends them to the trace file (valid JSON after
    each)."""

    enabled = True

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self._t0 = time.perf_counter_ns()
        self._events: list[dict] = []
        self._threads: dict[int, str] = {}
        self._lock = threading.Lock()
        self._written = 0
        with open(self.path, "w") as f:
            f.write("[\n]\n")

    def span(self, cat: str, name: str, **args) -> _Span:
        return _Span(self, cat, name, args)

    def record(
        self, cat: str, name: str, start_ns: int, end_ns: int, args: dict | None = None
    ) -> None:
        thread = threading.current_thread()
        event = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "pid": os.getpid(),
            "tid": thread.ident,
            "ts": (start_ns - self._t0) / 1e3,
            "dur": (end_ns - start_ns) / 1e3,
        }
        if args:
            event["args"] = args
        with self._lock:
            if thread.ident not in self._threads:
                self._threads[thread.ident] = thread.name
                self._events.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": os.getpid(),
                        "tid": thread.ident,
                        "args": {"name": thread.name},
                    }
                )
            self._events.append(event)

    def flush(self) -> None:
        """Append the spans recorded since the last flush, rewriting only the closing bracket."""
        with self._lock:
            events, self._events = self._events, []
        if not events:
            return
        body = ",\n".join(json.dumps(e) for e in events)
        with open(self.path, "r+") as f:
            f.seek(0, os.SEEK_END)
            f.seek(f.tell() - 2)  # before the closing "]\n"
            f.write(("," if self._written else "") + body + "\n]\n")
        self._written += len(events)

    def close(self) -> None:
        self.flush()


def make_tracer(path: str | None):
    return Tracer(path) if path else NULL_TRACER


class BusyClock:
    """Wall seconds during which at least one I/O request ran (overlapping requests count once).

    ``now``: the clock read at a first ``enter`` and a last ``exit`` (seconds;
    ``time.perf_counter``).
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self._lock = threading.Lock()
        self._running = 0
        self._since = 0.0
        self.busy_s = 0.0

    def enter(self) -> None:
        with self._lock:
            if self._running == 0:
                self._since = self._now()
            self._running += 1

    def exit(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self.busy_s += self._now() - self._since

    def read(self) -> float:
        """Busy seconds so far, including a request still running."""
        with self._lock:
            extra = self._now() - self._since if self._running else 0.0
            return self.busy_s + extra


class WaitClock:
    """Seconds the compute thread spent blocked on I/O or background work: the exposed wait.

    Every place that blocks (a prefetched layer, a checkpoint read, an update falling behind, the
    end-of-step drain of writes) runs under ``waiting(what)``; only the compute thread's waits count
    (a background worker waiting on its reads is overlap, not exposure), nested waits count once,
    and each counted wait becomes a "wait" span in the trace.
    """

    def __init__(self, tracer=NULL_TRACER):
        self.tracer = tracer
        self.thread = threading.get_ident()
        self.seconds = 0.0
        self._depth = 0

    def computes_here(self) -> None:
        """The calling thread is the compute thread from now on (a step's thread)."""
        self.thread = threading.get_ident()

    def waiting(self, what: str):
        if threading.get_ident() != self.thread:
            return _NULL_SPAN
        return _Wait(self, what)


class _Wait:
    __slots__ = ("clock", "what", "t0")

    def __init__(self, clock: WaitClock, what: str):
        self.clock, self.what = clock, what

    def __enter__(self):
        self.clock._depth += 1
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        clock = self.clock
        clock._depth -= 1
        if clock._depth == 0:
            end = time.perf_counter_ns()
            clock.seconds += (end - self.t0) / 1e9
            if clock.tracer.enabled:
                clock.tracer.record("wait", f"wait {self.what}", self.t0, end)
        return False


class Observers(NamedTuple):
    """What watches a runtime, handed to every tier and worker at construction: one tracer, one I/O
    busy clock shared by every tier, one clock of the compute thread's exposed waits."""

    tracer: Tracer | NullTracer
    io_clock: BusyClock
    waits: WaitClock


def make_observers(trace_path: str | None) -> Observers:
    tracer = make_tracer(trace_path)
    return Observers(tracer, BusyClock(), WaitClock(tracer))
