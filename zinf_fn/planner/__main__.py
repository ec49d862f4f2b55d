"""``python -m zinf_fn.planner``: the planner's table for a GPT or Llama config, from the command line.

    python -m zinf_fn.planner --family gpt --d-model 512 --layers 4 --vocab 1024 --seq 64 --batch 4 \\
        --params none --optimizer auto --host-budget 2GiB --nvme-path /mnt/nvme/run

prints the estimate of one placement (tiers x state kinds, working memory, peaks, and the predicted
seconds per phase), or with ``--auto`` every placement auto_config weighs and the one it chooses. An
entry point, not the engine: it alone imports ``layers`` (the import-linter contract names it).
"""

from __future__ import annotations

import argparse
import re

import torch

from ..config import Config
from ..optim.optimizers import adamw
from .auto import auto_config
from .machine import Machine, calibrate
from .sizes import plan_config
from .timing import predict

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str | None) -> int | None:
    """ "20GiB", "512M", "1000" -> bytes; None stays None."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size like 20GiB or 512M, got {text!r}")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def build_model(args):
    """The model of the family and sizes on the command line (a layers/ model: this module is an entry point)."""
    if args.family == "gpt":
        from layers import gpt

        return gpt.model(gpt.Config(vocab_size=args.vocab, d_model=args.d_model, n_heads=args.heads,
                                    n_layers=args.layers, seq_len=args.seq))
    from layers import llama

    return llama.model(llama.Config(vocab_size=args.vocab, d_model=args.d_model, n_heads=args.heads,
                                    n_layers=args.layers, seq_len=args.seq, d_ff=args.d_ff or 4 * args.d_model))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zinf_fn.planner", description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=("gpt", "llama"), default="gpt")
    for flag, default in (("--d-model", 512), ("--layers", 4), ("--heads", 8), ("--vocab", 1024), ("--seq", 64),
                          ("--batch", 4), ("--d-ff", 0)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--params", default="none", help="offload_params: none, cpu, nvme or auto")
    p.add_argument("--optimizer", default="none", help="offload_optimizer: none, cpu, nvme or auto")
    p.add_argument("--spill-params", default=None, help="spill_params, e.g. 3:nvme")
    p.add_argument("--spill-optimizer", default=None, help="spill_optimizer, e.g. 3:nvme")
    p.add_argument("--host-budget", type=parse_bytes, default=None)
    p.add_argument("--device-budget", type=parse_bytes, default=None)
    p.add_argument("--nvme-path", default=None, help="calibrated here (cached); needed by nvme placements")
    p.add_argument("--auto", action="store_true", help="weigh every placement, as zf.auto_config does")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    model = build_model(args)
    tokens = torch.zeros(args.batch, args.seq + 1, dtype=torch.long)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    machine = calibrate(args.nvme_path) if args.nvme_path else Machine(0.0, 0.0, *calibrate(None)[2:])
    if args.auto:
        auto_config(model, adamw(), args.nvme_path, args.host_budget, args.device_budget, batch, machine=machine)
        return
    config = Config(offload_params=args.params, offload_optimizer=args.optimizer, nvme_path=args.nvme_path,
                    spill_params=args.spill_params, spill_optimizer=args.spill_optimizer,
                    host_memory_budget=args.host_budget, device_memory_budget=args.device_budget)
    planned = plan_config(model, adamw(), config, batch)
    print(planned.estimate.table())
    print("predicted: " + predict(planned.estimate, planned.work, machine).row())


if __name__ == "__main__":
    main()
