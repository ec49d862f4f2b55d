"""Where the ``--moe`` run's step went, by the clocks of the thread that ran it, of the process and
of the machine (``moe_run.train_frozen`` reads them around each step; Linux's ``/proc`` where
there is one, None elsewhere)."""

from __future__ import annotations

import os
import time


def thread_clock() -> tuple[float, float | None, float, float | None]:
    """The calling thread's CPU seconds, its seconds runnable but waiting for a core (Linux's
    ``/proc/thread-self/schedstat``; None elsewhere), the process's CPU seconds and the machine's
    stolen seconds (``steal_seconds``), so far."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            waited = int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        waited = None
    return time.thread_time(), waited, time.process_time(), steal_seconds()


def steal_seconds() -> float | None:
    """CPU seconds the hypervisor has run something else while this virtual machine's cores had
    work, summed over its cores (``/proc/stat``'s steal; None off Linux): time no thread's clock
    of the guest counts, in which a step's threads wait for a core they seem to hold."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def clock_spent(before: tuple, after: tuple) -> dict:
    """Where a step's wall time went on the thread that ran it, from two ``thread_clock``
    readings: its CPU (the compute and the engine's Python on it), its wait for a core (other
    threads, the process's or the machine's, on the cores), the whole process's CPU and the
    machine's stolen seconds; the rest of the wall it slept (waits on fetches, locks, the GIL)."""
    waited = None if before[1] is None else after[1] - before[1]
    stolen = None if before[3] is None or after[3] is None else after[3] - before[3]
    return {
        "thread_cpu_s": after[0] - before[0],
        "thread_runqueue_s": waited,
        "process_cpu_s": after[2] - before[2],
        "machine_steal_s": stolen,
    }
