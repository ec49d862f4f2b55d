"""``layers.lora`` against PEFT's ``lora.Linear``, and ``zf.Model.trainable``.

PEFT is the reference: ``peft.get_peft_model(LlamaForCausalLM(cfg), LoraConfig(...))`` with the same
A and B (B random, not PEFT's zero init, so the LoRA term shows) must give our logits, loss and
gradients.

Tolerances: both sides run the same fp32 ops in the same order on the same values (PEFT's
``result + lora_B(lora_A(x)) * scaling`` is ``linear.apply``'s), so logits agree to fp32 rounding:
``rtol = atol = 1e-5`` on logits of size ~1, as tests/models/test_hf_import.py (a missing or
mis-scaled LoRA term moves them ~1e-2). A's and B's gradients are sums over B*T positions of
products of such values: ``rtol = 1e-4, atol = 1e-6`` (measured ~1e-7 relative; a wrong scale is
off by a factor). The engine against PEFT + ``AdamW(fused=True)``: as
tests/models/test_hf_import.py, losses 1e-5 relative and weights 1e-5 absolute.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from hf_reference import engine_config, full_tree, hf_loss, hf_model, train_engine, tree_paths
from hf_workers import adamw, fp32_config
from llama_reference import BETAS, EPS, LR, WD, train_hf
from peft_reference import ALPHA, RANK, lora_leaves, peft_llama
from reference import make_batches

import checkpoints
import zinf_fn as zf
from layers import gpt, linear, llama, lora
from zinf_fn import tiling
from zinf_fn.model import is_trainable


def our_params(base: dict, model, n_layers: int) -> dict:
    """The engine's full tree of a PEFT model: the base from ``base``, A and B copied from
    ``model``."""
    tree = full_tree(base, n_layers)
    for path, value in lora_leaves(model).items():
        parts = path.split(".")
        node = tree["blocks"][int(parts[1])]
        for key in parts[2:-1]:
            node = node[key]
        node[parts[-1]] = value.detach().clone()
    return tree


def logits_of(lm: zf.Model, params: dict, inputs: torch.Tensor) -> torch.Tensor:
    bound = {**params, "blocks": [lora.bind(lm.config, b) for b in params["blocks"]]}
    return llama.logits(bound, lm.config.base, inputs)


# -- forward and gradients against PEFT ------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "targets"), [("llama3", ("attn.q", "attn.v")), ("qwen2", ("attn.v", "mlp.down"))]
)
def test_forward_and_gradients_equal_peft(family, targets):
    base, ref = peft_llama(targets, family)
    cfg = llama.Config.from_hf(ref.get_base_model().config.to_dict())
    lm = lora.apply(llama.model(cfg), rank=RANK, alpha=ALPHA, targets=targets)
    params = our_params(base, ref, cfg.n_layers)
    batch = make_batches(cfg, 1, batch_size=3, seed=0)[0]
    ref_logits = ref(input_ids=batch["inputs"]).logits
    torch.testing.assert_close(
        logits_of(lm, params, batch["inputs"]), ref_logits, rtol=1e-5, atol=1e-5
    )
    without = llama.logits(full_tree(base, cfg.n_layers), cfg, batch["inputs"])
    assert (without - ref_logits).abs().max() > 1e-2  # the LoRA term is there to be seen
    ref_loss = hf_loss(ref, batch)
    ref_loss.backward()
    leaves = {p: t for p, t in _paths(params).items() if p.rsplit(".", 1)[-1] in lora.LORA_LEAVES}
    for t in leaves.values():
        t.requires_grad_(True)
    loss = zf.plain_loss(lm, params, batch)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    loss.backward()
    ref_leaves = lora_leaves(ref)
    assert leaves.keys() == ref_leaves.keys() and len(leaves) == 2 * len(targets) * cfg.n_layers
    for path, t in leaves.items():
        torch.testing.assert_close(t.grad, ref_leaves[path].grad, rtol=1e-4, atol=1e-6, msg=path)


def test_gpt_and_tiled_linears_equal_the_untiled_model():
    """A tiled weight keeps its tiles; the LoRA path beside it gives the untiled model's loss and
    gradients."""
    base = gpt.Config(vocab_size=64, d_model=32, n_heads=2, n_layers=2, seq_len=16)
    tiled = gpt.Config(**{**base.__dict__, "attn_tiles": 2, "mlp_tiles": 3})
    targets = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    plain_m = lora.apply(gpt.model(base), rank=RANK, alpha=ALPHA, targets=targets)
    tiled_m = lora.apply(gpt.model(tiled), rank=RANK, alpha=ALPHA, targets=targets)
    gen = torch.Generator().manual_seed(3)
    blocks = [tiled_m.block.init(gen, i) for i in range(2)]
    for b in blocks:  # B random: the LoRA term shows
        for t in targets:
            _node(b, t)["lora_b"] = torch.randn(_node(b, t)["lora_b"].shape, generator=gen) * 0.1
    params = {"embed": tiled_m.embed.init(gen), "blocks": blocks, "head": tiled_m.head.init(gen)}
    untiled = {**params, "blocks": [_untiled(b) for b in blocks]}
    assert isinstance(_node(blocks[0], "mlp.proj")["w"], tuple)  # ColTiles stays tiled
    batch = make_batches(base, 1, batch_size=2, seed=0)[0]
    for p in (params, untiled):
        for t in _paths(p).values():
            t.requires_grad_(True)
    loss_t, loss_u = zf.plain_loss(tiled_m, params, batch), zf.plain_loss(plain_m, untiled, batch)
    assert loss_t.item() == pytest.approx(
        loss_u.item(), rel=1e-6
    )  # tiles sum in another order: fp32 rounding
    (loss_t + loss_u).backward()
    for path in (
        "blocks.1.mlp.proj.lora_a",
        "blocks.0.attn.qkv.lora_b",
        "blocks.1.attn.proj.lora_b",
    ):
        torch.testing.assert_close(
            _paths(params)[path].grad, _paths(untiled)[path].grad, rtol=1e-4, atol=1e-6
        )


def test_plain_training_of_the_adapter_equals_peft_with_adamw():
    """The slow twin of the engine test below: autograd through ``zf.plain_loss`` with
    ``AdamW(fused=True)`` on A and B only equals PEFT's training, step for step (tolerances as
    tests/models/test_hf_import.py)."""
    base, ref = peft_llama(("attn.q", "attn.v"))
    cfg = llama.Config.from_hf(ref.get_base_model().config.to_dict())
    lm = lora.apply(llama.model(cfg), rank=RANK, alpha=ALPHA, targets=("attn.q", "attn.v"))
    params = our_params(base, ref, cfg.n_layers)
    ours = [t.requires_grad_(True) for p, t in _paths(params).items() if "lora_" in p]
    batches = make_batches(cfg, 6, batch_size=4, seed=1)
    adam = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    opts = (
        torch.optim.AdamW(ours, **adam),
        torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **adam),
    )
    for batch in batches:
        losses = []
        for opt, loss_of in zip(
            opts, (lambda b: zf.plain_loss(lm, params, b), lambda b: hf_loss(ref, b)), strict=True
        ):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    got = _paths(params)
    for path, want in lora_leaves(ref).items():
        assert (got[path] - want).abs().max() <= 1e-5, path


# -- init ------------------------------------------------------------------------------------------


def test_init_is_peft_kaiming_uniform_and_leaves_the_base_alone():
    cfg = llama.Config(vocab_size=64, d_model=32, n_heads=4, d_ff=48, seq_len=16, mlp_tiles=2)
    base_m = llama.model(cfg)
    lm = lora.apply(base_m, rank=RANK, alpha=ALPHA, targets=("attn.q", "mlp.down"))
    for i in range(cfg.n_layers):
        tree = lm.block.init(torch.Generator().manual_seed(5), i)
        gen = torch.Generator().manual_seed(5)
        want = base_m.block.init(
            gen, i
        )  # the base first, then A from the same generator, as PEFT's init
        assert _equal_base(tree, want)
        a = torch.empty(RANK, 32)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        assert torch.equal(tree["attn"]["q"]["lora_a"], a)
        for target, d_in, d_out in (("attn.q", 32, 32), ("mlp.down", 48, 32)):
            node = _node(tree, target)
            assert node["lora_a"].shape == (RANK, d_in) and node["lora_b"].shape == (d_out, RANK)
            assert node["lora_a"].abs().max() <= 1 / math.sqrt(d_in) and node[
                "lora_a"
            ].std() > 0.3 / math.sqrt(d_in)
            assert torch.equal(node["lora_b"], torch.zeros(d_out, RANK))
    big = lora.lora_init(torch.Generator().manual_seed(0), 64, 4096, 8)["lora_a"]  # U(-1/64, 1/64)
    assert big.abs().max() <= 1 / 64 and abs(big.std().item() - 1 / 64 / math.sqrt(3)) < 1e-4
    assert abs(big.mean().item()) < 1e-4
    state_base, state_lora = zf.init(base_m, adamw(), seed=2), zf.init(lm, adamw(), seed=2)
    # the frozen base keeps its 16-bit copy only (its "master" is that copy): compare the stored
    # copies
    got, want = (
        _paths(zf.gather_params(state_lora, "param")),
        _paths(zf.gather_params(state_base, "param")),
    )
    assert all(torch.equal(got[p], w) for p, w in want.items())
    assert set(got) - set(want) == {
        f"blocks.{i}.{t}.{leaf}"
        for i in range(2)
        for t in ("attn.q", "mlp.down")
        for leaf in lora.LORA_LEAVES
    }


# -- trainable -------------------------------------------------------------------------------------


def test_trainable_predicate():
    m = llama.model(llama.Config(vocab_size=64, d_model=32, n_heads=4, d_ff=48, seq_len=16))
    assert m.trainable is None and is_trainable(m, "blocks.0.attn.q.w")
    lm = lora.apply(m, rank=2, alpha=4, targets=("attn.q",))
    assert is_trainable(lm, "blocks.1.attn.q.lora_a") and is_trainable(lm, "blocks.0.attn.q.lora_b")
    for frozen in (
        "blocks.1.attn.q.w",
        "blocks.0.attn.v.lora_a",
        "embed.tok.w",
        "head.norm.w",
        "blocks.x.attn.q.lora_a",
    ):
        assert not is_trainable(lm, frozen), frozen
    only_last = m._replace(
        trainable=lambda path: path.startswith("blocks.1.")
    )  # composes: both must accept
    composed = lora.apply(only_last, rank=2, alpha=4, targets=("attn.q",))
    assert is_trainable(composed, "blocks.1.attn.q.lora_a") and not is_trainable(
        composed, "blocks.0.attn.q.lora_a"
    )
    with pytest.raises(
        TypeError, match=r"trainable\('embed.tok.w'\) returned 'yes'.*expected a bool"
    ):
        is_trainable(m._replace(trainable=lambda path: "yes"), "embed.tok.w")
    with pytest.raises(
        TypeError, match="zf.Model.trainable must be None .* or a predicate on key paths.*got 3"
    ):
        zf.init(m._replace(trainable=3), adamw())
    assert (
        zf.Model(m.embed, m.block, m.head, 2).trainable is None
    )  # positional construction unchanged


# -- bad input -------------------------------------------------------------------------------------


def test_bad_arguments():
    m = llama.model(llama.Config(vocab_size=64, d_model=32, n_heads=4, d_ff=48, seq_len=16))
    linears = r"\['attn.k', 'attn.o', 'attn.q', 'attn.v', 'mlp.down', 'mlp.gate', 'mlp.up'\]"
    with pytest.raises(
        ValueError,
        match=rf"target 'attn.qkv' is not a linear of the model's blocks; expected some "
        rf"of {linears}",
    ):
        lora.apply(m, targets=("attn.q", "attn.qkv"))
    with pytest.raises(ValueError, match="target 'attn_norm' is not a linear"):
        lora.apply(m, targets=("attn_norm",))
    with pytest.raises(ValueError, match="rank must be an int >= 1, got 0"):
        lora.apply(m, rank=0)
    with pytest.raises(
        ValueError, match=r"rank=33 exceeds min\(d_in, d_out\) = 32 of target 'attn.q'"
    ):
        lora.apply(m, rank=33)
    for alpha in (0, -1.0):
        with pytest.raises(ValueError, match=f"alpha must be a number > 0.*got {alpha}"):
            lora.apply(m, alpha=alpha)
    with pytest.raises(
        ValueError, match="dropout=0.1 is not supported: layers/ compute no dropout: the engine"
    ):
        lora.apply(m, dropout=0.1)
    with pytest.raises(ValueError, match="targets must be a non-empty tuple"):
        lora.apply(m, targets="attn.q")
    with pytest.raises(ValueError, match="already has LoRA"):
        lora.apply(lora.apply(m), targets=("attn.k",))
    tree = lora.apply(m, rank=2).block.init(torch.Generator(), 0)
    with pytest.raises(ValueError, match="needs the float 'lora_scale'.*lora.bind"):
        linear.apply(tree["attn"]["q"], torch.zeros(1, 32))


# -- the engine ------------------------------------------------------------------------------------

# name -> (config, model, targets, a LoRA leaf that must move): tiled targets in both
ENGINE_MODELS = {
    "llama": (
        llama.Config(
            vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=16, mlp_tiles=2
        ),
        llama.model,
        ("attn.q", "mlp.gate", "mlp.down"),
        "blocks.1.mlp.down.lora_b",
    ),
    "gpt_tied": (
        gpt.Config(
            vocab_size=64,
            d_model=32,
            n_heads=2,
            n_layers=2,
            seq_len=16,
            attn_tiles=2,
            tie_embeddings=True,
        ),
        gpt.model,
        ("attn.qkv", "attn.proj"),
        "blocks.1.attn.proj.lora_b",
    ),
}


@pytest.mark.parametrize(
    ("name", "placement"), [("llama", "none"), ("llama", "cpu"), ("gpt_tied", "nvme")]
)
def test_engine_trains_a_lora_model(name, placement, tmp_path):
    """The engine runs a LoRA model (tiled targets too): the adapters train, every base leaf (tiled
    ones included) stays bitwise as it was (``zinf_fn.formats.frozen``)."""
    cfg, family_model, targets, moved = ENGINE_MODELS[name]
    lm = lora.apply(family_model(cfg), rank=RANK, alpha=ALPHA, targets=targets)
    state = zf.init(
        lm, adamw(), fp32_config(placement, str(tmp_path) if placement == "nvme" else None), seed=0
    )
    batches = make_batches(cfg, 4, batch_size=2, seed=1)
    plain = zf.plain_loss(lm, zf.gather_params(state), batches[0]).item()
    assert zf.eval_step(state, batches[0]) == pytest.approx(plain, rel=1e-6)
    initial = tree_paths(zf.gather_params(state))
    state, losses, final = train_engine(state, batches * 2)
    assert all(math.isfinite(loss) for loss in losses) and final[moved].abs().max() > 0
    frozen = [path for path in initial if not is_trainable(lm, path)]
    assert frozen and all(_same(final[path], initial[path]) for path in frozen)
    zf.close(state)


def _same(a, b) -> bool:
    """Bitwise equal tensors, or tiled nodes (``RowTiles``/``ColTiles``) with bitwise equal
    tiles."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a.tiles) == len(b.tiles) and all(
        torch.equal(x, y) for x, y in zip(a.tiles, b.tiles, strict=True)
    )


@pytest.mark.parametrize("overrides", [None, {"head_tiles": 3, "embed_tiles": 2}])
def test_engine_training_equals_peft_with_adamw(tmp_path, overrides):
    """Every step's loss and the final adapter: the engine on a LoRA model from from_hf vs PEFT +
    AdamW(fused). Tiled vocabulary too: the frozen head's tiles are read once a step, its pull-back
    to h summed in forward (``tiling.cross_entropy``), the same fp32 products in another order,
    within the same bounds."""
    base, ref = peft_llama(("attn.q", "attn.v"))
    hf = hf_model("llama3")
    hf.save_pretrained(tmp_path / "hf")
    lm, state = checkpoints.from_hf(
        str(tmp_path / "hf"),
        adamw(),
        fp32_config(),
        overrides=overrides,
        transform=lambda m: lora.apply(m, rank=RANK, alpha=ALPHA, targets=("attn.q", "attn.v")),
    )
    params = _paths(zf.gather_params(state))
    with torch.no_grad():  # the reference starts from the engine's init of A (B = 0)
        for path, p in lora_leaves(ref).items():
            p.copy_(params[path])
    batches = make_batches(engine_config(hf), 10, batch_size=4, seed=1)
    ref_losses = train_hf(ref, batches)
    state, losses, final = train_engine(state, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for path, want in lora_leaves(ref).items():
        assert (final[path] - want).abs().max() <= 1e-5, path
    for name, want in base.items():  # and the base is frozen
        assert torch.equal(tiling.untile(final[llama.hf_to_ours(name)]), want), name


# -- helpers ---------------------------------------------------------------------------------------


def _paths(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    out = {}
    for key, value in items:
        out.update(_paths(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _node(tree: dict, path: str) -> dict:
    for key in path.split("."):
        tree = tree[key]
    return tree


def _untiled(tree):
    from zinf_fn import tiling

    if tiling.is_tiled(tree):
        return tiling.untile(tree).detach().clone()
    if isinstance(tree, dict):
        return {k: _untiled(v) for k, v in tree.items()}
    return tree.detach().clone()


def _equal_base(tree: dict, want: dict) -> bool:
    got = {p: t for p, t in _paths(tree).items() if "lora_" not in p}
    return got.keys() == _paths(want).keys() and all(
        torch.equal(t, _paths(want)[p]) for p, t in got.items()
    )


transformers.logging.set_verbosity_error()


def test_hf_export_command_of_a_lora_checkpoint_writes_the_merged_weights(tmp_path):
    """``python -m checkpoints hf export`` of a LoRA checkpoint restores the LoRA model (rank and
    targets from its leaves, alpha from ``--lora-alpha``) and writes what ``to_hf`` of the live
    state writes: merged, bitwise. Without an alpha it refuses, naming the flag."""
    from safetensors.torch import load_file

    from checkpoints.hf_cli import main as hf_main

    cfg = llama.Config(
        vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2, seq_len=16
    )
    lm = lora.apply(llama.model(cfg), rank=RANK, alpha=ALPHA, targets=("attn.q", "attn.v"))
    state = zf.init(lm, zf.adamw(lr=1e-2), zf.Config(param_dtype=torch.bfloat16), seed=0)
    for batch in make_batches(cfg, 2, batch_size=2, seed=1):
        state, _ = zf.train_step(state, batch)
    checkpoints.to_hf(state, str(tmp_path / "live"), torch.float32)
    hf_config = checkpoints.hf_files.read_config(str(tmp_path / "live"))
    checkpoints.save(str(tmp_path / "ckpt"), state, extra={"hf_config": hf_config})
    with pytest.raises(checkpoints.CheckpointError, match="--lora-alpha"):
        hf_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "none")])
    hf_main(
        [
            "export",
            str(tmp_path / "ckpt"),
            str(tmp_path / "cli"),
            "--dtype",
            "fp32",
            "--lora-alpha",
            str(ALPHA),
        ]
    )
    live, cli = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("live", "cli"))
    assert set(live) == set(cli) and not any("lora" in name for name in cli)
    assert all(torch.equal(live[name], cli[name]) for name in live)
    for name, record in (
        ("recorded", [RANK, ALPHA, ["attn.q", "attn.v"]]),
        ("bad", [RANK, "sixteen"]),
    ):
        checkpoints.save(
            str(tmp_path / name), state, extra={"hf_config": hf_config, "data": {"lora": record}}
        )
    with pytest.raises(
        checkpoints.CheckpointError, match=r"extra.data.lora must be \[rank, alpha > 0"
    ):
        hf_main(["export", str(tmp_path / "bad"), str(tmp_path / "bad_out")])
    hf_main(
        ["export", str(tmp_path / "recorded"), str(tmp_path / "rec_out"), "--dtype", "fp32"]
    )  # its alpha
    recorded = load_file(str(tmp_path / "rec_out" / "model.safetensors"))
    assert all(torch.equal(live[name], recorded[name]) for name in live)
