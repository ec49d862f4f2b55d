"""``python -m checkpoints <command>``: the package's command lines.

    python -m checkpoints hf import HF_DIR CKPT_DIR [...]            # checkpoints/hf_cli.py
    python -m checkpoints hf export CKPT_DIR OUT_DIR [...]
    python -m checkpoints export CKPT OUT.safetensors [--dtype ...]  # checkpoints/export.py

Why a package entry point: ``checkpoints/__init__`` imports ``checkpoints.hf`` and
``checkpoints.export``, so ``python -m checkpoints.hf`` makes runpy execute a module that is already
imported, and it warns so (``RuntimeWarning: 'checkpoints.hf' found in sys.modules``). Those two
commands still run, with the warning.
"""

from __future__ import annotations

import sys

from .export import main as export_main
from .hf_cli import main as hf_main

COMMANDS = {"hf": hf_main, "export": export_main}


def main(argv: list[str] | None = None) -> int:
    """Run ``COMMANDS[argv[0]]`` on the rest of ``argv`` (default ``sys.argv[1:]``); 2 for an
    unknown command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        got = repr(argv[0]) if argv else "nothing"
        print(
            f"usage: python -m checkpoints {{{','.join(COMMANDS)}}} ...: expected a command, got "
            f"{got}\n"
            f"{__doc__}",
            file=sys.stderr,
        )
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
