"""A side thread for ``tiling.two_at_once`` whose jobs have always started when the compute thread
goes on: a test patches it in (``two_at_once.side_thread``) so that the side's share of a product
is computed there, deterministically, whatever the machine's load."""

from __future__ import annotations

import concurrent.futures
import threading
import time


class StartedSide(concurrent.futures.ThreadPoolExecutor):
    """A side thread whose every job has started (then sleeps a little) before ``submit`` returns:
    the compute thread then fetches and computes the next job while the side holds its own. The
    names of the threads that ran its jobs go to ``ran``."""

    def __init__(self, ran: list):
        super().__init__(1, thread_name_prefix="zinf-side-test")
        self.ran = ran

    def submit(self, fn, *args):
        started = threading.Event()

        def run():
            started.set()
            time.sleep(0.005)
            self.ran.append(threading.current_thread().name)
            return fn(*args)

        future = super().submit(run)
        started.wait()
        return future
