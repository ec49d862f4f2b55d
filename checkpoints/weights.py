"""Import: a fresh TrainState initialised from named weights (a safetensors file or a torch
state_dict).

Names are full key paths, as ``checkpoints.export`` writes them: ``embed.tok.w``,
``blocks.3.attn.qkv.w``, ``head.lm_head.w``. ``rename`` maps other tools' names onto them (e.g. an
``nn.Module``'s ``blocks.3.attn.qkv.weight``). The optimizer state starts as ``optimizer.init``
makes it (step 0 unless given), exactly as ``zf.init`` would have, only with these weights: like
``zf.init`` the model is built one layer at a time, keeping this rank's shard (or, in "broadcast"
mode, the layers it owns). A weight the model tiles is given whole and cut into its tiles here. A
tied weight (``zf.Tie``) is read from its embed name; a source that also has it under the head's
name (``nn.Module.state_dict()`` of a tied model lists both, ``lm_head.weight`` beside
``model.embed_tokens.weight``) has that copy skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from zinf_fn.model import tied_leaf
from zinf_fn.state import StateView, TrainState, empty_state, init_unit, units, view

from .manifest import CheckpointError
from .safetensors_io import Reader


def from_safetensors(
    path: str,
    model,
    optimizer,
    config=None,
    *,
    rename: Callable[[str], str] | None = None,
    step: int = 0,
) -> TrainState:
    """A state whose weights are the tensors of the safetensors file at ``path`` (read one at a
    time)."""
    reader = Reader(path)
    return _from_source(
        reader.names(), reader.shape, reader.get, model, optimizer, config, rename, step, path
    )


def from_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    model,
    optimizer,
    config=None,
    *,
    rename: Callable[[str], str] | None = None,
    step: int = 0,
) -> TrainState:
    """A state whose weights are ``state_dict``'s tensors (any dtype and device; copied, not
    kept)."""

    def shape(name):
        return tuple(state_dict[name].shape)

    return _from_source(
        list(state_dict),
        shape,
        state_dict.__getitem__,
        model,
        optimizer,
        config,
        rename,
        step,
        "state_dict",
    )


def _from_source(
    names,
    shape_of,
    get,
    model,
    optimizer,
    config,
    rename,
    step,
    where,
    locate=None,
    init_seed: int | None = None,
) -> TrainState:
    """Fill a fresh state from ``get(name)``, one source tensor at a time; ``locate(name)``, if
    given, says where a source tensor lives (file and tensor name) in shape errors, else ``where``
    does. ``init_seed``: leaves the source lacks are not an error but take the values
    ``zf.init(model, seed=init_seed)`` gives them (their unit's init runs once, one unit at a time;
    e.g. the LoRA leaves a ``from_hf`` transform adds)."""
    ours = {(rename(n) if rename else n): n for n in names}
    state = empty_state(model, optimizer, config, step=step)
    store = view(state)
    for tie in store.ties:  # the head's copy of a tied weight: the embed's is the one read
        ours.pop(f"{units(store.n_layers)[-1].name}.{tie.head}", None)
    _check_names(_wanted(store), ours, shape_of, where, locate, missing_ok=init_seed is not None)
    for unit in units(
        store.n_layers
    ):  # every row of the unit (its frozen row and tiles too), as zf.init writes them
        store.load_unit_(unit, _unit_source(model, unit, ours, get, init_seed))
    return state


def _unit_source(model, unit, ours: dict, get, init_seed: int | None):
    """``source(path)``: the tensor of ``unit``'s leaf ``path`` from the source, or (a leaf the
    source lacks, with ``init_seed``) from the unit's init tree, built once on first need."""
    made: list = []

    def source(path: str) -> torch.Tensor:
        full = f"{unit.name}.{path}"
        if full in ours:
            return get(ours[full])
        if not made:
            made.append(init_unit(model, unit, init_seed))
        value = tied_leaf(made[0], path, f"{unit.name} init tree")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{full}: the source lacks this leaf and its init made a tiled "
                f"{type(value).__name__}; expected a leaf the source lacks to be an untiled tensor"
            )
        return value

    return source


def _wanted(store: StateView) -> dict[str, tuple[int, ...]]:
    """Full key path -> shape of every weight of the model (a tiled weight whole)."""
    return {
        f"{unit.name}.{path}": shape
        for unit in units(store.n_layers)
        for path, shape in store.leaf_shapes(unit).items()
    }


def _check_names(
    wanted: dict, ours: dict, shape_of, where: str, locate=None, missing_ok: bool = False
) -> None:
    """Raise one CheckpointError (a ValueError) listing every missing (unless ``missing_ok``),
    unexpected or mis-shaped key path."""
    locate = locate or (lambda name: where)
    problems = [
        f"{n}: missing (the model wants shape {wanted[n]})"
        for n in wanted
        if n not in ours and not missing_ok
    ]
    problems += [f"{n}: not a parameter of this model" for n in ours if n not in wanted]
    problems += [
        f"{n}: shape {tuple(shape_of(ours[n]))} in {locate(ours[n])}, the model wants {wanted[n]}"
        for n in wanted
        if n in ours and tuple(shape_of(ours[n])) != tuple(wanted[n])
    ]
    if problems:
        raise CheckpointError(
            f"cannot initialise from {where}:\n  " + "\n  ".join(sorted(problems))
        )
