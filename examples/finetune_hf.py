"""Fine-tune a local Hugging Face checkpoint on your own data: ``zinf-fn finetune``, same flags.

    python examples/finetune_hf.py          # a small random Llama and chat data made here
    python examples/finetune_hf.py --hf-dir ~/models/Llama-3.2-1B-Instruct --data train.jsonl \\
        --format chat --steps 1000 --pack --seq-len 1024 --placement nvme --nvme-path /mnt/nvme/ft
    python examples/finetune_hf.py ... --lora-rank 8 --lora-alpha 16 --lora-targets attn.q attn.v

The same in the Python API (``zinf_cli/finetune.py`` adds the data, recipes, eval, export)::

    transform = lambda m: lora.apply(m, rank=8, alpha=16, targets=("attn.q", "attn.v"))
    model, state = checkpoints.from_hf(hf_dir, zf.adamw(lr=2e-4), zf.Config(offload_params="nvme",
                                       nvme_path=path), transform=transform)
    for batch in zinf_data.Batches(...).from_(0):
        state, metrics = zf.train_step(state, batch)
    checkpoints.to_peft(state, "adapter")
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zinf_cli.finetune import main  # noqa: E402

if __name__ == "__main__":
    main()
