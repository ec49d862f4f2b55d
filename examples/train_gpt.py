"""Train a small byte-level GPT with zinf-fn: the project's default run, as ``zinf-fn train``.

    python examples/train_gpt.py                       # stdlib sources, ~1-2 minutes on 2 CPU cores
    python examples/train_gpt.py --offload cpu --steps 100
    torchrun --nproc-per-node 2 examples/train_gpt.py  # data parallel, each rank on its slice
    python examples/train_gpt.py --save-every 50 --resume runs/train_gpt

The loop itself, in the Python API (``zinf_cli/pretrain.py`` adds recipes, checkpoints, trackers)::

    model = gpt.model(gpt.Config(vocab_size=256, d_model=128, n_heads=4, n_layers=4, seq_len=128))
    state = zf.init(model, zf.adamw(lr=3e-3, weight_decay=0.1), zf.Config(clip_grad_norm=1.0))
    for batch in batches:
        state, metrics = zf.train_step(state, batch)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zinf_cli.pretrain import main  # noqa: E402

if __name__ == "__main__":
    main()
