"""Flat specs: a tree <-> one flat buffer and back as views."""

from __future__ import annotations

import pytest
import torch

from zinf_fn.tree import check_same_spec, flat_spec, flatten_into_, unflatten


def _tree():
    return {
        "a": torch.arange(6.0).view(2, 3),
        "b": {"c": torch.tensor([7.0]), "d": torch.zeros(2, 2)},
    }


def test_round_trip_is_exact_and_views_share_storage():
    tree = _tree()
    spec = flat_spec(tree)
    assert spec.numel == 11
    assert [leaf.path for leaf in spec.leaves] == ["a", "b.c", "b.d"]
    flat = torch.full((13,), -1.0)
    flatten_into_(tree, spec, flat)
    back = unflatten(flat, spec)
    assert torch.equal(back["a"], tree["a"]) and torch.equal(back["b"]["c"], tree["b"]["c"])
    back["a"][0, 0] = 42.0
    assert flat[0] == 42.0 and flat[11] == -1.0  # a view, and the padding is untouched


def test_non_float_leaf_is_rejected_with_its_path():
    with pytest.raises(TypeError, match="'b.c'.*torch.int64"):
        flat_spec(
            {"a": torch.zeros(2), "b": {"c": torch.zeros(2, dtype=torch.long)}}, where="block"
        )


def test_spec_mismatch_names_the_key_path():
    other = _tree()
    other["b"]["d"] = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"'b.d'.*\(2, 2\).*\(3, 2\)"):
        check_same_spec(flat_spec(_tree()), flat_spec(other), where="block.init(gen, 2)")
