"""A tiny tokenizer and a few chat examples built on the spot: the default data of the example, the
tests and the benchmark (nothing is downloaded).

``tiny_tokenizer(directory, texts)`` trains a byte-level BPE with ``tokenizers`` on ``texts`` and
saves it with ``transformers.PreTrainedTokenizerFast.save_pretrained`` (``tokenizer.json`` and
``tokenizer_config.json``), with BOS/EOS/pad tokens and ``CHAT_TEMPLATE``, whose ``{% generation
%}`` markers let ``apply_chat_template(..., return_assistant_tokens_mask=True)`` mark the
assistant's tokens.
"""

from __future__ import annotations

import random

# Llama-3-like markup in plain words; the assistant's content and EOS are the generated (trained)
# tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>\n{% generation %}"
    "{{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}\n"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

_COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
_THINGS = ["apple", "sky", "leaf", "sun", "night", "snow", "carrot", "plum"]


def tiny_tokenizer(directory: str, texts: list[str], vocab_size: int = 512):
    """Train a byte-level BPE of at most ``vocab_size`` ids on ``texts``; save it to ``directory``
    and return the ``PreTrainedTokenizerFast`` (BOS ``<s>`` added in front by its post-processor, as
    Llama's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(directory)
    return fast


def chat_examples(n: int, seed: int = 0) -> list[dict]:
    """``n`` short conversations ``{"messages": [...]}`` with a learnable answer (a thing's
    colour)."""
    rng = random.Random(seed)
    colour = dict(zip(_THINGS, rng.sample(_COLOURS, len(_THINGS)), strict=True))
    out = []
    for _ in range(n):
        thing = rng.choice(_THINGS)
        messages = [
            {"role": "user", "content": f"What colour is the {thing}?"},
            {"role": "assistant", "content": f"The {thing} is {colour[thing]}."},
        ]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": "Answer in one short sentence."})
        out.append({"messages": messages})
    return out


def corpus_of(examples: list[dict]) -> list[str]:
    """The texts of chat examples (what ``tiny_tokenizer`` trains on)."""
    return [m["content"] for e in examples for m in e["messages"]]
