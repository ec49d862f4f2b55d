"""``python -m zinf_fn.planner``: the planner's table for a GPT or Llama config, from the command
line.

    python -m zinf_fn.planner --family gpt --d-model 512 --layers 4 --vocab 1024 --seq 64 --batch 4
    \\
        --params none --optimizer auto --host-budget 2GiB --nvme-path /mnt/nvme/run

prints the estimate of one placement (tiers x state kinds, working memory, peaks, and the predicted
seconds per phase), or with ``--auto`` every placement auto_config weighs and the one it chooses;
with ``--auto --weigh-tiles mlp,head`` the tile counts too (``--mlp-tiles`` etc. fix them
otherwise):

    python -m zinf_fn.planner --family llama --d-model 2048 --layers 4 --heads 16 --auto \
        --weigh-tiles mlp,head --tile-counts 1,2,4,8 --host-budget 4.6GiB

A mixture of experts (``--family qwen3_moe``, ``mixtral``, ``olmoe``: the family's config.json
read by ``layers``) streams its experts, one fetch unit each (``--whole-experts``: the block's
experts fetched with it), and the table says how many expert units there are, how many are in flight
and the share of them a step is expected to read (``planner.experts``):

    python -m zinf_fn.planner --family qwen3_moe --d-model 2048 --layers 48 --heads 32 \
        --kv-heads 4 --head-dim 128 --experts 128 --top-k 8 --expert-width 768 --vocab 151936 \
        --seq 256 --batch 1 --params nvme --optimizer nvme --nvme-path /mnt/nvme/run

An entry point, not the engine: it alone imports ``layers`` (the import-linter contract names it).
"""

from __future__ import annotations

import argparse
import inspect
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


MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe")
# what each family tiles (a mixture of experts: its head; its experts are tiles of their own)
TILED = {"gpt": ("attn", "mlp", "head"), "llama": ("mlp", "head")} | {
    family: ("head",) for family in MOE_FAMILIES
}


def build_model(args, **tiles: int):
    """The model of the family and sizes on the command line (a layers/ model: this module is an
    entry point); ``tiles``: counts by name (``mlp_tiles=4``) over the command line's
    ``--mlp-tiles`` etc."""
    tiles = {
        **{f"{name}_tiles": getattr(args, f"{name}_tiles") for name in TILED[args.family]},
        **tiles,
    }
    if args.family in MOE_FAMILIES:
        return moe_model(args, **tiles)
    if args.family == "gpt":
        from layers import gpt

        return gpt.model(
            gpt.Config(
                vocab_size=args.vocab,
                d_model=args.d_model,
                n_heads=args.heads,
                n_layers=args.layers,
                seq_len=args.seq,
                **tiles,
            )
        )
    from layers import llama

    return llama.model(
        llama.Config(
            vocab_size=args.vocab,
            d_model=args.d_model,
            n_heads=args.heads,
            n_layers=args.layers,
            seq_len=args.seq,
            d_ff=args.d_ff or 4 * args.d_model,
            **tiles,
        )
    )


def moe_config_json(args) -> dict:
    """The transformers config.json dict of ``args``'s mixture of experts (``--family`` one of
    ``MOE_FAMILIES``): its sizes, and its MoE fields as ``layers.moe_config`` writes them."""
    from layers import moe, moe_config

    block = moe.Config(
        n_experts=args.experts,
        top_k=args.top_k,
        d_model=args.d_model,
        d_ff=args.expert_width or args.d_ff or args.d_model,
        norm_topk_prob=True,
    )
    aux = moe_config.AuxConfig(False, 0.001)
    return {
        "model_type": args.family,
        "vocab_size": args.vocab,
        "hidden_size": args.d_model,
        "intermediate_size": args.d_ff or 4 * args.d_model,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads or args.heads,
        "head_dim": args.head_dim or args.d_model // args.heads,
        **moe_config.block_fields(block, args.family, aux),
    }


def moe_model(args, **tiles: int):
    """The mixture of experts of ``args`` (``moe_config_json`` read by ``layers.llama``), its
    experts streamed unless ``--whole-experts``."""
    import dataclasses

    from layers import llama

    cfg = llama.Config.from_hf(moe_config_json(args), seq_len=args.seq, **tiles)
    stream = dataclasses.replace(cfg.moe, stream_experts=not args.whole_experts)
    return llama.model(dataclasses.replace(cfg, moe=stream))


def tile_factory(args):
    """``--weigh-tiles mlp,head``: a factory of those counts (``auto_config`` chooses them), else
    None."""
    if not args.weigh_tiles:
        return None
    names = [n.strip() for n in args.weigh_tiles.split(",") if n.strip()]
    wrong = [n for n in names if n not in TILED[args.family]]
    if wrong or not names:
        raise SystemExit(
            f"--weigh-tiles: {args.family} models tile {', '.join(TILED[args.family])}; "
            f"got {args.weigh_tiles!r}"
        )

    def factory(**tiles: int):
        return build_model(args, **tiles)

    # auto_config weighs the counts a factory names as parameters: these
    factory.__signature__ = inspect.Signature(
        [inspect.Parameter(f"{n}_tiles", inspect.Parameter.KEYWORD_ONLY) for n in names]
    )
    return factory


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zinf_fn.planner", description=__doc__.split("\n")[0]
    )
    p.add_argument("--family", choices=("gpt", "llama", *MOE_FAMILIES), default="gpt")
    for flag, default in (
        ("--d-model", 512),
        ("--layers", 4),
        ("--heads", 8),
        ("--vocab", 1024),
        ("--seq", 64),
        ("--batch", 4),
        ("--d-ff", 0),
        ("--attn-tiles", 1),
        ("--mlp-tiles", 1),
        ("--head-tiles", 1),
        ("--kv-heads", 0),
        ("--head-dim", 0),
        ("--experts", 8),
        ("--top-k", 2),
        ("--expert-width", 0),
    ):
        p.add_argument(flag, type=int, default=default)
    p.add_argument(
        "--whole-experts",
        action="store_true",
        help="a mixture of experts: fetch a block's experts with it, not one by one",
    )
    p.add_argument("--params", default="none", help="offload_params: none, cpu, nvme or auto")
    p.add_argument("--optimizer", default="none", help="offload_optimizer: none, cpu, nvme or auto")
    p.add_argument("--spill-params", default=None, help="spill_params, e.g. 3:nvme")
    p.add_argument("--spill-optimizer", default=None, help="spill_optimizer, e.g. 3:nvme")
    p.add_argument("--host-budget", type=parse_bytes, default=None)
    p.add_argument("--device-budget", type=parse_bytes, default=None)
    p.add_argument(
        "--nvme-path", default=None, help="calibrated here (cached); needed by nvme placements"
    )
    p.add_argument(
        "--auto", action="store_true", help="weigh every placement, as zf.auto_config does"
    )
    p.add_argument(
        "--weigh-tiles",
        default=None,
        help="with --auto: choose these tile counts too, e.g. mlp,head",
    )
    p.add_argument(
        "--tile-counts", default="1,2,4,8,16,32,64", help="the counts --weigh-tiles weighs"
    )
    return p


def placements(args) -> Config:
    """The ``Config`` of the command line's placements, spills and budgets (``parser``'s
    options)."""
    return Config(
        offload_params=args.params,
        offload_optimizer=args.optimizer,
        nvme_path=args.nvme_path,
        spill_params=args.spill_params,
        spill_optimizer=args.spill_optimizer,
        host_memory_budget=args.host_budget,
        device_memory_budget=args.device_budget,
    )


def top_k(args) -> int | None:
    """The experts each token is routed to, for a mixture of experts; else None."""
    return args.top_k if args.family in MOE_FAMILIES else None


def main(argv=None) -> None:
    """Parse the command line and print the plan (``run``)."""
    run(parser().parse_args(argv))


def run(args) -> None:
    """Print the plan of ``args``: a namespace of ``parser``'s options, or of a parser built on
    it (``zinf-fn plan``)."""
    model = build_model(args)
    tokens = torch.zeros(args.batch, args.seq + 1, dtype=torch.long)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    machine = (
        calibrate(args.nvme_path) if args.nvme_path else Machine(0.0, 0.0, *calibrate(None)[2:])
    )
    if args.auto:
        counts = tuple(int(c) for c in args.tile_counts.split(","))
        auto_config(
            tile_factory(args) or model,
            adamw(),
            args.nvme_path,
            args.host_budget,
            args.device_budget,
            batch,
            machine=machine,
            tile_counts=counts,
            top_k=top_k(args),
        )
        return
    planned = plan_config(model, adamw(), placements(args), batch, top_k=top_k(args))
    print(planned.estimate.table())
    print("predicted: " + predict(planned.estimate, planned.work, machine).row())


if __name__ == "__main__":
    main()
