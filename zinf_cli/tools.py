"""The pieces of ``zinf-fn finetune`` that are not the training loop: the demo's own model and data,
the metrics log, the loss-curve plot and a greedy sample with transformers."""

from __future__ import annotations

import json
import math
import os

import torch

from zinf_data.tiny import chat_examples, corpus_of, tiny_tokenizer


def demo_inputs(directory: str, seed: int, n_examples: int = 240) -> tuple[str, str]:
    """(an HF directory of a small random Llama with a tokenizer trained here, a chat JSONL file)
    under ``directory``; made once, the same bytes for the same seed (a resumed demo reuses its
    cache)."""
    import transformers

    hf_dir, data = os.path.join(directory, "random-llama"), os.path.join(directory, "chat.jsonl")
    if os.path.isfile(os.path.join(hf_dir, "config.json")) and os.path.isfile(data):
        return hf_dir, data
    examples = chat_examples(n_examples, seed)
    tok = tiny_tokenizer(hf_dir, corpus_of(examples) * 4, vocab_size=384)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64 * math.ceil(len(tok) / 64), hidden_size=128,
                                      intermediate_size=344, num_hidden_layers=4,
                                      num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    with open(data, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in examples)
    return hf_dir, data


def plot_curves(records: list[dict], path: str, title: str) -> None:
    """Train loss per step and held-out loss per evaluation, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss (target tokens)", lw=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="held-out loss (response tokens)", ms=3)
    ax.set(xlabel="step", ylabel="cross-entropy (nats / token, log scale)", title=title,
           yscale="log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def greedy_sample(hf_dir: str, messages: list[dict], max_new_tokens: int = 24,
                  adapter: str | None = None) -> str:
    """The exported model's greedy answer to ``messages`` (a chat without its last assistant turn),
    through transformers' own ``from_pretrained`` / ``apply_chat_template`` / ``generate``; with
    ``adapter`` (a PEFT LoRA directory) the base at ``hf_dir`` with the adapter, as
    ``peft.PeftModel.from_pretrained`` loads it."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
