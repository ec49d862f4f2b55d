"""zinf_cli: the ``zinf-fn`` command (finetune, train, plan, convert, inspect) over the engine,
``layers``, ``checkpoints`` and ``zinf_data``; none of them imports it."""

from .main import main

__all__ = ["main"]
