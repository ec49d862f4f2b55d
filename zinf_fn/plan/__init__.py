"""The planner: looking at a state (its placements and fetch plan, its full trees), and predicting a
config's memory and step time before anything is allocated (``estimate``, ``calibrate``, ``auto_config``)."""

from .inspect import gather_params, gather_row, placements, plan

__all__ = ["gather_params", "gather_row", "placements", "plan"]
