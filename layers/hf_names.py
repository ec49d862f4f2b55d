"""Translating tensor names through a family's (HF name, engine key path) table, ``{i}`` a layer
index; the dtype a ``config.json`` says its weights were saved in."""

from __future__ import annotations

from collections.abc import Mapping

HF_DTYPES = ("float32", "bfloat16", "float16")


def saved_dtype(hf: Mapping) -> str | None:
    """The dtype of the weights beside a ``config.json`` dict: its ``dtype`` (transformers >= 5) or
    older ``torch_dtype``, when one of ``HF_DTYPES``; else None (unknown: an exporter then picks its
    default)."""
    value = hf.get("dtype") or hf.get("torch_dtype")
    return value if value in HF_DTYPES else None


def translate(name: str, table: dict, layer_prefix: str, family: str, what: str, side: str) -> str:
    """``table[name]``, where a layer's names are looked up with their index as ``{i}``
    (``layer_prefix`` is what precedes the index: ``"model.layers."``, ``"blocks."``). Raises
    ``ValueError`` naming ``name`` (not a ``what`` name, e.g. "Llama-family HF") and every known
    name for anything else."""
    parts = name.split(".")
    n_prefix = layer_prefix.count(".")
    if name.startswith(layer_prefix) and len(parts) > n_prefix and parts[n_prefix].isdigit():
        i = parts[n_prefix]
        template = ".".join([*parts[:n_prefix], "{i}", *parts[n_prefix + 1 :]])
        if template in table:
            return table[template].format(i=i)
    elif name in table:
        return table[name]
    known = ", ".join(sorted(table))
    raise ValueError(
        f"{family}: {name!r} is not a {what} {side} name; expected one of {known} "
        f"({{i}} a layer index)"
    )
