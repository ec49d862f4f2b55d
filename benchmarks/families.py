"""The families' table: every HF family the project reads, imported, trained and exported against
transformers on a tiny random model.

    python benchmarks/families.py [--quick] [--family NAME ...]

For each family the tiny fp32 model of tests/hf_reference.py (built from transformers' config class,
random weights, nothing downloaded) is saved by ``save_pretrained`` and read by
``checkpoints.from_hf``; one JSON line per family gives:

- ``params``: the HF model's parameters (a tied embedding counted once);
- ``logits_rel_err``: max |ours - transformers'| / max |transformers'| of the logits of one batch;
- ``train_rel_err``: after 3 steps of ``torch.optim.AdamW(fused=True)`` on both sides (transformers'
  model, the engine at placement none, fp32), the largest over the HF tensors of max |ours - theirs|
  / max |theirs| (ours read back by ``from_pretrained`` from ``to_hf``'s fp32 export);
  ``loss_rel_err`` the largest relative difference of the 3 losses;
- ``export_bitwise``: ``to_hf`` (fp32) of the untrained import holds the source's tensors, names
  and values, bit for bit.

``--quick`` is the same run (the models are tiny either way; it exists so that every benchmark
takes the flag). The last line is a JSON summary (the worst of each error, whether every export
was bitwise). The tests assert these bounds (tests/models/test_dense_families.py,
test_moe_families.py, test_hf_import.py, test_gpt2_hf.py); this prints the figures.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
import transformers  # noqa: E402
from hf_reference import hf_model, train_engine  # noqa: E402
from hf_workers import adamw, fp32_config  # noqa: E402
from llama_reference import train_hf  # noqa: E402
from reference import make_batches  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import checkpoints  # noqa: E402
import zinf_fn as zf  # noqa: E402
from layers import gpt, llama  # noqa: E402

STEPS = 3
# the table's family -> its tiny model in tests/hf_reference.py
FAMILIES = {
    "llama": "llama3",
    "mistral": "mistral_w4",
    "qwen2": "qwen2",
    "gpt2": "gpt2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3": "gemma3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
    "gpt_oss": "gpt_oss",
}


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| / max |theirs|."""
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


def file_tensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files, by name."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        out.update(load_file(path))
    return out


def our_logits(model, state, inputs: torch.Tensor) -> torch.Tensor:
    """The engine model's logits of ``inputs`` from its gathered weights."""
    family = llama if isinstance(model.config, llama.Config) else gpt
    return family.logits(zf.gather_params(state), model.config, inputs)


def bitwise(ours: dict, theirs: dict) -> bool:
    """The same tensor names, each equal bit for bit (dtype included)."""
    return ours.keys() == theirs.keys() and all(
        ours[n].dtype == t.dtype and torch.equal(ours[n], t) for n, t in theirs.items()
    )


def measure(name: str, work: str) -> dict:
    """One family's line of the table (module docstring); files under ``work``."""
    hf = hf_model(FAMILIES[name])
    source = os.path.join(work, "hf")
    hf.save_pretrained(source)
    model, state = checkpoints.from_hf(source, adamw(), fp32_config())
    checkpoints.to_hf(state, os.path.join(work, "init"), torch.float32)
    batches = make_batches(model.config, STEPS, batch_size=4, seed=1)
    with torch.no_grad():
        logits_err = rel_err(
            our_logits(model, state, batches[0]["inputs"]),
            hf(input_ids=batches[0]["inputs"]).logits,
        )
    ref_losses = train_hf(hf, batches)
    state, losses, _ = train_engine(state, batches)
    checkpoints.to_hf(state, os.path.join(work, "trained"), torch.float32)
    back = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(work, "trained"))
    trained = back.state_dict()
    train_err = max(rel_err(trained[n], t) for n, t in hf.state_dict().items())
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    return {
        "family": name,
        "model_type": hf.config.model_type,
        "params": sum(p.numel() for p in hf.parameters()),
        "logits_rel_err": logits_err,
        "train_rel_err": train_err,
        "loss_rel_err": loss_err,
        "export_bitwise": bitwise(file_tensors(os.path.join(work, "init")), file_tensors(source)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the same run (the models are tiny)")
    p.add_argument("--family", nargs="*", choices=sorted(FAMILIES), default=list(FAMILIES))
    args = p.parse_args()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()  # the tiny configs' out-of-vocabulary ids
    rows = []
    for name in args.family:
        with tempfile.TemporaryDirectory() as work:
            rows.append(measure(name, work))
        print(json.dumps(rows[-1]), flush=True)
    print(
        json.dumps(
            {
                "metric": "families",
                "families": len(rows),
                "max_logits_rel_err": max(r["logits_rel_err"] for r in rows),
                "max_train_rel_err": max(r["train_rel_err"] for r in rows),
                "max_loss_rel_err": max(r["loss_rel_err"] for r in rows),
                "all_exports_bitwise": all(r["export_bitwise"] for r in rows),
            }
        )
    )


if __name__ == "__main__":
    main()
