"""Overlap-centric design: the fetch plan (data), the fetcher and prefetcher, the windowed stream
primitives."""

from .fetch import Fetcher, Layer
from .plan import FetchOp, eval_plan, format_plan, step_plan, train_plan
from .prefetch import Prefetcher
from .stream import InFlight, WriteBehind
from .window import Window

__all__ = [
    "FetchOp",
    "Fetcher",
    "InFlight",
    "Layer",
    "Prefetcher",
    "Window",
    "WriteBehind",
    "eval_plan",
    "format_plan",
    "step_plan",
    "train_plan",
]
