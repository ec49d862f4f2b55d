"""The planner: looking at a state (its placements and fetch plan), and predicting a
config's memory and step time before anything is allocated (``estimate``, ``calibrate``,
``auto_config``)."""

from .auto import TilesChoice, auto_config
from .inspect import placements, plan
from .machine import Machine, calibrate
from .sizes import estimate
from .timing import StepTime, peak_rss, predict

__all__ = [
    "Machine",
    "StepTime",
    "TilesChoice",
    "auto_config",
    "calibrate",
    "estimate",
    "peak_rss",
    "placements",
    "plan",
    "predict",
]
