"""``zinf-fn inspect CKPT [--json]``: what a checkpoint holds, read from its manifest
(``checkpoints.read_manifest``): the model, the step, the formats, the placements it was trained
with, the bytes of each state kind, and the data position. CKPT may be a directory of checkpoints
(the newest is read)."""

from __future__ import annotations

import argparse
import json
import math

import torch

import checkpoints


def summary(path: str) -> dict:
    """The checkpoint at ``path`` (or the newest under it) in one JSON-able dict."""
    path = checkpoints.latest(path) or path
    m = checkpoints.read_manifest(path)
    extra = m.get("extra") or {}
    config = m.get("config") or {}
    hf = extra.get("hf_config") or {}
    params = sum(g["rows"] * g["numel"] for g in m["groups"].values())
    return {
        "path": path,
        "model": {"family": hf.get("model_type") or extra.get("family"), "n_layers": m["n_layers"],
                  "parameters": params,
                  "param_dtype": m["param_dtype"]},
        "step": m["step"],
        "world_size": m["world_size"],
        "formats": m.get("formats"),
        "placements": {k: config.get(k) for k in ("offload_params", "offload_optimizer",
                                                  "spill_params", "spill_optimizer", "master",
                                                  "frozen_storage")},
        "bytes": bytes_per_kind(m["arrays"]),
        "optimizer": m.get("optimizer"),
        "data": {"batches_consumed": m["step"], **(extra.get("data") or {})},
        "recipe": extra.get("recipe"),
    }


def bytes_per_kind(arrays: list[dict]) -> dict[str, int]:
    """State kind ("param", "master", "adam_m", ...) -> bytes over every group's array of it."""
    out: dict[str, int] = {}
    for a in arrays:
        kind = a["name"].split("/", 1)[1]
        out[kind] = out.get(kind, 0) + math.prod(a["shape"]) * getattr(torch, a["dtype"]).itemsize
    return out


def text(s: dict) -> str:
    """The summary as lines for a terminal."""
    model = s["model"]
    lines = [f"checkpoint {s['path']}",
             f"model      {model['family'] or 'a layers model'}, {model['n_layers']} layers, "
             f"{model['parameters']:,} parameters stored as {model['param_dtype']}",
             f"step       {s['step']} (written by {s['world_size']} rank(s)); data position: "
             f"{s['data']['batches_consumed']} batches consumed",
             f"formats    {json.dumps(s['formats'])}",
             f"placements {', '.join(f'{k}={v}' for k, v in s['placements'].items() if v)}",
             "bytes      " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in s["bytes"].items())]
    if s["optimizer"]:
        hyper = {k: v for k, v in s["optimizer"].items() if not isinstance(v, dict | list)}
        lines.append(f"optimizer  {hyper}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Print the summary of CKPT (``--json``: one JSON object)."""
    p = argparse.ArgumentParser(prog="zinf-fn inspect", description=__doc__.split("\n")[0])
    p.add_argument("ckpt", help="a checkpoint directory, or a directory of them (the newest)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    s = summary(args.ckpt)
    print(json.dumps(s) if args.json else text(s))
    return 0
