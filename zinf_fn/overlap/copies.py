"""Copies between host and device that overlap compute on CUDA.

Each user (the fetcher's host-to-device copies, the updater's gradient and 16-bit-copy transfers)
has its own side stream. A copy is ordered after the compute stream by an *event* (the work queued
when the event was recorded: the kernels that produced the source, or that still read the
destination), never by waiting for the whole stream, so the copy engine runs while the next layer
computes. The caller waits for the event a copy returns before it reuses either buffer. On CPU there
are no streams: every copy is a plain ``copy_`` and every event None.

    plain loop this equals:   dst.copy_(src)   (then the buffers are free)
"""

from __future__ import annotations

import torch


class SideCopies:
    """Copies on one side stream of ``device`` (a no-op wrapper around ``copy_`` on CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._device = device
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    def after_compute(self) -> torch.cuda.Event | None:
        """An event marking the work the calling thread's current stream of the device has queued so
        far (None on CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def copy_(
        self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None = None
    ) -> torch.cuda.Event | None:
        """``dst <- src`` (casting), on the side stream once ``after`` completed; returns the event
        of the copy's completion (None: already done). Both buffers must stay untouched until that
        event completed."""
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)  # sync (device side): only the work ``after`` marks
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done


def wait(event: torch.cuda.Event | None) -> None:
    """Block until ``event`` (a ``SideCopies.copy_`` result) completed; None is already done."""
    if event is not None:
        event.synchronize()  # sync: the copy completed; its buffers may be reused
