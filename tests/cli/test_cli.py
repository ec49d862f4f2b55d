"""Each ``zinf-fn`` subcommand through a child process, as a user runs it: the finetune demo with no
arguments leaves a checkpoint that ``inspect --json`` reads; train, plan, convert; usage errors. A
second command of a test that is no test of the process runs in this one (``zinf_fn_here``)."""

from __future__ import annotations

import importlib
import json
import math
import os
import re

import tomllib
import torch
from cli_helpers import ROOT, TINY_GPT, metrics, tiny_llama, zinf_fn, zinf_fn_here

import zinf_fn as zf


def test_console_script_names_an_importable_callable():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    module, _, name = scripts["zinf-fn"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))


def test_finetune_with_no_arguments_runs_the_demo_and_inspect_reads_its_checkpoint(
    tmp_path, capsys
):
    run = zinf_fn("finetune", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "the planner's estimate" in run.stdout and "greedy answer" in run.stdout
    assert "predicted step" in run.stdout and re.search(
        r"the step is (disk|compute)-bound", run.stdout
    )
    ckpt = tmp_path / "runs" / "finetune" / "ckpt"
    shown = zinf_fn_here(capsys, "inspect", str(ckpt), "--json")
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)  # one JSON object
    assert summary["step"] == 60 and summary["model"]["family"] == "llama"
    assert summary["placements"]["offload_params"] == "nvme"
    # bytes per kind: the bf16 copy is 2 bytes a parameter, the fp32 master and moments 4
    n = summary["model"]["parameters"]
    assert summary["bytes"] == {"param": 2 * n, "master": 4 * n, "adam_m": 4 * n, "adam_v": 4 * n}
    assert summary["data"]["batches_consumed"] == 60
    assert summary["recipe"]["steps"] == 60
    text = zinf_fn_here(capsys, "inspect", str(ckpt)).stdout
    assert "step       60" in text and "llama, 4 layers" in text


def test_train_logs_every_step_and_saves(tmp_path, capsys):
    run = zinf_fn("train", *TINY_GPT, "steps=3", "save_every=3", f"run_dir={tmp_path / 'run'}")
    assert run.returncode == 0, run.stdout + run.stderr
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    shown = zinf_fn_here(capsys, "inspect", str(tmp_path / "run"), "--json")
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    assert summary["step"] == 3 and summary["recipe"]["d_model"] == 32
    assert summary["model"]["family"] == "layers.gpt"


def test_plan_by_family_and_by_hf_directory(tmp_path, capsys):
    by_family = zinf_fn(
        "plan", "--family", "llama", "--d-model", "256", "--layers", "2", "--host-budget", "8GiB"
    )
    assert by_family.returncode == 0, by_family.stderr
    assert "peak host" in by_family.stdout and "budget 8192.0 MiB" in by_family.stdout
    assert "predicted:" in by_family.stdout
    hf = tiny_llama(tmp_path / "hf")
    by_dir = zinf_fn_here(
        capsys, "plan", "--hf-dir", hf, "--params", "cpu", "--optimizer", "cpu", "--seq", "32"
    )
    assert by_dir.returncode == 0, by_dir.stderr
    assert "cpu" in by_dir.stdout and "peak host" in by_dir.stdout


def test_convert_imports_an_hf_directory_that_inspect_reads(tmp_path, capsys):
    hf = tiny_llama(tmp_path / "hf")
    run = zinf_fn("convert", "hf", "import", hf, str(tmp_path / "ckpt"))
    assert run.returncode == 0, run.stderr
    summary = json.loads(zinf_fn_here(capsys, "inspect", str(tmp_path / "ckpt"), "--json").stdout)
    assert summary["step"] == 0 and summary["model"]["family"] == "llama"
    assert summary["model"]["n_layers"] == 2


def test_usage_errors_exit_2_and_name_the_subcommands():
    run = zinf_fn("pretrain")
    assert run.returncode == 2 and "finetune, train, plan, convert, inspect" in run.stderr


def test_plan_of_an_hf_mixture_of_experts_counts_the_experts_its_tokens_touch(tmp_path, capsys):
    from hf_reference import hf_model

    from zinf_cli import plan
    from zinf_fn.planner.__main__ import placements

    hf = tmp_path / "hf"
    hf_model("qwen3_moe").save_pretrained(str(hf))
    argv = ["--hf-dir", str(hf), "--params", "nvme", "--nvme-path", str(tmp_path / "nvme")]
    argv += ["--optimizer", "cpu", "--seq", "4", "--batch", "1"]
    assert plan.main(argv) == 0
    shown = capsys.readouterr().out
    args = plan.parser().parse_args(argv)
    model, top_k = plan.hf_model(args)
    with open(hf / "config.json") as f:
        assert top_k == json.load(f)["num_experts_per_tok"]
    tokens = torch.zeros(1, 5, dtype=torch.long)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    routed = zf.estimate(model, zf.adamw(), placements(args), batch, top_k=top_k).table()
    every_expert = zf.estimate(model, zf.adamw(), placements(args), batch).table()
    # its experts stream, and 4 tokens at top-2 touch fewer than all of them: the reads differ
    assert "expert" in shown and shown == routed + "\n" and routed != every_expert
