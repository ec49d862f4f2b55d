"""An unpacked full fine-tune step through the engine (in RAM) over the same step of a plain
transformers loop: the same Llama, the same chat rows, the same threads, one process.

The data are conversations of 1 to 8 short exchanges (about 20 to 250 tokens), one per row,
unpacked. The engine trains on ``zinf_data.Batches`` as ``zinf-fn finetune`` cuts them: each
batch's rows padded to its longest rounded up to ``--multiple`` (``pad_to_multiple_of``, the
command's default unless given); the transformers loop trains on the same rows padded to their
longest only (``DataCollatorWithPadding``'s dynamic padding), with
``torch.optim.AdamW(fused=True)`` and the token-mean cross-entropy the engine's ``token_loss``
takes. The engine keeps the blocks' activations from forward to backward (``--keep-activations``,
as the plain loop does); with 0, ``zinf-fn finetune``'s default, it recomputes each block in
backward, and the transformers loop then checkpoints every layer too (the same memory choice).
Segments alternate after a warm-up (transformers, engine, engine, transformers in each round), each
over the same batches, so both see the same machine.

``ratio``: the median over rounds of engine / transformers time (the goal <= 1.2);
``ratio_same_rows``: the same with transformers on the engine's own rows (the same shapes, so the
engine's cost alone, without its padding); ``padded_tokens``: the engine's positions over the
transformers loop's (what the bucketing adds); ``ratio_seq_len``: every row padded to ``--seq-len``
(``pad_to_multiple_of=0``, as before bucketing). ``--clock cpu`` times each segment by the CPU
time of all the process's threads (``time.process_time``: the engine's update worker counts) instead
of the wall clock, less moved by other jobs on a shared machine. Last line: JSON.

    python benchmarks/finetune_vs_hf.py --quick
    python benchmarks/finetune_vs_hf.py --quick --clock cpu
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import checkpoints  # noqa: E402
import zinf_data as zd  # noqa: E402
import zinf_fn as zf  # noqa: E402
from zinf_cli.finetune_options import OPTIONS  # noqa: E402
from zinf_data.tiny import chat_examples, corpus_of, tiny_tokenizer  # noqa: E402

LR, BATCH = 1e-4, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
PAD_MULTIPLE = next(o.default for o in OPTIONS if o.name == "pad_to_multiple_of")


def conversations(n: int, seed: int) -> list[dict]:
    """``n`` chats of 1 to 8 exchanges each (``zinf_data.tiny.chat_examples``' turns, joined)."""
    rng = random.Random(seed)
    turns = chat_examples(8 * n, seed)
    out = []
    for i in range(n):
        messages = [m for e in turns[8 * i : 8 * i + rng.randint(1, 8)] for m in e["messages"]]
        out.append({"messages": [m for m in messages if m["role"] != "system"]})
    return out


def make_inputs(root: str, args) -> tuple[str, str]:
    """(an HF Llama directory with its tokenizer, a chat JSONL file) under ``root``."""
    import transformers

    examples = conversations(args.examples, seed=0)
    hf_dir, data = os.path.join(root, "llama"), os.path.join(root, "chat.jsonl")
    tok = tiny_tokenizer(hf_dir, corpus_of(examples) * 2, vocab_size=384)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64 * -(-len(tok) // 64),
        hidden_size=args.d_model,
        intermediate_size=args.d_model * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.d_model // 64,
        num_key_value_heads=args.d_model // 128,
        max_position_embeddings=args.seq_len,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    with open(data, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in examples)
    return hf_dir, data


def batches_of(root: str, hf_dir: str, data: str, seq_len: int, multiple: int) -> list[dict]:
    """Every batch of epoch 0 of ``data``, in order, rows padded as ``pad_to_multiple_of``."""
    tok = zd.load_tokenizer(hf_dir, None)
    cache = os.path.join(root, "cache")
    tokens = zd.tokenized([data], "chat", tok, hf_dir, cache, progress=False)
    spans = zd.spans(tokens, seq_len, "truncate")
    made = zd.Batches(
        tokens,
        spans,
        seq_len,
        BATCH,
        False,
        tok.pad_token_id,
        shuffle=False,
        pad_to_multiple_of=multiple,
    )
    return [made.batch(i) for i in range(made.per_epoch(0))]


def longest_only(batch: dict) -> dict:
    """``batch`` cut after its longest row's last target (dynamic padding)."""
    used = (batch["targets"] != zd.IGNORE).any(dim=0).nonzero().max().item() + 1
    return {k: v[:, :used] for k, v in batch.items()}


class HFLoop:
    """The plain loop: ``LlamaForCausalLM`` in fp32, AdamW (fused), the token-mean loss;
    ``checkpointing``: every decoder layer recomputed in backward (transformers' gradient
    checkpointing, what the engine does with ``keep_activations=0``)."""

    def __init__(self, hf_dir: str, checkpointing: bool):
        import transformers

        self.model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        if checkpointing:
            self.model.gradient_checkpointing_enable({"use_reentrant": False})
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0, fused=True)

    def step(self, batch: dict) -> float:
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(input_ids=batch["inputs"]).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())
        loss.backward()
        self.opt.step()
        return loss.item()


class EngineLoop:
    """The same step through ``zf.train_step``, every state in RAM."""

    def __init__(self, hf_dir: str, param_dtype: torch.dtype, keep_activations: int):
        config = zf.Config(param_dtype=param_dtype, keep_activations=keep_activations)
        opt = zf.adamw(lr=LR, weight_decay=0.0)
        _, self.state = checkpoints.from_hf(hf_dir, opt, config, overrides={"token_loss": True})

    def step(self, batch: dict) -> float:
        self.state, metrics = zf.train_step(self.state, batch)
        return metrics["loss"]


def positions(batches: list[dict]) -> int:
    """The (row, position) pairs of ``batches``, padding included: what a step computes over."""
    return sum(b["inputs"].numel() for b in batches)


def segment(loop, batches: list[dict], clock=time.perf_counter) -> float:
    """Seconds (by ``clock``) of one step per batch of ``batches``."""
    t0 = clock()
    for batch in batches:
        loop.step(batch)
    return clock() - t0


def ratio(hf: HFLoop, engine: EngineLoop, ours: list[dict], theirs: list[dict], args):
    """(median engine / transformers time over ``args.rounds``, and each one's median seconds a
    step, by ``args.clock``): the engine over the batches ``ours``, transformers over ``theirs``."""
    clock = CLOCKS[args.clock]
    segment(hf, theirs[:2])  # warm-up: allocator, threads, first-touch of the states
    segment(engine, ours[:2])
    ratios, engine_s, hf_s = [], [], []
    for _ in range(args.rounds):  # transformers, engine, engine, transformers: a drift cancels
        a = segment(hf, theirs, clock)
        b = segment(engine, ours, clock) + segment(engine, ours, clock)
        a += segment(hf, theirs, clock)
        ratios.append(b / a)
        engine_s.append(b / (2 * len(ours)))
        hf_s.append(a / (2 * len(ours)))
    return statistics.median(ratios), statistics.median(engine_s), statistics.median(hf_s)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--examples", type=int, default=160, help="conversations (batches of 8)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument(
        "--multiple",
        type=int,
        default=PAD_MULTIPLE,
        help=f"pad_to_multiple_of (default: zinf-fn finetune's, {PAD_MULTIPLE})",
    )
    p.add_argument("--param-dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument(
        "--keep-activations",
        type=int,
        default=1 << 30,
        help="bytes of activations kept from forward to backward (zf.Config; 0: every "
        "block recomputed in backward, as a checkpointed loop)",
    )
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="what times a step")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="2 rounds of 4 batches: checks it runs")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # both loops' compute threads
    if args.quick:
        args.rounds, args.examples = 2, 32
    with tempfile.TemporaryDirectory(prefix="zinf-vs-hf-") as root:
        hf_dir, data = make_inputs(root, args)
        bucketed = batches_of(root, hf_dir, data, args.seq_len, args.multiple)
        padded = batches_of(root, hf_dir, data, args.seq_len, 0)
        hf = HFLoop(hf_dir, checkpointing=args.keep_activations == 0)
        engine = EngineLoop(hf_dir, DTYPES[args.param_dtype], args.keep_activations)
        longest = [longest_only(b) for b in bucketed]
        bucket_ratio, engine_s, hf_s = ratio(hf, engine, bucketed, longest, args)
        same_rows_ratio, _, _ = ratio(hf, engine, bucketed, bucketed, args)
        seq_len_ratio, _, _ = ratio(hf, engine, padded, longest, args)
        zf.close(engine.state)
    result = {
        "benchmark": "finetune_vs_hf",
        "rounds": args.rounds,
        "batches": len(bucketed),
        "d_model": args.d_model,
        "layers": args.layers,
        "seq_len": args.seq_len,
        "pad_to_multiple_of": args.multiple,
        "param_dtype": args.param_dtype,
        "keep_activations": args.keep_activations,
        "hf_checkpointing": args.keep_activations == 0,
        "lengths": sorted({b["inputs"].shape[1] for b in bucketed}),
        "hf_step_s": hf_s,
        "engine_step_s": engine_s,
        "padded_tokens": positions(bucketed) / positions(longest),
        "ratio": bucket_ratio,
        "ratio_same_rows": same_rows_ratio,
        "ratio_seq_len": seq_len_ratio,
        "clock": args.clock,
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
