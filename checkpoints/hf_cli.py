"""``python -m checkpoints hf import|export``: Hugging Face directories to checkpoints and back.

    python -m checkpoints hf import HF_DIR CKPT_DIR [--placement cpu|nvme|none] [--nvme-path DIR]
                                                    [--param-dtype bf16|fp32] [--optimizer
                                                    adamw|sgd]
    python -m checkpoints hf export CKPT_DIR OUT_DIR [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]
                                                     [--hf-config CONFIG_JSON] [--placement ...]
                                                     [--nvme-path DIR]

import = ``from_hf`` then ``checkpoints.save``: a step-0 checkpoint whose optimizer state is fresh
(the optimizer kind fixes how many state arrays it has; ``restore`` takes the real hyper-parameters
later). The HF ``config.json`` is stored in the manifest's ``extra["hf_config"]``, so that the
checkpoint says which model it is.

export = ``checkpoints.restore`` then ``to_hf``: the model comes from ``extra["hf_config"]`` (any
checkpoint of this model saved with that ``extra``, e.g. by examples/finetune_hf.py) or, for a
checkpoint saved without it, from ``--hf-config`` (a config.json file, which also wins over the
stored one); the tiling factors are read from the manifest. A LoRA checkpoint (its blocks hold
``lora_a`` / ``lora_b`` leaves) is restored into ``layers.lora.apply`` of that model (rank and
targets read from the leaves, alpha from ``--lora-alpha`` or the finetune example's record) and
written merged (``to_hf``). Restoring needs room for the whole state in the placement chosen
(default cpu; ``--placement nvme --nvme-path DIR`` for models larger than RAM). Run
in one process (the checkpoint may have been written at any world size).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

import zinf_fn as zf
from layers import lora

from .hf import EXPORT_DTYPES, family_of, from_hf, model_config, to_hf
from .hf_files import read_config, read_json
from .manifest import CheckpointError, frozen_storage, read_manifest
from .restore import restore
from .save import save

PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TILED = {
    ("blocks", "mlp.gate.w"): "mlp_tiles",
    ("blocks", "mlp.fc.w"): "mlp_tiles",  # llama, gpt
    ("blocks", "attn.qkv.w"): "attn_tiles",
    ("head", "lm_head.w"): "head_tiles",
    ("embed", "tok.w"): "embed_tiles",  # llama
}


def engine_config(args) -> zf.Config:
    return zf.Config(
        offload_params=args.placement,
        offload_optimizer=args.placement,
        nvme_path=args.nvme_path,
        param_dtype=PARAM_DTYPES[getattr(args, "param_dtype", "bf16")],
        frozen_storage=getattr(args, "frozen_storage", "bf16"),
    )


def optimizer_named(name: str | None, hyper: dict | None = None):
    """The optimizer whose state arrays a checkpoint of ``name`` has (hyper-parameters do not matter
    here)."""
    if name == "sgd":
        return zf.sgd(momentum=(hyper or {}).get("momentum", 0.9))
    return zf.adamw()


def run_import(args) -> None:
    hf_config = read_config(args.hf_dir)
    _, state = from_hf(args.hf_dir, optimizer_named(args.optimizer), engine_config(args))
    save(args.ckpt_dir, state, overwrite=args.overwrite, extra={"hf_config": hf_config})
    print(
        f"imported {args.hf_dir} ({hf_config['model_type']}) into {args.ckpt_dir}", file=sys.stderr
    )


def export_model_config(
    manifest: dict, ckpt_dir: str, hf_config_path: str | None
) -> tuple[dict, object]:
    """The HF config dict and the llama.Config / gpt.Config (with the checkpoint's tiling) of a
    checkpoint to export."""
    if hf_config_path:
        hf_config = read_json(hf_config_path, "a transformers config.json")
    else:
        hf_config = (manifest.get("extra") or {}).get("hf_config")
        if not isinstance(hf_config, dict):
            raise CheckpointError(
                f"checkpoint {ckpt_dir!r}: its manifest has no extra['hf_config'] (it was not "
                "saved by `python -m checkpoints hf import` or with extra={'hf_config': ...}); "
                "expected --hf-config CONFIG_JSON naming the model"
            )
    tiles = {
        TILED[t["stage"], t["path"]]: len(t["shapes"])
        for t in manifest.get("tiles", {}).values()
        if (t["stage"], t["path"]) in TILED
    }
    return hf_config, model_config(hf_config, os.path.dirname(hf_config_path or ckpt_dir), tiles)


def lora_of_manifest(manifest: dict, ckpt_dir: str, alpha: float | None):
    """The ``layers.lora.apply`` a checkpoint's blocks were trained with (rank and targets from its
    LoRA leaves, alpha from ``--lora-alpha`` or the ``extra["data"]["lora"]``
    examples/finetune_hf.py records), as a transform of the family's model; None for a checkpoint
    without LoRA leaves."""
    leaves = {
        leaf["path"]: leaf["shape"]
        for leaf in manifest["groups"].get("blocks", {}).get("leaves", [])
    }
    targets = tuple(
        sorted(path.removesuffix(".lora_a") for path in leaves if path.endswith(".lora_a"))
    )
    if not targets:
        return None
    alpha = _recorded_alpha(manifest, ckpt_dir) if alpha is None else alpha
    if alpha is None:
        raise CheckpointError(
            f"checkpoint {ckpt_dir!r} holds LoRA adapters of {', '.join(targets)} but no record of "
            "their alpha; pass --lora-alpha ALPHA (the alpha it was trained with)"
        )
    rank = leaves[f"{targets[0]}.lora_a"][0]
    return lambda model: lora.apply(model, rank=rank, alpha=alpha, targets=targets)


def _recorded_alpha(manifest: dict, ckpt_dir: str) -> float | None:
    """The LoRA alpha examples/finetune_hf.py records (``extra["data"]["lora"]``: [rank, alpha,
    targets]); None where nothing is recorded. A record of another shape is a ``CheckpointError``
    naming it."""
    extra = manifest.get("extra")
    data = extra.get("data") if isinstance(extra, dict) else None
    recorded = data.get("lora") if isinstance(data, dict) else None
    if recorded is None:
        return None
    if not (
        isinstance(recorded, list)
        and len(recorded) >= 2
        and isinstance(recorded[1], (int, float))
        and not isinstance(recorded[1], bool)
        and recorded[1] > 0
    ):
        raise CheckpointError(
            f"checkpoint {ckpt_dir!r}: extra.data.lora must be [rank, alpha > 0, targets], got "
            f"{recorded!r}; pass --lora-alpha ALPHA to export anyway"
        )
    return float(recorded[1])


def run_export(args) -> None:
    manifest = read_manifest(args.ckpt_dir)
    hf_config, cfg = export_model_config(manifest, args.ckpt_dir, args.hf_config)
    hyper = manifest.get("optimizer") or {}
    model, transform = (
        family_of(cfg).model(cfg),
        lora_of_manifest(manifest, args.ckpt_dir, args.lora_alpha),
    )
    stored = {"float32": "fp32", "bfloat16": "bf16"}.get(manifest.get("param_dtype"), "bf16")
    # the checkpoint's: a frozen leaf's master is its stored copy (zinf_fn.formats.frozen)
    args.param_dtype = stored
    args.frozen_storage = frozen_storage(
        manifest
    )  # and its frozen base as stored: to_hf writes it dequantized
    state = restore(
        args.ckpt_dir,
        model if transform is None else transform(model),  # LoRA: merged (to_hf)
        optimizer_named(hyper.get("name"), hyper),
        engine_config(args),
    )
    files = to_hf(
        state,
        args.out_dir,
        args.dtype,
        max_shard_size=_size(args.max_shard_size),
        hf_config=hf_config,
    )
    print(
        f"exported step {state.step} of {args.ckpt_dir} to {args.out_dir}: {', '.join(files)}",
        file=sys.stderr,
    )


def _size(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m checkpoints hf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="an HF directory -> a step-0 checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("ckpt_dir")
    imp.add_argument(
        "--param-dtype",
        choices=sorted(PARAM_DTYPES),
        default="bf16",
        help="the stored 16-bit copy (the fp32 master is saved either way)",
    )
    imp.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    imp.add_argument(
        "--overwrite", action="store_true", help="replace a checkpoint already at CKPT_DIR"
    )
    exp = sub.add_parser("export", help="a checkpoint -> an HF directory")
    exp.add_argument("ckpt_dir")
    exp.add_argument("out_dir")
    exp.add_argument(
        "--dtype",
        choices=sorted(EXPORT_DTYPES),
        help="default: the dtype of the imported weights (config.json's dtype), else bf16",
    )
    exp.add_argument(
        "--max-shard-size", default="5GB", help="bytes, or '500MB', '5GB', '2GiB' (default 5GB)"
    )
    exp.add_argument(
        "--hf-config", help="config.json of the model (default: the one the checkpoint stores)"
    )
    exp.add_argument(
        "--lora-alpha",
        type=float,
        help="a LoRA checkpoint's alpha, where it records none (its "
        "adapters are merged into the weights written, as merge_and_unload)",
    )
    for command in (imp, exp):
        command.add_argument(
            "--placement",
            choices=["none", "cpu", "nvme"],
            default="cpu",
            help="where params and optimizer state live while converting",
        )
        command.add_argument(
            "--nvme-path",
            help="directory for --placement nvme, created if missing "
            "(default: a temporary one, deleted at the end)",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory(
        prefix="zinf-hf-"
    ) as scratch:  # removed with the state's files
        if args.placement == "nvme":
            args.nvme_path = args.nvme_path or scratch
            os.makedirs(args.nvme_path, exist_ok=True)
        run_import(args) if args.command == "import" else run_export(args)
    return 0
