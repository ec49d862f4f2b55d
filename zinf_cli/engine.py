"""From a recipe to the engine: ``zf.Config``, the optimizer, the planner's estimate, fit check."""

from __future__ import annotations

import argparse

import torch

import zinf_fn as zf
from zinf_fn.planner import StepTime, predict
from zinf_fn.planner.__main__ import parse_bytes as planner_bytes
from zinf_fn.planner.sizes import plan_config

from .schedules import decays, warmup_then

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
QUICK_DISK_BYTES = 32 << 20  # the disk measured before step 1 where no calibration is cached


def parse_bytes(text: str | None, key: str) -> int | None:
    """ "20GiB", "512M", "1000" -> bytes (the planner's command line reads them so); None stays
    None; anything else a ValueError naming ``key``."""
    if text is None:
        return None
    try:
        return planner_bytes(str(text))
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{key}: {e}") from e


def placements(args) -> tuple[str, str]:
    """(offload_params, offload_optimizer): ``placement`` unless given one by one; a LoRA run on
    nvme keeps the adapters' optimizer states in RAM (they are small, and written every step)."""
    lora_on_nvme = getattr(args, "lora_rank", 0) and args.placement == "nvme"
    params = args.offload_params or args.placement
    optimizer = args.offload_optimizer or ("cpu" if lora_on_nvme else args.placement)
    return params, optimizer


def needs_disk(args) -> bool:
    """Whether the run may put states on the nvme tier (an nvme or auto placement or spill)."""
    used = (*placements(args), args.spill_params or "", args.spill_optimizer or "")
    return any(p in ("nvme", "auto") or p.endswith(":nvme") for p in used)


def engine_config(args, nvme_path: str | None) -> zf.Config:
    """The ``zf.Config`` of a recipe (its engine and precision options)."""
    params, optimizer = placements(args)
    return zf.Config(
        offload_params=params,
        offload_optimizer=optimizer,
        nvme_path=nvme_path,
        param_dtype=DTYPES[args.param_dtype],
        master=args.master,
        clip_grad_norm=args.clip or None,
        grad_accum=args.grad_accum,
        prefetch_depth=args.prefetch_depth,
        spill_params=args.spill_params,
        spill_optimizer=args.spill_optimizer,
        host_memory_budget=parse_bytes(args.host_budget, "host_budget"),
        frozen_storage=getattr(args, "frozen_storage", "bf16"),
        keep_activations=args.keep_activations,
        keep_tiles=args.keep_tiles,
        reuse_blocks=args.reuse_blocks,
    )


def optimizer_of(args) -> zf.Optimizer:
    """AdamW with the recipe's schedule, betas, eps and weight decay (matrices only unless
    ``decay_all``)."""
    lr = warmup_then(args.schedule, args.lr, args.warmup, args.steps, args.lr_floor)
    return zf.adamw(
        lr=lr,
        b1=args.b1,
        b2=args.b2,
        eps=args.eps,
        weight_decay=args.weight_decay,
        mask=None if args.decay_all else decays,
        moments=args.moments,
    )


def check_fit(args, model, optimizer, config: zf.Config, batch: dict, nvme_path, show: bool):
    """Print the planner's estimate of the run (``zf.estimate``: memory per tier, bytes moved per
    step) and its predicted step time on this machine, disk-bound or not (``show``: this rank
    prints); refuse a run that exceeds ``host_budget`` or ``disk_budget``, naming the budget and an
    option that would make it fit. ``batch``: this rank's part of a batch of the longest rows."""
    planned = plan_config(model, optimizer, config, batch, timed=show)
    estimate = planned.estimate
    if show:
        print("the planner's estimate (this rank):\n" + estimate.table(), flush=True)
        print(prediction(estimate, planned.work, nvme_path), flush=True)
    host = parse_bytes(args.host_budget, "host_budget")
    disk = parse_bytes(args.disk_budget, "disk_budget")
    if host is not None and estimate.host_peak > host:
        fix = (
            "placement=nvme"
            if "nvme" not in placements(args)
            else "mlp_tiles / head_tiles, a smaller batch_size, or moments=int8 with "
            "master=remainder"
        )
        raise ValueError(
            f"host_budget {args.host_budget}: the run needs "
            f"{gib(estimate.host_peak)} of host memory (states and working memory); "
            f"{fix} would make it fit"
        )
    if disk is not None and estimate.disk > disk:
        raise ValueError(
            f"disk_budget {args.disk_budget}: the run needs {gib(estimate.disk)} "
            "of disk under nvme_path; moments=int8 and master=remainder (smaller "
            "states) or placement=cpu would make it fit"
        )
    return estimate


def prediction(estimate, work, nvme_path: str | None) -> str:
    """The predicted seconds of a step (``zinf_fn.planner.predict``) on this machine, and whether
    the disk or the compute bounds it: the calibration ``zinf-fn plan`` cached for ``nvme_path``
    (or for no disk), else bandwidths and FLOP/s measured now without the engine's probe runs (its
    overhead per unit then counts as none)."""
    machine = zf.calibrate(nvme_path, disk_bytes=QUICK_DISK_BYTES, probe=False)
    step = predict(estimate, work, machine)
    calibrated = machine.unit_overhead_s > 0
    source = "" if calibrated else " (uncalibrated: `zinf-fn plan` calibrates this machine once)"
    return f"predicted step{source}: {step.row()}\nthe step is {bound(step)}"


def bound(step: StepTime) -> str:
    """Whether the disk bounds ``step`` (its I/O takes longer than the compute and the optimizer
    it overlaps) or the compute does, with the seconds that say so."""
    busy = step.compute + step.optimizer
    if step.disk > busy:
        return (
            f"disk-bound: {step.disk:.3f} s of disk I/O per step, more than the {busy:.3f} s of "
            "compute and optimizer that hide it (a faster disk, or fewer states on nvme, would "
            "shorten the step)"
        )
    return (
        f"compute-bound: {step.disk:.3f} s of disk I/O per step hide behind {busy:.3f} s of "
        "compute and optimizer"
    )


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
