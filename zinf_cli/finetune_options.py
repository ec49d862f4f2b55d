"""The options of ``zinf-fn finetune``: one table, the names of a recipe file and a command line."""

from __future__ import annotations

from zinf_data import FORMATS

from .recipe import Option

PLACEMENTS = ("none", "cpu", "nvme", "auto")
DATA = (
    Option(
        "hf_dir",
        str,
        None,
        "a local HF model directory with its tokenizer (default: a small "
        "random Llama and chat data made here: the demo)",
        path=True,
    ),
    Option(
        "data",
        list,
        None,
        "training files (.jsonl, .txt, .parquet, .arrow); needed with hf_dir",
        path=True,
    ),
    Option("format", str, "chat", "how the files read: chat, prompt-response or text", FORMATS),
    Option(
        "val",
        list,
        None,
        "held-out files (default: val_fraction of the training examples)",
        path=True,
    ),
    Option("val_fraction", float, 0.1, "the share of the training examples held out without val"),
    Option("train_on_prompt", bool, False, "train on every token, prompts and markup too"),
    Option(
        "no_verify",
        bool,
        False,
        "open the token cache without its checksums and id scan (a "
        "huge cache; its lengths and index are still checked)",
        training=False,
    ),
    Option("pack", bool, False, "several examples per row (attention stays within each)"),
    Option("truncate", bool, False, "cut examples longer than seq_len (default: refuse them)"),
    Option("seq_len", int, 64, "tokens per row, at most the model's max_position_embeddings"),
    Option(
        "pad_to_multiple_of",
        int,
        8,
        "rows padded to the batch's longest rounded up to a multiple of this, at most seq_len "
        "(0: every row to seq_len)",
    ),
    Option("seed", int, 0, "the data order, the held-out split and new leaves' initialisation"),
)
OPTIMIZER = (
    Option("steps", int, 60, "optimizer steps"),
    Option("batch_size", int, 8, "rows per global batch (split over ranks)"),
    Option("grad_accum", int, 1, "micro-batches per step (zf.Config.grad_accum)"),
    Option("lr", float, 2e-3, "peak learning rate"),
    Option(
        "schedule",
        str,
        "cosine",
        "after warmup: cosine down to lr_floor * lr, linear down to lr_floor * lr, or constant",
        ("cosine", "linear", "constant"),
    ),
    Option("warmup", int, 10, "linear warmup steps"),
    Option("lr_floor", float, 0.1, "the schedule's last learning rate, as a fraction of lr"),
    Option("b1", float, 0.9, "AdamW beta1"),
    Option("b2", float, 0.95, "AdamW beta2"),
    Option("eps", float, 1e-8, "AdamW epsilon"),
    Option("weight_decay", float, 0.0, "decoupled weight decay"),
    Option(
        "decay_all",
        bool,
        False,
        "decay biases and norm weights too (default: matrices only, as transformers' Trainer)",
    ),
    Option("clip", float, 1.0, "global-norm clipping (0: off)"),
)
ENGINE = (
    Option(
        "placement",
        str,
        "nvme",
        "where every state kind lives (with LoRA on nvme: the adapters' optimizer states in RAM)",
        PLACEMENTS,
        training=False,
        aliases=("--offload",),
    ),
    Option(
        "offload_params",
        str,
        None,
        "the parameters' placement (default: placement)",
        PLACEMENTS,
        training=False,
    ),
    Option(
        "offload_optimizer",
        str,
        None,
        "the optimizer states' placement (default: placement)",
        PLACEMENTS,
        training=False,
    ),
    Option(
        "spill_params",
        str,
        None,
        "'<k>:nvme': parameter rows from unit k on spill to a slower tier",
        training=False,
    ),
    Option(
        "spill_optimizer",
        str,
        None,
        "'<k>:nvme': optimizer rows from unit k on spill",
        training=False,
    ),
    Option(
        "host_budget",
        str,
        None,
        "host memory for the model states, e.g. 8GiB (auto placement and the fit check)",
        training=False,
    ),
    Option(
        "disk_budget",
        str,
        None,
        "disk for the model states under nvme_path, e.g. 100GiB (the fit check)",
        training=False,
    ),
    Option(
        "nvme_path",
        str,
        None,
        "directory of the nvme tier (default: a temporary one)",
        training=False,
        path=True,
    ),
    Option(
        "param_dtype",
        str,
        "bf16",
        "the stored 16-bit copy: bf16, or fp32 (keeps an fp32 base exact)",
        ("bf16", "fp32"),
    ),
    Option(
        "master",
        str,
        "fp32",
        "the fp32 master: fp32, or remainder (bf16 copy + 16-bit remainder, exact)",
        ("fp32", "remainder"),
    ),
    Option("moments", str, "fp32", "how Adam's m and v are stored", ("fp32", "bf16", "int8")),
    Option("mlp_tiles", int, 1, "tiles of each block's MLP (memory-centric tiling)"),
    Option("head_tiles", int, 1, "tiles of the vocabulary head and its loss"),
    Option("prefetch_depth", int, 1, "units fetched ahead of the one computing", training=False),
    Option(
        "keep_activations",
        int,
        0,
        "bytes of saved activations kept from forward to backward",
        training=False,
    ),
    Option(
        "keep_tiles",
        int,
        0,
        "bytes of frozen experts' tiles kept from forward to backward",
        training=False,
    ),
    Option("reuse_blocks", int, 0, "last blocks kept fetched into the backward", training=False),
)
LORA = (
    Option("lora_rank", int, 0, "train LoRA adapters of this rank only (0: every weight)"),
    Option("lora_alpha", float, 16.0, "LoRA's alpha: the update is scaled alpha / rank"),
    Option(
        "lora_targets", list, None, "block linears to adapt (default: the family's, attn.q attn.v)"
    ),
    Option(
        "frozen_storage",
        str,
        "bf16",
        "with lora_rank: the frozen base's block linears",
        ("bf16", "int8", "nf4"),
    ),
    Option(
        "merge",
        bool,
        False,
        "with lora_rank: also export the merged weights as hf/",
        training=False,
    ),
)
# a run's files and logs: ``zinf-fn train``'s too, with its defaults (``pretrain_options``)
RUN = (
    Option(
        "run_dir",
        str,
        "runs/finetune",
        "the run's directory: metrics.jsonl, the recipe, checkpoints (and the export)",
        training=False,
        aliases=("--ckpt-dir",),
        path=True,
    ),
    Option(
        "save_every",
        int,
        20,
        "save a checkpoint every N steps, in the background (0: never)",
        training=False,
    ),
    Option("keep", int, 2, "checkpoints to keep", training=False),
    Option(
        "report_to",
        list,
        None,
        "trackers beside metrics.jsonl: tensorboard, wandb, mlflow",
        training=False,
    ),
    Option("log_every", int, 10, "without a terminal: one log line every N steps", training=False),
)
FINETUNE_RUN = (
    Option(
        "eval_every", int, 20, "held-out loss every N steps (0: only at the end)", training=False
    ),
    Option(
        "resume", bool, False, "continue from the newest checkpoint in run_dir/ckpt", training=False
    ),
    Option(
        "stop_at", int, 0, "stop after step N as an interruption would (no export)", training=False
    ),
    Option(
        "export_dtype",
        str,
        "model",
        "dtype of the hf/ export: the model's own (config.json's dtype), bf16, fp16 or fp32",
        ("model", "bf16", "fp16", "fp32"),
        training=False,
    ),
)
OPTIONS = DATA + OPTIMIZER + ENGINE + LORA + RUN + FINETUNE_RUN
