"""Overlap-centric design: the fetch plan (data), the fetcher and prefetcher, the windowed stream primitives."""

from .fetch import Fetcher, Layer, Prefetcher
from .plan import FetchOp, eval_plan, format_plan, train_plan
from .stream import WriteBehind

__all__ = ["FetchOp", "Fetcher", "Layer", "Prefetcher", "WriteBehind", "eval_plan", "format_plan", "train_plan"]
