"""Recipe files: a file and its ``key=value`` overrides resolve to what the same ``--flags`` give;
unknown keys and wrong types are errors naming the key, the file and the line; the shipped recipes
read; the resolved recipe written into the run directory runs the same settings again."""

from __future__ import annotations

import glob
import os

import pytest
from cli_helpers import zinf_fn_here

from zinf_cli import finetune_options, pretrain_options, recipe

FINETUNE = finetune_options.OPTIONS


def _resolve(argv, options=FINETUNE) -> dict:
    return recipe.as_dict(recipe.resolve("zinf-fn finetune", "", options, argv), options)


def test_a_recipe_file_and_overrides_equal_the_same_flags(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "lr: 1e-3\nlora_targets: [attn.q, attn.v]\npack: true\nplacement: cpu\nsteps: 9\n"
    )
    overrides = ["steps=5", "seed=3", "b2=0.999", "report_to=tensorboard"]
    from_file = _resolve(["--config", str(path), *overrides])
    from_flags = _resolve(
        [
            "--lr",
            "1e-3",
            "--lora-targets",
            "attn.q",
            "attn.v",
            "--pack",
            "--placement",
            "cpu",
            "--steps",
            "5",
            "--seed",
            "3",
            "--b2",
            "0.999",
            "--report-to",
            "tensorboard",
        ]
    )
    assert from_file == from_flags
    assert (from_file["steps"], from_file["lr"]) == (5, 1e-3)
    assert from_file["lora_targets"] == ["attn.q", "attn.v"]
    # paths: "~" is the home directory, in a file as on the command line
    data = _resolve(["hf_dir=~/m", "--data", "~/a.jsonl"])["data"]
    assert data == [os.path.expanduser("~/a.jsonl")]
    assert _resolve(["hf_dir=~/m"])["hf_dir"] == os.path.expanduser("~/m")
    # an override beats a flag beats the file
    assert _resolve(["--config", str(path), "--steps", "7", "steps=8"])["steps"] == 8
    assert _resolve(["--config", str(path), "--steps", "7"])["steps"] == 7


def test_the_resolved_recipe_reads_back_as_the_same_settings(tmp_path):
    settings = _resolve(["--lr", "1e-3", "--pack", "lora_rank=4", "nvme_path=/tmp/x"])
    argv = ["--lr", "1e-3", "--pack", "lora_rank=4", "nvme_path=/tmp/x"]
    args = recipe.resolve("zinf-fn finetune", "", FINETUNE, argv)
    recipe.write(str(tmp_path / "recipe.yaml"), args, FINETUNE)
    assert _resolve(["--config", str(tmp_path / "recipe.yaml")]) == settings


def test_unknown_keys_and_wrong_types_name_the_key_and_the_line(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("steps: 10\nlr: 0.001\nlr_max: 0.1\n")
    with pytest.raises(
        recipe.RecipeError, match=r"recipe.yaml, line 3: unknown key 'lr_max'; expected one of"
    ):
        _resolve(["--config", str(path)])
    path.write_text("steps: many\n")
    with pytest.raises(
        recipe.RecipeError, match=r"recipe.yaml, line 1: steps: expected an integer, got 'many'"
    ):
        _resolve(["--config", str(path)])
    path.write_text("pack: 1\n")
    with pytest.raises(recipe.RecipeError, match=r"line 1: pack: expected true or false, got 1"):
        _resolve(["--config", str(path)])
    path.write_text("moments: int4\n")
    with pytest.raises(
        recipe.RecipeError, match=r"line 1: moments: expected one of \['fp32', 'bf16', 'int8'\]"
    ):
        _resolve(["--config", str(path)])
    with pytest.raises(recipe.RecipeError, match=r"command line: unknown key 'setps' in setps=3"):
        _resolve(["setps=3"])
    with pytest.raises(recipe.RecipeError, match=r"command line lr=fast: lr: expected a number"):
        _resolve(["lr=fast"])


def test_the_command_prints_a_recipe_error_and_exits_1(tmp_path, capsys):
    """In this process: ``main``'s return is the exit status (``sys.exit(main())``, the exit
    through a child process is tests/cli/test_cli.py's), and an exception it let through would
    fail the test, not print a traceback."""
    path = tmp_path / "recipe.yaml"
    path.write_text("steps: 10\nwarmpu: 3\n")
    run = zinf_fn_here(capsys, "finetune", "--config", str(path))
    assert run.returncode == 1
    assert "recipe.yaml, line 2: unknown key 'warmpu'" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(recipe.RECIPES, "*.yaml"))))
def test_the_shipped_recipes_read(path):
    options = pretrain_options.OPTIONS if "pretrain" in path else FINETUNE
    settings = _resolve(["--config", os.path.basename(path)], options)  # found by name
    assert settings == _resolve(["--config", path], options)


def test_train_resume_refuses_another_recipe_naming_the_keys(tmp_path):
    from cli_helpers import TINY_GPT

    from zinf_cli import pretrain

    run = ["steps=2", "save_every=2", f"run_dir={tmp_path}", *TINY_GPT]
    pretrain.main(run)
    with pytest.raises(
        ValueError,
        match=r"--resume: .*step_000002 was trained with another "
        r"recipe: heads: 2 -> 4; steps: 2 -> 3; lr: 0.003 -> "
        r"0.001",
    ):
        pretrain.main([*run, "steps=3", f"resume={tmp_path}", "lr=1e-3", "heads=4"])


class _Captured(Exception):
    pass


@pytest.mark.parametrize(
    ("argv", "verify"), [([], True), (["--no-verify"], False), (["no_verify=true"], False)]
)
def test_no_verify_opens_the_token_cache_without_its_checksums(argv, verify, monkeypatch, tmp_path):
    """``--no-verify`` (a setting that leaves the training as it is) reaches
    ``zinf_data.tokenized(verify=False)``; by default the cache is verified."""
    from zinf_cli import finetune_data

    seen = {}

    def tokenized(*args, **kw):
        seen.update(kw)
        raise _Captured

    monkeypatch.setattr(finetune_data.zd, "tokenized", tokenized)
    monkeypatch.setattr(finetune_data.zd, "load_tokenizer", lambda hf_dir, vocab: None)
    data = tmp_path / "a.jsonl"
    data.write_text("")
    args = recipe.resolve(
        "zinf-fn finetune", "", FINETUNE, ["--data", str(data), "--run-dir", str(tmp_path), *argv]
    )
    with pytest.raises(_Captured):
        finetune_data.load_data(args, str(tmp_path), 32)
    assert seen["verify"] is verify
    assert not next(o for o in FINETUNE if o.name == "no_verify").training


def test_plan_refuses_lora_rank_without_an_hf_dir(capsys):
    """``zinf-fn plan --lora-rank`` plans adapters on an HF directory's model only: by family it
    is an error naming the flag (it was dropped from the command line, its value left behind)."""
    from zinf_cli import plan

    with pytest.raises(SystemExit) as exit_:
        plan.main(["--family", "llama", "--lora-rank", "8"])
    assert exit_.value.code == 2
    assert "--lora-rank 8" in capsys.readouterr().err
