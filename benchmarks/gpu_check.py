"""CUDA paths in one short run: streams, pinned buffers, bf16 compute, an NCCL world of 1, step
times.

    python benchmarks/gpu_check.py            # needs a CUDA device; prints one JSON line per check

Checks (each prints {"check": name, "ok": bool, ...}):
  train_cuda_<placement>   the engine trains a small GPT on CUDA in bf16 and the loss falls
  placements_bitwise       placement none and cpu (pinned host buffers) give bitwise-equal
  parameters pinned_buffers           the host staging buffers of the cpu placement are pinned
  nccl_world_of_1          a run inside an NCCL process group of one equals the run without one
  step_time                engine (none, cpu) vs a plain PyTorch bf16 reference at d_model 2048
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from reference import RefGPT, make_batches  # noqa: E402

import zinf_fn as zf  # noqa: E402
from layers import gpt  # noqa: E402
from zinf_fn.state import view  # noqa: E402

SMALL = gpt.Config(vocab_size=256, d_model=256, n_heads=4, n_layers=4, seq_len=128)


def report(name: str, ok: bool, **info) -> None:
    print(json.dumps({"check": name, "ok": bool(ok), **info}), flush=True)


def train(cfg, config, steps, batch_size=8, seed=0):
    state = zf.init(gpt.model(cfg), zf.adamw(lr=1e-3), config, seed=seed)
    losses = []
    for batch in make_batches(cfg, steps, batch_size, seed=1):
        state, metrics = zf.train_step(state, batch)
        losses.append(metrics["loss"])
    torch.cuda.synchronize()
    return state, losses


def check_training() -> None:
    import tempfile

    finals = {}
    nvme_dir = tempfile.mkdtemp(prefix="zinf-gpu-check-")
    for placement in ("none", "cpu", "nvme"):
        config = zf.Config(
            offload_params=placement, offload_optimizer=placement, nvme_path=nvme_dir
        )
        state, losses = train(SMALL, config, 20)
        finals[placement] = zf.gather_params(state)
        # random tokens: the loss can only fall to ln(256) = 5.545, so "falls" is the check
        report(
            f"train_cuda_{placement}",
            losses[-1] < losses[0],
            first=losses[0],
            last=losses[-1],
            compute_dtype=str(config.resolved_compute_dtype()),
            buffers=view(state).counters().pool_made,
        )
        if placement == "cpu":
            pinned = [b.is_pinned() for b in _host_buffers(state)]
            report("pinned_buffers", pinned and all(pinned), n_host_buffers=len(pinned))
    import optree

    def leaves(name):
        return optree.tree_leaves(finals[name])

    # cpu and nvme both update on the host: bitwise. "none" updates on the GPU, whose kernels round
    # differently from the CPU's: reported, not required to be bitwise.
    same = all(torch.equal(a, b) for a, b in zip(leaves("cpu"), leaves("nvme"), strict=True))
    gap = max(
        float((a - b).abs().max()) for a, b in zip(leaves("none"), leaves("cpu"), strict=True)
    )
    report("cpu_nvme_bitwise", same, none_vs_cpu_max_abs_diff=gap)


def _host_buffers(state):
    return [b for b in view(state).idle_buffers() if b.device.type == "cpu"]


def check_nccl_world_of_1() -> None:
    import torch.distributed as dist

    config = zf.Config(offload_params="cpu", offload_optimizer="cpu")  # host shards: a real gather
    _, plain = train(SMALL, config, 5)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        state, inside = train(SMALL, config, 5)
        report(
            "nccl_world_of_1", inside == plain, comm=type(view(state).comm).__name__, losses=inside
        )
    finally:
        dist.destroy_process_group()


def check_step_time() -> None:
    cfg = gpt.Config(vocab_size=256, d_model=2048, n_heads=16, n_layers=8, seq_len=1024)
    data = make_batches(cfg, 8, 8, seed=0)
    times = {}
    for placement in ("none", "cpu"):
        state = zf.init(
            gpt.model(cfg),
            zf.adamw(lr=1e-4),
            zf.Config(offload_params=placement, offload_optimizer=placement),
        )
        times[placement] = _median_step(_engine_stepper([state]), data)
        del state
        torch.cuda.empty_cache()
    ref = RefGPT(cfg).cuda().to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True)  # the kernel the engine runs

    def ref_step(batch):
        ref_opt.zero_grad(set_to_none=True)
        ref(batch["inputs"].cuda(), batch["targets"].cuda()).backward()
        ref_opt.step()

    times["torch_bf16"] = _median_step(ref_step, data)
    tokens = 8 * cfg.seq_len
    report(
        "step_time",
        True,
        **{f"{k}_ms": round(v * 1000, 1) for k, v in times.items()},
        tokens_per_s_none=round(tokens / times["none"]),
        ratio_cpu_over_none=round(times["cpu"] / times["none"], 3),
        ratio_none_over_torch=round(times["none"] / times["torch_bf16"], 3),
    )


def _engine_stepper(box):
    def step(batch):
        box[0], _ = zf.train_step(box[0], batch)

    return step


def _median_step(step, data) -> float:
    step(data[0])
    torch.cuda.synchronize()
    out = []
    for batch in data[1:]:
        t0 = time.perf_counter()
        step(batch)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def main() -> None:
    if not torch.cuda.is_available():
        report("cuda_available", False)
        return
    report("cuda_available", True, device=torch.cuda.get_device_name(), torch=torch.__version__)
    for check in (check_training, check_nccl_world_of_1, check_step_time):
        try:
            check()
        except Exception as exc:  # report every check, do not stop at the first failure
            report(check.__name__, False, error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
