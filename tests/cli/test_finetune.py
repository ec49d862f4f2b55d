"""``zinf-fn finetune`` (``zinf_cli.finetune``) end to end on its own demo data (a random Llama,
a tokenizer and chats made in the test): an interrupted and resumed run is bitwise the run that was
not interrupted, data position included; the held-out loss on the response tokens falls."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file

from zinf_cli import finetune

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the records' keys that are the training's (the others time it: tokens/s, I/O wait, peak RSS)
TRAINING_KEYS = ("step", "loss", "lr", "grad_norm", "val_loss", "val_ppl")


def _args(run, *extra) -> list[str]:
    return [
        "--steps",
        "6",
        "--batch-size",
        "4",
        "--seq-len",
        "64",
        "--pack",
        "--warmup",
        "2",
        "--eval-every",
        "2",
        "--save-every",
        "3",
        "--placement",
        "cpu",
        "--export-dtype",
        "fp32",
        "--run-dir",
        str(run),
        *extra,
    ]


def _metrics(run) -> list[dict]:
    """metrics.jsonl's records, their training keys only."""
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k in TRAINING_KEYS} for line in f]


def test_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    whole = finetune.main(_args(tmp_path / "whole"))
    run = tmp_path / "resumed"
    assert finetune.main(_args(run, "--stop-at", "4")) == {
        "stopped_at": 4
    }  # checkpoint at 3, step 4 lost
    with open(
        os.path.join(run, "metrics.jsonl"), "a"
    ) as f:  # a line past the checkpoint, as a crash leaves it
        f.write(json.dumps({"step": 5, "loss": 0.0}) + "\n")
    resumed = finetune.main(_args(run, "--resume"))
    assert _metrics(run) == _metrics(
        tmp_path / "whole"
    )  # losses, lrs, grad norms, held-out losses: bitwise
    a, b = (
        load_file(os.path.join(whole["out"], "model.safetensors")),
        load_file(os.path.join(resumed["out"], "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert resumed["val_losses"][-1] < resumed["val_losses"][0]


def test_resume_refuses_another_recipe_naming_the_keys(tmp_path):
    run = tmp_path / "run"
    finetune.main(_args(run, "--stop-at", "3"))
    with pytest.raises(
        ValueError,
        match=r"--resume: .* another recipe: batch_size: 4 -> 2; lr: 0.002 -> "
        r"0.001\. Resume with its recipe",
    ):
        finetune.main(_args(run, "--resume", "--batch-size", "2", "lr=1e-3"))
    # what leaves the training as it is may change: where to evaluate, save, stop
    assert finetune.main(_args(run, "--resume", "eval_every=3", "--stop-at", "4")) == {
        "stopped_at": 4
    }


def _ranked_run(rank: int, world: int, run: str) -> list[dict]:
    records = finetune.main(_args(run))["records"]
    return [{k: v for k, v in r.items() if k in TRAINING_KEYS} for r in records]


def test_world_2_is_the_same_fine_tune(tmp_path):
    """Under a process group of 2 (as torchrun makes it) each rank takes half of every global batch;
    the token-weighted losses and held-out losses are those of one process. Tolerance: as
    tests/partition/test_distributed.py's Adam runs (losses 1e-6 relative there over 4 steps); 6
    Adam steps with clipping here, bound 1e-5."""
    from dist_utils import run_world

    one = finetune.main(_args(tmp_path / "one"))["records"]
    two = run_world(2, _ranked_run, str(tmp_path / "two"))
    assert two[0] == two[1]  # every rank logs the same global metrics
    for a, b in zip(one, two[0], strict=True):
        assert a["step"] == b["step"]
        for key in ("loss", "val_loss"):
            if key in a:
                assert abs(a[key] - b[key]) / a[key] < 1e-5, (a, b)
    assert os.path.isfile(tmp_path / "two" / "curves.png")
    assert os.path.isfile(tmp_path / "two" / "hf" / "tokenizer.json")


def test_lora_fine_tune_with_the_base_on_nvme(tmp_path):
    """``--lora-rank`` with the base on NVMe: an interrupted and resumed LoRA run is bitwise the
    uninterrupted one (metrics and adapter: its checkpoints hold the frozen base as a param row
    only); the adapter loads in peft over the base it was imported from and gives the merged
    export's logits (fp32 on both sides, the delta added in another order: 1e-5 as
    tests/models/test_peft.py); the merged export changes the adapted weights only."""
    import peft
    import torch
    import transformers

    lora = (
        "--lora-rank",
        "8",
        "--lora-alpha",
        "16",
        "--lora-targets",
        "attn.q",
        "attn.v",
        "--merge",
        "--placement",
        "nvme",
    )
    whole = finetune.main(_args(tmp_path / "whole", *lora))
    run = tmp_path / "resumed"
    assert finetune.main(_args(run, *lora, "--stop-at", "4")) == {"stopped_at": 4}
    finetune.main(_args(run, *lora, "--resume"))
    assert _metrics(run) == _metrics(tmp_path / "whole")
    a, b = (
        load_file(os.path.join(r, "adapter", "adapter_model.safetensors"))
        for r in (tmp_path / "whole", run)
    )
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert any(
        k.endswith("lora_B.weight") and a[k].abs().max() > 0 for k in a
    )  # the adapters trained
    # The demo's base is fp32 and the run's params bf16: a frozen leaf keeps its bf16 copy only, so
    # the base the adapter trained on (and the merge starts from) is the import rounded to bf16.
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(tmp_path / "whole", "demo", "random-llama"), dtype=torch.float32
    )
    with torch.no_grad():
        for p in hf_base.parameters():
            p.copy_(p.to(torch.bfloat16))
    base = {k: v.clone() for k, v in hf_base.state_dict().items()}
    merged = load_file(os.path.join(whole["out"], "model.safetensors"))
    adapted = {k for k in merged if ".q_proj." in k or ".v_proj." in k}
    assert all(merged[k].equal(base[k]) for k in merged if k not in adapted)
    assert all(not merged[k].equal(base[k]) for k in adapted)
    loaded = peft.PeftModel.from_pretrained(
        hf_base, os.path.join(tmp_path / "whole", "adapter")
    ).eval()
    ids = torch.randint(
        0, loaded.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    want = transformers.AutoModelForCausalLM.from_pretrained(
        whole["out"], dtype=torch.float32
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, want(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_lora_shortcuts_and_a_quantized_base_from_the_command_line(tmp_path):
    """``--keep-activations`` and ``--reuse-blocks`` give the LoRA run without them bitwise (their
    contract, tests/engine/test_frozen_reuse.py); ``--frozen-storage nf4`` fine-tunes over the NF4
    base: every step's loss differs from the bf16 base's (the weights are not the same), and the
    held-out loss falls."""
    lora = ("--lora-rank", "8", "--placement", "nvme")
    finetune.main(_args(tmp_path / "plain", *lora))
    finetune.main(
        _args(
            tmp_path / "shortcuts", *lora, "--keep-activations", str(1 << 22), "--reuse-blocks", "1"
        )
    )
    assert _metrics(tmp_path / "shortcuts") == _metrics(tmp_path / "plain")
    finetune.main(_args(tmp_path / "nf4", *lora, "--frozen-storage", "nf4"))
    plain, nf4 = _metrics(tmp_path / "plain"), _metrics(tmp_path / "nf4")
    losses = [m["loss"] for m in nf4 if "loss" in m]
    assert len(losses) == 6 and losses != [m["loss"] for m in plain if "loss" in m]
    held_out = [m["val_loss"] for m in nf4 if "val_loss" in m]
    assert held_out[-1] < held_out[0]


def test_the_example_script_keeps_its_flags_and_exports_in_the_models_dtype(tmp_path):
    """``examples/finetune_hf.py`` (a wrapper of ``zinf-fn finetune``) with today's flags:
    checkpoints pruned to ``--keep``, the HF config kept, the export in the model's own dtype (the
    demo's Llama is fp32) unless ``--export-dtype`` says otherwise."""
    import importlib.util

    import torch
    import transformers

    import checkpoints

    spec = importlib.util.spec_from_file_location(
        "finetune_hf", os.path.join(ROOT, "examples", "finetune_hf.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    run = tmp_path / "run"
    flags = [
        "--steps",
        "6",
        "--save-every",
        "2",
        "--keep",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--warmup",
        "2",
        "--eval-every",
        "3",
        "--nvme-path",
        str(tmp_path / "nvme"),
    ]
    result = script.main([*flags, "--run-dir", str(run)])
    assert sorted(os.listdir(run / "ckpt")) == [
        "step_000004",
        "step_000006",
    ]  # keep=2 pruned step 2
    assert (
        checkpoints.read_manifest(str(run / "ckpt" / "step_000006"))["extra"]["hf_config"][
            "model_type"
        ]
        == "llama"
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(result["out"])
    assert back.dtype == torch.float32 and result["last_loss"] < result["first_loss"]
    assert os.path.isfile(result["curves"]) and isinstance(result["sample"], str)
    bf16 = script.main([*flags, "--run-dir", str(tmp_path / "bf16"), "--export-dtype", "bf16"])
    assert transformers.AutoModelForCausalLM.from_pretrained(bf16["out"]).dtype == torch.bfloat16
