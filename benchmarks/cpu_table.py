"""Where a step's CPU goes: CPU seconds per thread role and, inside the update workers, per phase.

Two clocks, both the kernel's per-thread CPU clocks, no sampling:

- ``ThreadClocks``: every thread of the process (``/proc/self/task/*/schedstat``, nanoseconds of
  CPU; its user and kernel parts and its voluntary and involuntary context switches from ``stat``
  and ``status``: the kernel's time is the page faults, the pinning of O_DIRECT pages, the wake-ups
  and the yields of spinning OpenMP threads), grouped by role from the thread's name: compute (the
  main thread), fetch (``zinf-fetch``),
  the layers' read issue (``zinf-issue``),
  disk reads and writes (``zinf-nvme-*-read`` / ``-write``), update workers (``zinf-update``), and
  the OpenMP helpers a thread starts (the C kernels and torch run their parallel loops on them): a
  helper inherits its creator's OS name, which ``Phases`` sets on every engine thread that enters a
  phase (so the helpers of the update workers read "update (omp helpers)").
- ``Phases``: the engine's functions wrapped in place (``install``, before ``zf.init``), each call's
  ``time.thread_time_ns`` of its own thread, less the wrapped calls it made: exclusive CPU per
  (role, phase), and the wall time beside it (a phase that waits shows wall, not CPU). Nothing of
  the engine changes: the wrappers call the originals.

``report(states, batch, rounds, run, phases)``: ``measure`` (warm-up steps, then per round and
configuration ``run`` steps, the clocks read around the steps after the first, as
``overlap.timed_run`` times them), ``table`` (the JSON rows), ``render`` (the readable table, to
stderr).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

import zinf_fn as zf
from zinf_fn.io.buffers import BufferPool
from zinf_fn.optim import pieces, strategies
from zinf_fn.optim.gradients import GradientsIn
from zinf_fn.optim.paramcast import ParamCast
from zinf_fn.optim.queue import UpdateQueue
from zinf_fn.optim.readahead import ReadAhead
from zinf_fn.optim.updater import Updater
from zinf_fn.overlap.fetch import Fetcher
from zinf_fn.overlap.prefetch import Prefetcher
from zinf_fn.overlap.stream import WriteBehind
from zinf_fn.state import view

# thread name prefix -> (role, the OS name its OpenMP helpers inherit: at most 15 bytes)
ROLES = (
    ("MainThread", "compute", "z-compute"),
    ("zinf-fetch", "fetch", "z-fetch"),
    ("zinf-issue", "read issue", "z-issue"),
    ("zinf-update", "update", "z-update"),
)
IO_ROLES = (("-read", "disk reads"), ("-write", "disk writes"))


def role_of(name: str) -> str:
    """The role of a Python thread named ``name``."""
    for prefix, role, _ in ROLES:
        if name.startswith(prefix):
            return role
    if name.startswith("zinf-nvme"):
        return next((role for part, role in IO_ROLES if part in name), "disk")
    return "other"


def _tag_os_name(role: str) -> None:
    """Name the calling OS thread after its role, so the OpenMP helpers it starts inherit it."""
    tag = next((t for _, r, t in ROLES if r == role), None)
    if tag is not None:
        libc = ctypes.CDLL(None)
        libc.prctl(15, tag.encode(), 0, 0, 0)  # PR_SET_NAME


# per thread, summed per role: CPU ns, its user and kernel ns, voluntary and involuntary switches
FIELDS = ("cpu", "user", "sys", "voluntary", "involuntary")
_NS_PER_TICK = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


class ThreadClocks:
    """``FIELDS`` per role, over every thread of the process (see the module docstring)."""

    def read(self) -> dict[tuple[str, str], int]:
        """{(role, field): the sum over the role's threads}; the user and kernel nanoseconds come in
        the kernel's ticks (10 ms), so read them over many steps."""
        names = {t.native_id: t.name for t in threading.enumerate()}
        out: dict[tuple[str, str], int] = defaultdict(int)
        for task in Path("/proc/self/task").iterdir():
            try:
                values = _task_values(task)
                comm = (task / "comm").read_text().strip()
            except (OSError, ValueError, IndexError):
                continue  # the thread ended
            tid = int(task.name)
            role = role_of(names[tid]) if tid in names else _helper_role(comm)
            for field, value in zip(FIELDS, values, strict=True):
                out[role, field] += value
        return out


def _task_values(task: Path) -> tuple[int, ...]:
    """``FIELDS`` of the thread ``/proc/self/task/<tid>``."""
    cpu = int((task / "schedstat").read_text().split()[0])
    stat = (task / "stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after the name, which may hold spaces
    user, kernel = int(fields[11]) * _NS_PER_TICK, int(fields[12]) * _NS_PER_TICK
    status = dict(
        line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line
    )
    switches = int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"])
    return cpu, user, kernel, *switches


def _helper_role(comm: str) -> str:
    for _, role, tag in ROLES:
        if comm == tag:
            return f"{role} (omp helpers)"
    return "other (omp helpers)"


class Phases:
    """Exclusive thread CPU and wall nanoseconds per (role, phase) of the wrapped functions."""

    def __init__(self):
        self.cpu: dict[tuple[str, str], int] = defaultdict(int)
        self.wall: dict[tuple[str, str], int] = defaultdict(int)
        self._local = threading.local()
        self._lock = threading.Lock()

    def wrap(self, owner, attr: str, phase: str) -> None:
        """Replace ``owner.attr`` (a module function or a class's method) by a timed call of it."""
        original = getattr(owner, attr)
        phases = self

        def timed(*args, **kwargs):
            frame = phases._enter()
            try:
                return original(*args, **kwargs)
            finally:
                phases._exit(phase, frame)

        setattr(owner, attr, timed)

    def _enter(self) -> list:
        local = self._local
        if not hasattr(local, "stack"):
            local.stack, local.role = [], role_of(threading.current_thread().name)
            _tag_os_name(local.role)
        frame = [time.thread_time_ns(), time.perf_counter_ns(), 0, 0]
        local.stack.append(frame)
        return frame

    def _exit(self, phase: str, frame: list) -> None:
        local = self._local
        cpu, wall = time.thread_time_ns() - frame[0], time.perf_counter_ns() - frame[1]
        local.stack.pop()
        if local.stack:
            local.stack[-1][2] += cpu
            local.stack[-1][3] += wall
        with self._lock:
            self.cpu[local.role, phase] += cpu - frame[2]
            self.wall[local.role, phase] += wall - frame[3]

    def read(self) -> tuple[dict, dict]:
        with self._lock:
            return dict(self.cpu), dict(self.wall)


def install() -> Phases:
    """Wrap the engine's phases (call before ``zf.init``: the runtime's parts bind no method early,
    and the OpenMP helpers of the calling thread, the compute thread, start after it is named)."""
    _tag_os_name("compute")
    phases = Phases()
    for owner, attr, phase in (
        (Updater, "update_", "update (rest)"),
        (Updater, "update_run_", "update (rest)"),
        (GradientsIn, "landed", "gradient norm (landed)"),
        (GradientsIn, "norm_of_leaves", "gradient norm (leaves)"),
        (ReadAhead, "take_master", "read-ahead: take master (wait)"),
        (ReadAhead, "take_piece", "read-ahead: take piece (wait)"),
        (ReadAhead, "room", "read-ahead: room"),
        (strategies, "update_piece_", "piece: grad spans, gather, scalars"),
        (pieces, "adamw_piece_", "kernel: compressed adamw"),
        (strategies, "piece_master", "remainder join"),
        (strategies, "stored_", "remainder split"),
        (ParamCast, "writes", "16-bit copy: cast"),
        (ParamCast, "writes16", "16-bit copy: put"),
        (WriteBehind, "put", "write-behind: issue, wait for room"),
        (WriteBehind, "press", "write-behind: issue, wait for room"),
        (BufferPool, "take", "pool take/give"),
        (BufferPool, "give", "pool take/give"),
        (Fetcher, "fetch", "fetch"),
        (Fetcher, "start", "fetch: issue reads"),
        (Prefetcher, "get", "wait for a fetch"),
        (GradientsIn, "scatter", "gradient scatter"),
        (UpdateQueue, "submit", "update: queue (backpressure)"),
    ):
        phases.wrap(owner, attr, phase)
    # the fp32 moments' kernel: a torch function, looked up at each call
    phases.wrap(torch, "_fused_adamw_", "kernel: torch fused adamw")
    return phases


def measure(states: dict, batch, rounds: int, run: int, phases: Phases) -> tuple[dict, dict, dict]:
    """A warm-up step of each configuration, then ``rounds`` rounds of ``run`` steps of each on the
    same batches (``batch(generator)``): (step seconds per round, thread CPU ns per role, (phase
    CPU, phase wall) ns), per configuration, summed over the steps after a round's first (the first
    brings the write-behind into its steady state, as ``overlap.timed_run``'s)."""
    gen, clocks = torch.Generator().manual_seed(0), ThreadClocks()
    times = {name: [] for name in states}
    threads = {name: defaultdict(int) for name in states}
    phase_cpu = {name: defaultdict(int) for name in states}
    phase_wall = {name: defaultdict(int) for name in states}
    for name in states:
        states[name], _ = zf.train_step(states[name], batch(gen))
        view(states[name]).flush()
    for _ in range(rounds):
        data = [batch(gen) for _ in range(run)]
        for name in states:
            states[name], _ = zf.train_step(states[name], data[0])
            before, (cpu0, wall0) = clocks.read(), phases.read()
            t0 = time.perf_counter()
            for step in data[1:]:
                states[name], _ = zf.train_step(states[name], step)
            times[name].append((time.perf_counter() - t0) / (run - 1))
            after, (cpu1, wall1) = clocks.read(), phases.read()
            view(states[name]).flush()
            _add(threads[name], after, before)
            _add(phase_cpu[name], cpu1, cpu0)
            _add(phase_wall[name], wall1, wall0)
    return times, threads, {n: (phase_cpu[n], phase_wall[n]) for n in states}


def report(states: dict, batch, rounds: int, run: int, phases: Phases) -> dict:
    """``measure`` the configurations ``states``, print the readable table to stderr; the JSON's
    rows."""
    times, threads, phase_ns = measure(states, batch, rounds, run, phases)
    rows = table(times, threads, phase_ns, rounds * (run - 1))
    print(render(rows), file=sys.stderr, flush=True)
    return rows


def _add(total: dict, after: dict, before: dict) -> None:
    for k, v in after.items():
        total[k] += v - before.get(k, 0)


def table(times: dict, threads: dict, phases: dict, steps: int) -> dict:
    """The JSON of the table: per configuration, CPU seconds a step per role ("threads"; and
    "kernel": its user and kernel seconds and context switches a step) and per phase ("role:
    phase", with the phase's wall seconds), the step's seconds."""
    out = {}
    for name in times:
        cpu, wall = phases[name]
        per_role = _per_role(threads[name], steps)
        out[name] = {
            "step_s": round(sum(times[name]) / len(times[name]), 4),
            "cpu_s": round(sum(r["cpu"] for r in per_role.values()), 4),
            "threads": {role: r.pop("cpu") for role, r in per_role.items()},
            "kernel": per_role,
            "phases": {
                f"{r}: {p}": {
                    "cpu": round(ns / steps / 1e9, 4),
                    "wall": round(wall[r, p] / steps / 1e9, 4),
                }
                for (r, p), ns in sorted(cpu.items())
            },
        }
    return out


def _per_role(threads: dict, steps: int) -> dict:
    """``ThreadClocks`` sums (ns, switches) as {role: {field: a step's seconds or switches}}."""
    roles = sorted({role for role, _ in threads})
    scale = {"cpu": 1e9, "user": 1e9, "sys": 1e9, "voluntary": 1, "involuntary": 1}
    return {
        role: {f: round(threads.get((role, f), 0) / steps / scale[f], 4) for f in FIELDS}
        for role in roles
    }


def render(rows: dict) -> str:
    """The table as text: a row per role and per phase, a column per configuration."""
    names = list(rows)
    head = f"{'CPU s / step':42s}" + "".join(f"{n:>24s}" for n in names)
    lines = [head, f"{'step (wall)':42s}" + "".join(f"{rows[n]['step_s']:24.4f}" for n in names)]
    lines.append(f"{'all threads':42s}" + "".join(f"{rows[n]['cpu_s']:24.4f}" for n in names))
    roles = sorted({r for n in names for r in rows[n]["threads"]})
    for role in roles:
        cells = "".join(f"{rows[n]['threads'].get(role, 0.0):24.4f}" for n in names)
        lines.append(f"  {role:40s}" + cells)
    lines.extend(_kernel_lines(rows, names, roles))
    lines.append(f"{'phases, exclusive (cpu / wall)':42s}")
    phases = sorted({p for n in names for p in rows[n]["phases"]})
    for phase in phases:
        cells = ""
        for n in names:
            got = rows[n]["phases"].get(phase, {"cpu": 0.0, "wall": 0.0})
            cells += f"{got['cpu']:15.4f} / {got['wall']:6.4f}"
        lines.append(f"  {phase:40s}" + cells)
    return "\n".join(lines)


def _kernel_lines(rows: dict, names: list, roles: list) -> list[str]:
    """Per role: user / kernel CPU seconds and voluntary / involuntary context switches a step."""
    empty = dict.fromkeys(FIELDS[1:], 0.0)
    lines = [f"{'user / kernel s, switches vol / invol':42s}"]
    for role in roles:
        cells = ""
        for n in names:
            got = rows[n]["kernel"].get(role, empty)
            cells += f"{got['user']:7.3f}/{got['sys']:5.3f} {got['voluntary']:4.0f}/"
            cells += f"{got['involuntary']:<5.0f}"
        lines.append(f"  {role:40s}" + cells)
    return lines
