"""The ``--moe`` run's disk timed alone, for its roofline: the last step's own reads replayed.

A probe of a fresh file (``zinf_fn.planner.machine.disk_bandwidth``: 128 MiB written, then read
back at once) times what the disk's caches hold: this project's VM took the probe's writes at
3.7-4.1 GB/s and read them back at 1.9-2.4 GB/s, a cache below it, where the 30B step's own reads
(rows written minutes before, a few GB a step) replayed at 1.30-1.31 GB/s: the probe timed the
step's bytes at 0.6-0.8 of their time. ``disk_reads`` records the reads a step issues (file,
offset, bytes: ``io.direct_files.DirectFiles.read``, the NVMe tier's file layer), and
``disk_seconds`` reads the same spans again, in the order the step issued them, through the same
file layer with nothing else running, into buffers made before its clock starts (the step's own are
its pool's, made at init): the disk alone for exactly the step's bytes. Replayed just after the
step, whatever cache held them for the step holds them still, and the best of ``REPLAYS`` replays
is taken: a bound from below of the disk's time for them.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from zinf_fn.io import odirect
from zinf_fn.io.buffers import aligned_empty
from zinf_fn.io.direct_files import DirectFiles
from zinf_fn.offload.nvme import IO_THREADS

# reads in flight at once while replaying: the tile window's most (``overlap.tile_runs``)
IN_FLIGHT = 32
# replays of a step's reads timed (the run takes the best: the disk's time, never more)
REPLAYS = 2


@contextlib.contextmanager
def disk_reads(spans: list[tuple[str, int, int, int]]):
    """While open, each read the NVMe tier's file layer issues appended to ``spans`` as (path, the
    file's bytes, offset, bytes read): what ``disk_seconds`` replays."""
    read = DirectFiles.read

    def recorded(self, path, nbytes, out, describe, label, offset=0):
        spans.append((path, nbytes, offset, out.numel() * out.element_size()))
        return read(self, path, nbytes, out, describe, label, offset)

    DirectFiles.read = recorded
    try:
        yield spans
    finally:
        DirectFiles.read = read


def disk_seconds(spans: list[tuple[str, int, int, int]], in_flight: int = IN_FLIGHT) -> float:
    """Seconds to read ``spans`` (``disk_reads``) again, in order, ``in_flight`` at once, through
    a file layer of the NVMe tier's read threads (O_DIRECT where the file system takes it), into
    buffers reused round robin (``_slot``), made and written before the clock starts; 0 where
    there is nothing to read."""
    if not spans:
        return 0.0
    direct = odirect.write_alignment(os.path.dirname(spans[0][0])) is not None
    files = DirectFiles(IO_THREADS, "zinf-replay", direct)
    buffers = {
        slot: aligned_empty(slot[0], torch.uint8).zero_()  # zero_: its pages resident
        for slot in {_slot(k, size, in_flight) for k, (*_, size) in enumerate(spans)}
    }
    pending = []
    try:
        t0 = time.perf_counter()
        for k, (path, nbytes, offset, size) in enumerate(spans):
            slot = _slot(k, size, in_flight)
            pending.append(
                files.read(
                    path, nbytes, buffers[slot], lambda p=path: p, ("read", "replay"), offset
                )
            )
            if len(pending) >= in_flight:
                pending.pop(0).result()  # sync: a slot is free again
        for future in pending:
            future.result()  # sync: every read is done
        return time.perf_counter() - t0
    finally:
        files.close()


def _slot(k: int, size: int, in_flight: int) -> tuple[int, int]:
    """The buffer read k of ``size`` bytes replays into: one of ``in_flight + 1`` of its size, in
    turn, so that a buffer is read into again only once the read before it in it is done."""
    return size, k % (in_flight + 1)


def replayed_bytes(spans: list[tuple[str, int, int, int]]) -> int:
    return sum(size for *_, size in spans)
