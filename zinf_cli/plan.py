"""``zinf-fn plan``: the planner's table before a run (``python -m zinf_fn.planner`` is the same).

    zinf-fn plan --family llama --d-model 2048 --layers 16 --host-budget 8GiB
    zinf-fn plan --hf-dir ~/models/Llama-3.2-1B --seq 1024 --batch 8 --params cpu \\
        --optimizer nvme --nvme-path /mnt/nvme/run   # a Hugging Face directory's model (no weights)
    zinf-fn plan --hf-dir DIR --host-budget 8GiB --auto   # every placement weighed, one chosen

By family and sizes it is the planner's own command line (tiers x state kinds, working memory,
peaks, the predicted seconds per phase). With ``--hf-dir`` the model is the directory's
``config.json`` (``--lora-rank`` adds adapters, and freezes the base) and it prints
``zf.estimate``'s table, or with ``--auto`` what ``zf.auto_config`` weighs and chooses.
"""

from __future__ import annotations

import dataclasses

import torch

import zinf_fn as zf
from checkpoints.hf import FAMILIES, model_config
from checkpoints.hf_files import read_config
from layers import lora
from zinf_fn.planner.__main__ import parser as planner_parser
from zinf_fn.planner.__main__ import placements
from zinf_fn.planner.__main__ import run as planner_run


def parser():
    """The planner's parser with ``--hf-dir`` and ``--lora-rank``."""
    p = planner_parser()
    p.prog, p.description = "zinf-fn plan", __doc__.split("\n")[0]
    p.add_argument("--hf-dir", help="plan the model of this Hugging Face directory's config.json")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="with --hf-dir: LoRA adapters of this rank on the family's targets, the base frozen",
    )
    return p


def hf_model(args):
    """The ``layers`` model of ``args.hf_dir``'s config.json at ``--seq`` tokens, tiles as given,
    and the experts each token is routed to (a mixture of experts, its experts streamed unless
    ``--whole-experts``, as by family; else None)."""
    overrides = {
        "token_loss": True,
        "seq_len": args.seq,
        "mlp_tiles": args.mlp_tiles,
        "head_tiles": args.head_tiles,
    }
    hf_config = read_config(args.hf_dir)
    cfg = model_config(hf_config, args.hf_dir, overrides)
    top_k = None
    if getattr(cfg, "moe", None) is not None:
        top_k = cfg.moe.top_k
        block = dataclasses.replace(cfg.moe, stream_experts=not args.whole_experts)
        cfg = dataclasses.replace(cfg, moe=block)
    model = FAMILIES[hf_config["model_type"]].model(cfg)
    return (lora.apply(model, rank=args.lora_rank) if args.lora_rank else model), top_k


def main(argv=None) -> int:
    """Print the plan; by family, the planner's command line does it."""
    p = parser()
    args = p.parse_args(argv)
    if args.lora_rank and not args.hf_dir:
        p.error(f"--lora-rank {args.lora_rank}: LoRA adapters are planned on an --hf-dir's model")
    if not args.hf_dir:
        planner_run(args)
        return 0
    model, top_k = hf_model(args)
    tokens = torch.zeros(args.batch, args.seq + 1, dtype=torch.long)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if args.auto:
        zf.auto_config(
            model,
            zf.adamw(),
            args.nvme_path,
            args.host_budget,
            args.device_budget,
            batch,
            top_k=top_k,
        )
        return 0
    print(zf.estimate(model, zf.adamw(), placements(args), batch, top_k=top_k).table())
    return 0
