"""Futures of I/O: one "already done" future, a failed one, and the future of a transfer split in
pieces.

Every tier read or write returns a ``concurrent.futures.Future``: ``result()`` waits and raises the
transfer's error as an ``OSError`` naming what was moved. ``done(value)`` is the future of an
operation that already finished (a copy in memory), ``failed(error)`` of one that failed before it
started, and ``Joined`` completes once every piece of a split transfer ran.
"""

from __future__ import annotations

import errno
import re
import threading
from concurrent.futures import Future


class Joined:
    """The future of a transfer split into ``n`` pieces run on I/O threads (``run(piece)`` each):
    ``finish(first error or None)`` runs once, last; the future fails with the first error (wrapped
    in an OSError naming ``describe()``, when given), or with ``finish``'s."""

    def __init__(self, n: int, finish, describe=None):
        self.future: Future = Future()
        self._remaining, self._errors = n, []
        self._finish, self._describe = finish, describe
        self._lock = threading.Lock()

    def run(self, piece) -> None:
        try:
            piece()
        except BaseException as e:  # recorded, re-raised through the future
            self._errors.append(e)
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        error = self._errors[0] if self._errors else None
        try:
            self._finish(error)
        except BaseException as e:
            error = error or e
        if error is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(
                error if self._describe is None else wrap(error, self._describe())
            )


def error_code(error: BaseException) -> int:
    """The OS error code of an OSError, or of a tensorstore error (which carries it in its
    message)."""
    code = getattr(error, "errno", None)
    if code:
        return code
    found = re.search(r"os_error_code='(\d+)'", str(error))
    return int(found.group(1)) if found else errno.EIO


def wrap(error: BaseException, what: str) -> OSError:
    return OSError(error_code(error), f"{what} failed: {error}")


def done(value=None) -> Future:
    """The future of an operation that already finished with ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f


def joined(futures: list[Future]) -> Future:
    """One future for ``futures``: done once every one is, failing with the first error (none: done
    now)."""
    out: Future = Future()
    state = {"remaining": len(futures), "error": None}
    lock = threading.Lock()

    def settle(f: Future):  # references none of ``futures``: no cycle through their callbacks
        with lock:
            state["error"] = state["error"] or f.exception()
            state["remaining"] -= 1
            if state["remaining"]:
                return
        if state["error"] is not None:
            out.set_exception(state["error"])
        else:
            out.set_result(None)

    if not futures:
        out.set_result(None)
    for f in futures:
        f.add_done_callback(settle)
    return out


def settle(out: Future, source, describe=None) -> None:
    """Complete ``out`` as ``source`` (a finished future: ``concurrent.futures``' or tensorstore's)
    completed: with None, or with its error (wrapped in an OSError naming ``describe()``, where
    given)."""
    try:
        source.result()
    except Exception as e:  # the transfer's error, handed on through ``out``
        out.set_exception(e if describe is None else wrap(e, describe()))
    else:
        out.set_result(None)


def failed(error: BaseException) -> Future:
    """The future of an operation that failed with ``error`` before it started."""
    f: Future = Future()
    f.set_exception(error)
    return f
