"""``zinf-fn``: one command for the whole job.

    zinf-fn finetune [--config recipe.yaml] [key=value ...]   fine-tune a Hugging Face model
    zinf-fn train [--config recipe.yaml] [key=value ...]      pretrain a layers model from scratch
    zinf-fn plan [--hf-dir DIR | --family llama ...] [--host-budget 8GiB]   the planner's table
    zinf-fn convert hf import|export ... | export ...         HF / PEFT / safetensors conversion
    zinf-fn inspect CKPT [--json]                             what a checkpoint holds

``zinf-fn SUBCOMMAND --help`` lists a subcommand's options; docs/cli.md describes them all.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {"finetune": "zinf_cli.finetune", "train": "zinf_cli.pretrain",
               "plan": "zinf_cli.plan", "convert": "zinf_cli.convert",
               "inspect": "zinf_cli.inspect_ckpt"}


def main(argv: list[str] | None = None) -> int:
    """Run ``zinf-fn argv`` (default: the command line); the exit status (0; 2: a usage error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] not in SUBCOMMANDS:
        print(f"zinf-fn: expected a subcommand, one of {', '.join(SUBCOMMANDS)}; got {argv[0]!r}\n"
              f"{__doc__}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]])
    try:
        status = module.main(argv[1:])
    except ValueError as e:   # RecipeError, CheckpointError, DataError: their message says the fix
        print(f"zinf-fn {argv[0]}: error: {e}", file=sys.stderr)
        return 1
    return status if isinstance(status, int) else 0
