"""What every rank must agree on before the first collective: model structure, config, optimizer,
seed.

``zf.init`` builds a flat fingerprint on each rank, exchanges it once (``all_gather_object``) and
checks it with ``check_agreement``: a mismatch raises the same ``ValueError`` on every rank, naming
each differing field and every rank's value, instead of a deadlock or a silently wrong model later.

Rank-local config fields are left out: ``nvme_path`` (each rank's own local disk), ``device`` (each
rank's own GPU, ``cuda:<local rank>``) and ``trace`` (each rank writes its own trace file).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from ..layout.units import BLOCKS, unit_name

RANK_LOCAL_CONFIG = ("nvme_path", "device", "trace")
MAX_REPORTED = 8


def fingerprint(groups: Iterable, n_layers: int, config, optimizer, seed: int) -> dict[str, object]:
    """Flat ``{field: value}`` of everything that must agree across ranks (plain, picklable data).

    ``groups`` are the store's ``Group``s (name, rows, spec, part); the weight-decay mask, a
    predicate, is fingerprinted by the key paths it selects.
    """
    out: dict[str, object] = {"seed": seed, "model.n_layers": n_layers}
    decayed = []
    for group in groups:
        out[f"model.{group.name}.numel"] = group.spec.numel
        for path, shape in group.spec.describe():
            out[f"model.{group.name}.{path}"] = shape
        rows = range(group.rows) if group.name == BLOCKS else [0]
        prefixes = [f"{unit_name(group.name, i)}." for i in rows]
        mask = optimizer.weight_decay_mask
        if mask is not None:
            decayed += [
                p + path for p in prefixes for path, _ in group.spec.describe() if mask(p + path)
            ]
    for name, value in config.describe().items():
        if name not in RANK_LOCAL_CONFIG:
            out[f"config.{name}"] = value
    for name, value in (optimizer.hyperparams or {}).items():
        out[f"optimizer.{name}"] = value
    digest = hashlib.sha1("\n".join(decayed).encode()).hexdigest()[:12]
    out["optimizer.weight_decay_mask"] = (
        "none"
        if optimizer.weight_decay_mask is None
        else (f"{len(decayed)} decayed leaves, sha1 {digest}")
    )
    return out


def check_agreement(fingerprints: list[dict], where: str = "zf.init") -> None:
    """Raise a ValueError naming every field on which the ranks' fingerprints differ."""
    fields = sorted(set().union(*fingerprints), key=_field_order)
    lines = []
    for field in fields:
        values = [fp.get(field, "<absent>") for fp in fingerprints]
        if any(v != values[0] for v in values[1:]):
            lines.append(f"  {field}: {_by_value(values)}")
    if not lines:
        return
    more = f"\n  ... and {len(lines) - MAX_REPORTED} more" if len(lines) > MAX_REPORTED else ""
    raise ValueError(
        f"{where}: the {len(fingerprints)} ranks disagree on {len(lines)} field(s); every rank "
        "must build the same "
        f"model, zf.Config, optimizer and seed (only {', '.join(RANK_LOCAL_CONFIG)} may differ):\n"
        + "\n".join(lines[:MAX_REPORTED])
        + more
    )


def _by_value(values: list) -> str:
    """'rank 0: 1, rank 1: 2', grouping ranks that share a value ('ranks [0, 2]: 1; ...')."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), []).append(rank)
    parts = [f"rank {r[0]}: {v}" if len(r) == 1 else f"ranks {r}: {v}" for v, r in groups.items()]
    return "; ".join(parts)


def _field_order(field: str) -> tuple:
    head = field.split(".")[0]
    return ({"seed": 0, "config": 1, "optimizer": 2, "model": 3}.get(head, 4), field)
