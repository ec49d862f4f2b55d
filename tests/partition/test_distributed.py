"""Data parallelism over gloo: worlds of 2 and 4 ranks train the same model as a world of 1.

Every rank takes its slice of every global batch (rank r: rows [r*B/N, (r+1)*B/N)); the engine
averages gradients over ranks, so a world of N on B/N rows per rank is the same training as a world
of 1 on B rows. Spawning a world costs ~3-5 s, so each world runs several checks.

Tolerance (world N vs world 1): not bitwise, because the same per-example gradient terms are summed
in a different order (a world of 1 reduces over all B rows inside one kernel; a world of N over B/N
rows, then gloo sums the N partial means in its own order). That is ~1e-7 relative per gradient
element, but where a gradient element is itself a near-cancelling sum its *relative* rounding error
is large, and Adam, which normalises each element (m / sqrt(v)), turns it into an absolute parameter
difference of a fraction of lr. Measured (PAD_CFG, 4 steps, N = 2 and 4): Adam max |param diff|
1.8e-5 (0.6% of lr = 3e-3), exactly the difference between two *world-1* runs that only split the
batch differently (grad_accum 1 vs 2: 1.81e-5); SGD 3.3e-8; losses 1.5e-7 relative; grad norms
1.3e-6 relative. Bounds, with 5-30x margin: Adam params 1e-4, SGD params 1e-6, losses 1e-6, grad
norms 1e-5. Adam is blind to the scale of the gradient (a sum instead of a mean over ranks would
pass), so the SGD run and the grad norm comparison are what pin the mean: simulated in a world of 1,
a sum instead of a mean over 2 ranks moves the SGD run's parameters by up to 0.2, losing one rank's
half of the batch by up to 0.3. Broadcast mode reduces to the owner in yet another order; it matched
allgather bitwise here, and is held to the same bounds.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import time

import pytest
import torch
from dist_utils import rank_part, run_world
from engine_helpers import decay_predicate, max_abs_diff
from engine_internals import allocated_arrays, collective_picks
from reference import make_batches

import zinf_fn as zf
from layers import gpt
from zinf_fn.state import units, view

# d_model, vocab_size odd and seq_len even: every group's numel is odd (embed 33*77 = 2541, block
# 12*33^2 + 13*33 = 13497, head 33*63 = 2079), so no world size > 1 divides it: every shard set is
# padded.
PAD_CFG = gpt.Config(vocab_size=61, d_model=33, n_heads=3, n_layers=3, seq_len=16)
STEPS, BATCH = 4, 8
PARAM_TOL = {"adamw": 1e-4, "sgd": 1e-6}
LOSS_RTOL, NORM_RTOL = 1e-6, 1e-5
FP32 = dict(param_dtype=torch.float32)


def _config(placement: str, grad_accum: int, partition: str = "allgather", **kw) -> zf.Config:
    return zf.Config(
        offload_params=placement,
        offload_optimizer=placement,
        grad_accum=grad_accum,
        partition=partition,
        **FP32,
        **kw,
    )


# name -> (config, optimizer); each runs in every world and is compared with its world-1 run
CONFIGS = {
    "none": (_config("none", 1), "adamw"),
    "cpu/accum2": (_config("cpu", 2), "adamw"),
    "none/broadcast": (_config("none", 1, "broadcast"), "adamw"),
    "cpu/accum2/broadcast": (_config("cpu", 2, "broadcast"), "adamw"),
    "cpu/clip/mask": (_config("cpu", 1, clip_grad_norm=0.05), "adamw_mask"),
    "cpu/clip/mask/broadcast": (_config("cpu", 1, "broadcast", clip_grad_norm=0.05), "adamw_mask"),
    "none/accum2/sgd": (
        _config("none", 2),
        "sgd",
    ),  # SGD is not scale-invariant like Adam: catches sum vs mean
    "nvme/accum2": (
        _config("nvme", 2, nvme_path="per-run"),
        "adamw",
    ),  # a fresh directory per run, below
}


def _optimizer(name: str = "adamw") -> zf.Optimizer:
    if name == "sgd":
        return zf.sgd(lr=0.5, momentum=0.9)
    mask = (
        decay_predicate if name == "adamw_mask" else None
    )  # decay by key path: shards cut across leaves
    return zf.adamw(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask)


def _train(config: zf.Config, opt: str, rank: int, world: int) -> tuple[list, dict, list]:
    """(loss, grad norm) per step, final master params and, per step, the collectives issued in
    it."""
    if config.nvme_path == "per-run":  # each rank (and the world-1 run) in a directory of its own
        with tempfile.TemporaryDirectory(prefix="zinf-dist-nvme-") as path:
            return _train(dataclasses.replace(config, nvme_path=path), opt, rank, world)
    state = zf.init(gpt.model(PAD_CFG), _optimizer(opt), config, seed=0)
    calls = view(state).comm.calls
    metrics, per_step = [], []
    for batch in make_batches(PAD_CFG, STEPS, BATCH, seed=1):
        before = calls.copy()
        state, m = zf.train_step(state, rank_part(batch, rank, world))
        per_step.append(calls - before)
        metrics.append((m["loss"], m["grad_norm"]))
    return metrics, zf.gather_params(state), per_step


# -- the world function: everything one world checks
# ---------------------------------------------------------
def _world(rank: int, world: int) -> dict:
    parts, initial = _padding(world)
    out = {
        "mismatch": _mismatches(rank, world),
        "padding": parts,
        "initial": initial,
        "runs": {},
        "storage": _storage(),
    }
    for name, (config, opt) in CONFIGS.items():
        out["runs"][name] = _train(config, opt, rank, world)
    out["pre_2_13"] = _without_single_collectives(
        lambda: _train(CONFIGS["none"][0], "adamw", rank, world)
    )
    return out


def _without_single_collectives(run):
    """``run()`` as on torch < 2.13: no all_gather_single / reduce_scatter_single, so DistComm falls
    back to all_gather_into_tensor and (gloo) all-reduce + slice. Returns run()'s result and the
    picks."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}
    for name in saved:
        delattr(dist, name)
    try:
        from zinf_fn.partition.comm import DistComm

        probe = DistComm(60.0)
        picks = collective_picks(probe)
        return run(), picks
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _mismatches(rank: int, world: int) -> list[str]:
    """Two inits where the last rank differs (config, then model): each must raise on *every*
    rank."""
    errors = []
    odd = rank == world - 1
    cases = [
        (gpt.model(PAD_CFG), zf.Config(grad_accum=2 if odd else 1, **FP32)),
        (
            gpt.model(gpt.Config(**{**PAD_CFG.__dict__, "n_layers": 2 if odd else 3})),
            zf.Config(**FP32),
        ),
    ]
    for model, config in cases:
        try:
            zf.init(model, _optimizer(), config, seed=0)
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def _padding(world: int) -> tuple[dict, dict]:
    """(numel, padded numel) of each group, and the initial model (gathered: the padding is
    dropped)."""
    state = zf.init(gpt.model(PAD_CFG), _optimizer(), zf.Config(**FP32), seed=0)
    parts = {name: (g.part.numel, g.part.padded_numel) for name, g in view(state).groups.items()}
    return parts, zf.gather_params(state)


def _storage() -> dict:
    """Bytes of each array this rank stores, and the units it owns, in broadcast and allgather
    mode."""
    out = {}
    for mode in ("broadcast", "allgather"):
        state = zf.init(gpt.model(PAD_CFG), _optimizer(), _config("cpu", 1, mode), seed=0)
        v = view(state)
        owned = [u.name for u in units(v.n_layers) if v.holds(u)]
        arrays = {a.key: a.numel for a in allocated_arrays(state, "param")}
        out[mode] = (arrays, owned)
    return out


@pytest.fixture(scope="module")
def world_one() -> dict:
    return {name: _train(config, opt, 0, 1) for name, (config, opt) in CONFIGS.items()}


@pytest.fixture(scope="module", params=[2, 4])
def world(request) -> tuple[int, list[dict]]:
    return request.param, run_world(request.param, _world)


def _rel(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_same_training_as_world_one(world, world_one):
    n, results = world
    for name, (ref_metrics, ref_final, _) in world_one.items():
        metrics, final, _ = results[0]["runs"][name]
        for other in results[
            1:
        ]:  # every rank reports the same global metrics and gathers the same model
            assert other["runs"][name][0] == metrics
            assert max_abs_diff(other["runs"][name][1], final) == 0.0
        param_diff = max_abs_diff(final, ref_final)
        loss_diff = _rel([m[0] for m in metrics], [m[0] for m in ref_metrics])
        norm_diff = _rel([m[1] for m in metrics], [m[1] for m in ref_metrics])
        tol = PARAM_TOL[CONFIGS[name][1].split("_")[0]]
        assert param_diff < tol, f"world {n}, {name}: max |param diff| {param_diff:.3g}"
        assert loss_diff < LOSS_RTOL, f"world {n}, {name}: max relative loss diff {loss_diff:.3g}"
        assert norm_diff < NORM_RTOL, (
            f"world {n}, {name}: max relative grad norm diff {norm_diff:.3g}"
        )
        assert max_abs_diff(final, results[0]["initial"]) > 1e-3  # it trained: parameters moved


def test_broadcast_equals_allgather(world):
    n, results = world
    for placement in ("none", "cpu/accum2", "cpu/clip/mask"):
        ag_metrics, ag_final, _ = results[0]["runs"][placement]
        bc_metrics, bc_final, _ = results[0]["runs"][f"{placement}/broadcast"]
        assert _rel([m[0] for m in bc_metrics], [m[0] for m in ag_metrics]) < LOSS_RTOL
        assert _rel([m[1] for m in bc_metrics], [m[1] for m in ag_metrics]) < NORM_RTOL
        assert max_abs_diff(bc_final, ag_final) < PARAM_TOL["adamw"]


def test_padding_is_exercised(world):
    n, results = world
    for name, (numel, padded) in results[0]["padding"].items():
        assert numel % n != 0 and padded > numel, (
            f"{name}: {numel} elements divide by {n}: no padding tested"
        )


def test_mismatched_configs_raise_on_every_rank(world):
    n, results = world
    for rank, result in enumerate(results):
        config_err, model_err = result["mismatch"]
        assert "config.grad_accum" in config_err and f"rank {n - 1}: 2" in config_err, (
            rank,
            config_err,
        )
        assert "model.n_layers" in model_err and f"rank {n - 1}: 2" in model_err, (rank, model_err)


def test_each_unit_gathered_and_reduced_once_per_pass_whatever_grad_accum(world):
    """Per step: every unit is allgathered once in forward and once in backward (the head once: its
    backward runs while it is resident) and reduce-scattered exactly once, with 1 or 2 micro-batches
    alike."""
    n, results = world
    blocks = [f"blocks.{i}" for i in range(PAD_CFG.n_layers)]
    gathers = {("all_gather", u): 2 for u in ["embed", *blocks]} | {("all_gather", "head"): 1}
    scatters = {("reduce_scatter_mean", u): 1 for u in ["embed", *blocks, "head"]}
    # and the token-mean loss (token_loss, the default) counts the global batch's targets once
    scalars = {
        ("all_reduce_sum", "loss"): 1,
        ("all_reduce_sum", "grad norm"): 1,
        ("all_reduce_sum", "target tokens"): 1,
    }
    for name in ("none", "cpu/accum2"):
        for step_calls in results[0]["runs"][name][2]:
            assert dict(step_calls) == gathers | scatters | scalars, name
    as_broadcast = {("broadcast", u): c for (_, u), c in gathers.items()}
    reduces = {("reduce_mean", u): 1 for (_, u) in scatters}
    for step_calls in results[0]["runs"]["cpu/accum2/broadcast"][2]:
        assert dict(step_calls) == as_broadcast | reduces | scalars


# -- a rank that dies or hangs: the others raise the collective's named timeout error
# ------------------------
TIMEOUT_S = 2.0


def _failing_model(rank: int, world: int, how: str, raised: str):
    """PAD_CFG whose last rank exits in block 1's forward of step 1, or is stuck there until the
    file ``raised`` exists (rank 0 creates it once its collective has raised).

    block.apply runs 2 L times a step (forward, then the recompute under vjp in backward), so the
    (2 L + 2)-th call is step 1's forward of block 1: the other ranks are then waiting in an
    allgather.
    """
    base = gpt.model(PAD_CFG)
    calls = {"n": 0}

    def apply(params, carry):
        calls["n"] += 1
        if rank == world - 1 and calls["n"] == 2 * PAD_CFG.n_layers + 2:
            if how == "exit":
                os._exit(3)
            while not os.path.exists(raised):  # stuck: nothing but rank 0's error ends this
                time.sleep(0.01)
        return base.block.apply(params, carry)

    return base._replace(block=base.block._replace(apply=apply))


def _doomed(rank: int, world: int, how: str, raised: str) -> str:
    config = zf.Config(collective_timeout_s=TIMEOUT_S, **FP32)
    state = zf.init(_failing_model(rank, world, how, raised), _optimizer(), config, seed=0)
    try:
        for batch in make_batches(PAD_CFG, 3, BATCH, seed=1):
            state, _ = zf.train_step(state, rank_part(batch, rank, world))
    except RuntimeError as exc:
        if rank == 0:
            open(raised, "w").close()  # the stuck rank may go on: rank 0 raised while it was stuck
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_dead_or_stuck_rank_raises_named_error_within_timeout(how, tmp_path):
    """Rank 0 raises its collective's timeout error while the other rank is dead, or still stuck:
    the stuck rank leaves block 1 only once rank 0 has raised, so the order, not a clock, shows that
    rank 0 gave up on its own (the process group's timeout, 30 s here, is only the harness's guard
    against a hang)."""
    outcomes = run_world(
        2, _doomed, how, str(tmp_path / "rank0-raised"), allow_errors=True, timeout_s=30
    )
    status, message = outcomes[0]
    assert status == "ok", message
    # which unit rank 0 is gathering when it notices depends on how far its prefetch ran ahead
    assert re.match(
        r"CollectiveError: rank 0 of 2: all_gather of (blocks\.\d|head) did not complete \(timeout "
        r"2 s",
        message,
    ), message
    if how == "exit":
        assert outcomes[1][0] == "error"  # the process is gone: it never reported
    else:  # released after rank 0 raised, it finds rank 0 gone and fails too
        assert outcomes[1][0] == "ok" and outcomes[1][1].startswith(
            "CollectiveError: rank 1 of 2"
        ), outcomes[1]


def test_storage_per_rank(world):
    """allgather: every rank stores 1/N (padded) of every unit; broadcast: only the units it owns,
    whole, round-robin over the scan order (embed, blocks.0.., head), and nothing for the others."""
    n, results = world
    units = ["embed", *(f"blocks.{i}" for i in range(PAD_CFG.n_layers)), "head"]
    numel = {"embed": 2541, "blocks": 13497, "head": 2079}
    for rank, result in enumerate(results):
        arrays, owned = result["storage"]["broadcast"]
        assert owned == [u for i, u in enumerate(units) if i % n == rank]
        rows = {g: sum(u.split(".")[0] == g for u in owned) for g in numel}
        assert arrays == {f"{g}/param": rows[g] * numel[g] for g in numel if rows[g]}
        arrays, owned = result["storage"]["allgather"]
        assert owned == units
        assert arrays == {
            f"{g}/param": (PAD_CFG.n_layers if g == "blocks" else 1) * -(-numel[g] // n)
            for g in numel
        }


def test_fingerprint_check_names_fields_and_ignores_rank_local():
    from zinf_fn.partition.fingerprint import check_agreement, fingerprint

    groups = view(zf.init(gpt.model(PAD_CFG), _optimizer(), zf.Config(**FP32))).groups.values()

    def fp(seed=0, **config):
        return fingerprint(
            groups, PAD_CFG.n_layers, zf.Config(**FP32, **config), _optimizer(), seed
        )

    check_agreement(
        [fp(nvme_path="/a", device="cpu"), fp(nvme_path="/b"), fp(trace="t2")]
    )  # rank-local: fine
    with pytest.raises(ValueError) as err:
        check_agreement([fp(), fp(seed=1), fp(offload_params="cpu"), fp(offload_params="cpu")])
    assert "seed: ranks [0, 2, 3]: 0; rank 1: 1" in str(err.value)
    assert "config.offload_params: ranks [0, 1]: 'none'; ranks [2, 3]: 'cpu'" in str(err.value)
    masked = fingerprint(
        groups,
        PAD_CFG.n_layers,
        zf.Config(**FP32),
        zf.adamw(lr=3e-3, b1=0.9, b2=0.95, weight_decay=0.1, mask=lambda p: p.endswith(".w")),
        0,
    )
    with pytest.raises(
        ValueError, match="optimizer.weight_decay_mask: rank 0: 'none'; rank 1: '.* decayed leaves"
    ):
        check_agreement([fp(), masked])


def test_pre_2_13_collective_fallbacks_train_the_same(world, world_one):
    n, results = world
    (metrics, final, _), picks = results[0]["pre_2_13"]
    assert picks == ("all_gather_into_tensor", "_reduce_scatter_by_all_reduce")
    ref_metrics, ref_final, _ = world_one["none"]
    assert _rel([m[0] for m in metrics], [m[0] for m in ref_metrics]) < LOSS_RTOL
    assert max_abs_diff(final, ref_final) < PARAM_TOL["adamw"]
