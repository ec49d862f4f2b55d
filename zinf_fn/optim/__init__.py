"""Optax-style optimizers over flat fp32 shards, and the streamed updater."""

from .optimizers import DecaySpans, Optimizer, adamw, clip_coefficient, learning_rate, sgd
from .updater import Updater

__all__ = [
    "DecaySpans",
    "Optimizer",
    "Updater",
    "adamw",
    "clip_coefficient",
    "learning_rate",
    "sgd",
]
