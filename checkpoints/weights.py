"""Import: a fresh TrainState initialised from named weights (a safetensors file or a torch state_dict).

Names are full key paths, as ``checkpoints.export`` writes them: ``embed.tok.w``, ``blocks.3.attn.qkv.w``,
``head.lm_head.w``. ``rename`` maps other tools' names onto them (e.g. an ``nn.Module``'s
``blocks.3.attn.qkv.weight``). The optimizer state starts as ``optimizer.init`` makes it (step 0 unless
given), exactly as ``zf.init`` would have, only with these weights: like ``zf.init`` the model is built
one layer at a time, keeping this rank's shard.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from zinf_fn.store import key, units
from zinf_fn.train import TrainState, empty_state

from .safetensors_io import Reader


def from_safetensors(path: str, model, optimizer, config=None, *, rename: Callable[[str], str] | None = None,
                     step: int = 0) -> TrainState:
    """A state whose weights are the tensors of the safetensors file at ``path`` (read one at a time)."""
    reader = Reader(path)
    return _from_source(reader.names(), reader.shape, reader.get, model, optimizer, config, rename, step, path)


def from_state_dict(state_dict: Mapping[str, torch.Tensor], model, optimizer, config=None, *,
                    rename: Callable[[str], str] | None = None, step: int = 0) -> TrainState:
    """A state whose weights are ``state_dict``'s tensors (any dtype and device; copied, not kept)."""
    def shape(name):
        return tuple(state_dict[name].shape)

    return _from_source(list(state_dict), shape, state_dict.__getitem__, model, optimizer, config, rename, step,
                        "state_dict")


def _from_source(names, shape_of, get, model, optimizer, config, rename, step, where) -> TrainState:
    ours = {(rename(n) if rename else n): n for n in names}
    state = empty_state(model, optimizer, config, step=step)
    layers = _layer_names(state)
    _check_names(layers, ours, shape_of, where)
    for unit, group, leaves in layers:
        flat = torch.zeros(group.part.padded_numel, dtype=torch.float32)
        for name, leaf in leaves:
            flat[leaf.offset : leaf.offset + leaf.numel].copy_(get(ours[name]).reshape(-1))
        _write_unit_(state, unit, flat)
    return state


def _layer_names(state) -> list:
    """(unit, group, [(full key path, LeafSpec), ...]) for every layer, in scan order."""
    store = state.runtime.store
    out = []
    for unit in units(state.model.n_layers):
        group = store.groups[unit.group]
        out.append((unit, group, [(f"{unit.name}.{leaf.path}", leaf) for leaf in group.spec.leaves]))
    return out


def _check_names(layers, ours: dict, shape_of, where: str) -> None:
    """Raise one ValueError listing every missing, unexpected or mis-shaped key path."""
    wanted = {name: leaf.shape for _, _, leaves in layers for name, leaf in leaves}
    problems = [f"{n}: missing (the model wants shape {wanted[n]})" for n in wanted if n not in ours]
    problems += [f"{n}: not a parameter of this model" for n in ours if n not in wanted]
    problems += [f"{n}: shape {tuple(shape_of(ours[n]))} in {where}, the model wants {wanted[n]}"
                 for n in wanted if n in ours and tuple(shape_of(ours[n])) != tuple(wanted[n])]
    if problems:
        raise ValueError(f"cannot initialise from {where}:\n  " + "\n  ".join(sorted(problems)))


def _write_unit_(state, unit, flat: torch.Tensor) -> None:
    """Write this rank's shard of ``flat`` as master, fresh optimizer state and the 16-bit copy."""
    runtime = state.runtime
    store, rank = runtime.store, runtime.comm.rank
    start, end = store.groups[unit.group].part.shard_range(rank)
    master = flat[start:end].to(runtime.updater.opt_device)
    store.opt_tier.write_(key(unit.group, "master"), unit.row, master).result()   # sync: written
    for i, leaf in enumerate(state.optimizer.init(master)):
        store.opt_tier.write_(key(unit.group, f"opt.{i}"), unit.row, leaf).result()   # sync: written
    param = master.to(store.param_dtype)
    store.param_tier.write_(key(unit.group, "param"), unit.row, param).result()   # sync: written
