"""``zinf-fn convert``: Hugging Face / PEFT / safetensors conversion (``python -m checkpoints``).

    zinf-fn convert hf import HF_DIR CKPT_DIR [--placement cpu|nvme|none] [--param-dtype bf16|fp32]
    zinf-fn convert hf export CKPT_DIR OUT_DIR [--dtype bf16|fp16|fp32] [--hf-config CONFIG_JSON]
    zinf-fn convert export CKPT OUT.safetensors [--dtype ...]

The commands are the checkpoints package's own (``checkpoints/hf_cli.py``,
``checkpoints/export.py``).
"""

from __future__ import annotations

from checkpoints.__main__ import main as checkpoints_main


def main(argv=None) -> int:
    """Run ``python -m checkpoints argv``; its exit status."""
    return checkpoints_main(argv) or 0
