"""``zinf-fn finetune``: fine-tune a local Hugging Face checkpoint (Llama / Mistral / Qwen2 ...)
on your own data, with its own tokenizer.

    zinf-fn finetune                     # a small random Llama and chat data made here
    zinf-fn finetune --config lora_nvme.yaml hf_dir=~/models/Llama-3.2-1B data=train.jsonl
    zinf-fn finetune --hf-dir DIR --data train.jsonl --format chat --steps 1000 --pack
    zinf-fn finetune ... --resume        # continue from the run's newest checkpoint
    torchrun --nproc-per-node 2 -m zinf_cli finetune ...   # data parallel: each rank takes B/N rows

Every option is one name in a recipe file (``--config``), as ``key=value`` and as ``--key``; see
docs/cli.md. The run directory gets ``recipe.yaml`` (the resolved recipe), ``metrics.jsonl``,
``curves.png``, checkpoints ``ckpt/step_N`` (with the data position and the recipe: ``--resume``
refuses a recipe that changes the training), and the export: ``hf/`` (``checkpoints.to_hf`` plus the
tokenizer) or with LoRA the PEFT adapter ``adapter/``. SIGINT / SIGTERM finish the step, save and
exit 0.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch.distributed as dist
import torch.nn.functional as F

import checkpoints
import zinf_fn as zf
from checkpoints.hf import FAMILIES, model_config
from checkpoints.hf_files import read_config
from layers import lora

from . import recipe, tools
from .engine import check_fit, engine_config, needs_disk, optimizer_of
from .finetune_data import FinetuneData, load_data, prompt_of
from .finetune_options import OPTIONS
from .loop import (
    Progress,
    StopSignal,
    evaluate,
    flops_per_token,
    rank_and_world,
    rows_of,
    timed_step,
    torchrun_world,
)
from .trackers import MetricsLog, Trackers, open_trackers

PROG = "zinf-fn finetune"
MODEL_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # config.json's names


def parse_args(argv=None):
    """The run's settings (``recipe.resolve`` over the finetune options)."""
    return recipe.resolve(PROG, __doc__, OPTIONS, sys.argv[1:] if argv is None else argv)


def lora_of(args):
    """The LoRA transform of ``lora_rank``, ``lora_alpha``, ``lora_targets``; None without LoRA."""
    if not args.lora_rank:
        return None
    targets = tuple(args.lora_targets) if args.lora_targets else None

    def transform(model):
        return lora.apply(model, rank=args.lora_rank, alpha=args.lora_alpha, targets=targets)

    return transform


def overrides_of(args) -> dict:
    """The model config's fields a recipe sets: the token-mean loss, the tile counts."""
    return {"token_loss": True, "mlp_tiles": args.mlp_tiles, "head_tiles": args.head_tiles}


def model_of(args, hf_config: dict, where: str):
    """The ``layers`` model of ``hf_config`` (``overrides_of``), LoRA applied."""
    cfg = model_config(hf_config, where, overrides_of(args))
    model = FAMILIES[hf_config["model_type"]].model(cfg)
    transform = lora_of(args)
    return model if transform is None else transform(model)


def widest(batch: dict, seq_len: int) -> dict:
    """``batch`` with its rows padded to ``seq_len`` (zeros): the largest shape of the run's
    batches (``pad_to_multiple_of`` cuts most shorter), the planner's worst case."""
    return {k: F.pad(v, (0, seq_len - v.shape[1])) for k, v in batch.items()}


def open_state(args, hf_dir: str, config, optimizer, data: FinetuneData):
    """(model, state): from the HF weights, or with ``resume`` from the newest checkpoint, which
    must have been trained by the same recipe on the same data."""
    newest = checkpoints.latest(os.path.join(args.run_dir, "ckpt")) if args.resume else None
    if newest is None:
        if args.resume:
            print(f"--resume: no checkpoint in {args.run_dir}/ckpt; starting from {hf_dir}")
        return checkpoints.from_hf(
            hf_dir, optimizer, config, overrides=overrides_of(args), transform=lora_of(args)
        )
    saved = checkpoints.read_manifest(newest)["extra"]
    changes = recipe.training_changes(saved.get("recipe", {}), args, OPTIONS)
    if changes:
        raise ValueError(
            f"--resume: {newest} was trained with another recipe: "
            f"{'; '.join(changes)}. Resume with its recipe (--config "
            f"{args.run_dir}/recipe.yaml) or start a new run_dir"
        )
    if saved.get("data") != data.identity:
        raise ValueError(
            f"--resume: {newest} was trained on data {saved.get('data')}, this run "
            f"has {data.identity}; resume with the same files and tokenizer"
        )
    model = model_of(args, saved["hf_config"], newest)
    state = checkpoints.restore(newest, model, optimizer, config)
    print(f"resumed {newest} at step {state.step}")
    return model, state


def train(args, state, data: FinetuneData, log: Trackers, save):
    """Steps from ``state.step`` to ``steps`` (or ``stop_at``, or a signal), evaluating, saving."""
    end = min(args.steps, args.stop_at or args.steps)
    progress = Progress(state.step, end, args.log_every, rank_and_world()[0] == 0)
    stream = data.train.from_(state.step)
    if state.step == 0:  # the held-out loss before training: where the curve starts
        log.write({"step": 0, **evaluate(state, data.val.every_row())})
    flops = flops_per_token(state)
    with StopSignal() as stop:
        while state.step < end:
            state, record = timed_step(state, next(stream), state.step, flops)
            step = record["step"]
            log.write(record)
            progress.step(record)
            if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
                held_out = evaluate(state, data.val.every_row())
                log.write({"step": step, **held_out})
                progress.write(
                    f"step {step}: held-out loss {held_out['val_loss']:.4f} "
                    f"(ppl {held_out['val_ppl']:.2f})"
                )
            saved = args.save_every and step % args.save_every == 0
            if saved:
                save(state, step)
            if step < end and stop.requested():
                progress.write(f"stopping after step {step}: a signal asked to stop")
                if args.save_every and not saved:
                    save(state, step)
                break
    progress.close()
    return state


def finetune(args, hf_dir: str, nvme_path: str | None) -> dict:
    """Import (or resume), check the fit, train, and export: the run's result."""
    config = engine_config(args, nvme_path)
    optimizer = optimizer_of(args)
    hf_config = read_config(hf_dir)
    cfg = model_config(hf_config, hf_dir)
    if args.seq_len > cfg.seq_len:
        raise ValueError(
            f"seq_len {args.seq_len} exceeds the model's max_position_embeddings {cfg.seq_len}"
        )
    data = load_data(args, hf_dir, cfg.vocab_size)
    rank = rank_and_world()[0]
    check_fit(
        args,
        model_of(args, hf_config, hf_dir),
        optimizer,
        config,
        widest(rows_of(data.train.batch(0)), args.seq_len),
        nvme_path,
        show=rank == 0,
    )
    model, state = open_state(args, hf_dir, config, optimizer, data)
    adapters = f", LoRA rank {args.lora_rank} on {model.config.targets}" if args.lora_rank else ""
    if rank == 0:
        print(f"{lora.base_config(model.config).family}, {model.n_layers} layers{adapters}")
        recipe.write(os.path.join(args.run_dir, "recipe.yaml"), args, OPTIONS)
    metrics = MetricsLog(os.path.join(args.run_dir, "metrics.jsonl"), state.step, write=rank == 0)
    log = Trackers(metrics, open_trackers(args.report_to, args.run_dir) if rank == 0 else [])
    extra = {"hf_config": hf_config, "data": data.identity, "recipe": recipe.as_dict(args, OPTIONS)}
    pending = []

    def save(state, step):  # written while the next steps run; the data position is the step
        path = os.path.join(args.run_dir, "ckpt", f"step_{step:06d}")
        pending[:] = [
            checkpoints.save_async(path, state, keep=args.keep, overwrite=True, extra=extra)
        ]

    try:
        state = train(args, state, data, log, save)
        if pending:
            pending[0].result()  # sync: the last checkpoint is committed
    finally:
        log.close()
    if state.step < args.steps:  # stop_at or a signal: interrupted
        result = {"stopped_at": state.step}
    else:
        result = finish(args, state, data, hf_config, log)
    zf.close(state)  # the engine's threads stopped, its files closed
    return result


def finish(args, state, data: FinetuneData, hf_config: dict, log: Trackers) -> dict:
    """Export with the tokenizer, plot the curves, and sample the export on a held-out prompt."""
    out, sample_dir = export(args, state, hf_config)  # collective
    curves = os.path.join(args.run_dir, "curves.png")
    if rank_and_world()[0] != 0:
        return {"out": out, "records": log.records}
    data.tokenizer.save_pretrained(out)
    tools.plot_curves(log.records, curves, f"fine-tune ({args.format}, {args.steps} steps)")
    losses = [r["loss"] for r in log.records if "loss" in r]
    val = [r["val_loss"] for r in log.records if "val_loss" in r]
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; held-out {val[0]:.3f} -> {val[-1]:.3f}; "
        f"exported to {out}: {', '.join(sorted(os.listdir(out)))}; curves {curves}"
    )
    result = {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "val_losses": val,
        "out": out,
        "curves": curves,
        "records": log.records,
    }
    if args.format == "chat":
        messages = prompt_of(data.val)
        adapter = out if args.lora_rank and not args.merge else None
        result["sample"] = tools.greedy_sample(sample_dir, messages, adapter=adapter)
        print(f"prompt: {messages[-1]['content']!r} -> greedy answer: {result['sample']!r}")
    return result


def export(args, state, hf_config: dict) -> tuple[str, str]:
    """(the export directory, the HF model to sample): ``hf/`` (``to_hf``: LoRA merged), or with
    LoRA and no ``merge`` the PEFT adapter ``adapter/`` (``to_peft``) over its base. Collective."""
    if args.lora_rank:
        adapter = os.path.join(args.run_dir, "adapter")
        checkpoints.to_peft(state, adapter, base_model_name_or_path=args.hf_dir)
        if not args.merge:
            return adapter, args.hf_dir
    out = os.path.join(args.run_dir, "hf")
    dtype = export_dtype(args, hf_config)
    checkpoints.to_hf(state, out, dtype, hf_config=hf_config)  # LoRA: merged
    return out, out


def export_dtype(args, hf_config: dict) -> str:
    """``export_dtype``, or for "model" the dtype config.json names (``dtype``, or its old spelling
    ``torch_dtype``; bf16 where it names none)."""
    if args.export_dtype != "model":
        return args.export_dtype
    named = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return MODEL_DTYPES.get(named, "bf16")


def main(argv=None) -> dict:
    """Run ``zinf-fn finetune`` with ``argv`` (default: the command line); the run's result."""
    args = parse_args(argv)
    os.makedirs(args.run_dir, exist_ok=True)
    if args.hf_dir and not args.data:
        raise SystemExit("data is needed with hf_dir (the files to fine-tune on)")
    with torchrun_world():
        return run(args)


def run(args) -> dict:
    """The demo's inputs when no model is given, a scratch nvme directory when none is, the run."""
    rank, world = rank_and_world()
    if args.batch_size % world:
        raise SystemExit(f"batch_size {args.batch_size} must divide among {world} ranks")
    demo = os.path.join(args.run_dir, "demo")
    if not args.hf_dir and rank == 0:
        tools.demo_inputs(demo, args.seed)
    if world > 1:
        dist.barrier()  # sync: rank 0's demo files are written
    if not args.hf_dir:
        args.hf_dir, demo_data = tools.demo_inputs(demo, args.seed)
        args.data = [demo_data]
    with tempfile.TemporaryDirectory(prefix="zinf-finetune-") as scratch:
        nvme_path = args.nvme_path
        if nvme_path is None and needs_disk(args):
            nvme_path = os.path.join(scratch, "nvme")  # the engine keeps each rank's files apart
        if nvme_path:
            os.makedirs(nvme_path, exist_ok=True)
        return finetune(args, args.hf_dir, nvme_path)  # the temporary NVMe files go with scratch
