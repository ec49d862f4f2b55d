"""Every manifest field is bounded and known: mutations derived from ``MANIFEST_SCHEMA`` itself.

The test walks the schema beside a real manifest (a tied, tiled model with int8 moments and a
remainder master: every part of the schema holds a value) and makes, for each field, the wrong
values its schema node implies: another JSON type, an int out of its range (2^64 among them), a
string or constant that is not one of the known values, a required key deleted, an unknown key
added, an item listed twice in a list that names groups, and for a ``Validated`` object (the
saving run's config, held to ``zf.Config``'s own checks; a known optimizer's hyperparameters, to
its factory's) each field set to what that rule refuses. Each must make ``read_manifest`` raise
CheckpointError naming the field. A new field gets its cases by being in the schema; a new kind of
schema node fails the walk until it has them. Values the schema accepts but the model may not
(another valid int, a free string) are restored in full: refused, or bitwise the saved rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from ckpt_workers import CFG, config, int8_opt, local_rows, model, train
from engine_helpers import batches
from manifest_edits import DELETE, edited, write_json

import checkpoints
import zinf_fn as zf
from checkpoints import schema as S
from checkpoints.manifest import MANIFEST, MANIFEST_SCHEMA

TIED_TILED = dataclasses.replace(CFG, tie_embeddings=True, mlp_tiles=3)
CANDIDATES = [
    7,
    -1,
    1.5,
    "",
    "../x",
    "NaN",
    "x" * 5000,
    True,
    None,
    [],
    {},
    [1, 1],
]  # for AnyOf and Const


class Mutation:
    """One edit of the manifest: the key path, what kind of wrong it is, the new value (or
    DELETE), and the field the schema error names (an ``AnyOf`` reports its own field for anything
    under it)."""

    def __init__(self, path: tuple, kind: str, value, reported: str):
        self.path, self.kind, self.value, self.reported = path, kind, value, reported

    def __repr__(self) -> str:
        return f"{self.kind} at {self.reported}: {S.short_repr(self.value)}"


def string_candidates(value) -> list[str]:
    """Strings a string field set to ``value`` may not take: empty, a path, a number, a near
    miss."""
    return ["", "../x", "NaN", f"{value}x", "7"]


def refused(node, value) -> bool:
    try:
        node.check(value, "")
    except S.SchemaError:
        return True
    return False


def wrong_values(node, value) -> list[tuple[str, object]]:
    """(kind of wrong, value) that ``node`` refuses, derived from what the node is."""
    if isinstance(node, S.Int):
        out = [
            ("wrong type", str(value)),
            ("wrong type", value + 0.5),
            ("wrong type", True),
            ("out of range", node.lo - 1),
            ("out of range", node.hi + 1),
            ("out of range", 2**64),
        ]
    elif isinstance(node, S.Float):
        out = [("wrong type", "1.0"), ("wrong type", True), ("wrong type", None)]
        out += [("out of range", node.lo - 1.0)] if node.lo is not None else []
        out += [("out of range", node.hi + 1.0)] if node.hi is not None else []
    elif isinstance(node, S.Str):
        out = [
            ("wrong type", 7),
            ("wrong type", None),
            ("wrong type", True),
            ("too long", "x" * (node.max_len + 1)),
        ]
        out += [("unknown value", v) for v in string_candidates(value)]
    elif isinstance(node, S.Bool | S.Null):
        out = [("wrong type", v) for v in (0, "true", "", None, False)]
    elif isinstance(node, S.Const | S.AnyOf):
        out = [("unknown value", v) for v in CANDIDATES]
    elif isinstance(node, S.List):
        out = [("wrong type", "list"), ("wrong type", {})]
        out += [("duplicate", value + value[:1])] if node.unique and value else []
        out += [("too short", [])] if node.min_len else []
    elif isinstance(node, S.Obj):
        out = [("wrong type", []), ("extra key", {**value, "unexpected": 1})]
    elif isinstance(node, S.Map):
        out = [
            ("wrong type", []),
            ("unknown key", {**value, "../x": next(iter(value.values()), None)}),
        ]
    elif isinstance(node, S.Json | S.Validated):
        out = []  # a Validated's wrong values are its fields' (_validated_mutations)
    else:
        raise AssertionError(
            f"a schema node {type(node).__name__} without its mutations: add them here"
        )
    return [(kind, v) for kind, v in out if refused(node, v)]


def mutations(node, value, path=(), field="", outer=None):
    """Every schema-refused Mutation of ``value`` (held to ``node``) and of everything under it;
    ``outer``: (the enclosing AnyOf, its value, path and field), which must refuse it as a whole."""
    for m in _own_mutations(node, value, path, field):
        if outer is None:
            yield m
        elif refused(outer[0], edited(outer[1], m.path[len(outer[2]) :], m.value)):
            yield Mutation(m.path, m.kind, m.value, outer[3])  # reported at the AnyOf
    if isinstance(node, S.Obj):
        for key in value:
            child = node.required.get(key) or node.optional[key]
            yield from mutations(child, value[key], (*path, key), S.join(field, key), outer)
    elif isinstance(node, S.Map):
        for key, item in value.items():
            yield from mutations(node.value, item, (*path, key), S.join(field, key), outer)
    elif isinstance(node, S.List):
        for i, item in enumerate(value):
            yield from mutations(node.item, item, (*path, i), f"{field}[{i}]", outer)
    elif isinstance(node, S.AnyOf):
        option = next(o for o in node.options if not refused(o, value))
        yield from mutations(option, value, path, field, outer or (node, value, path, field))
    elif isinstance(node, S.Validated):
        yield from mutations(node.inner, value, path, field, outer)


def _own_mutations(node, value, path: tuple, field: str):
    for kind, new in wrong_values(node, value):
        yield Mutation(path, kind, new, field)
    if isinstance(node, S.Obj):
        for key in node.required:
            yield Mutation((*path, key), "missing", DELETE, S.join(field, key))
    if isinstance(node, S.Validated):
        yield from _validated_mutations(node, value, path, field)


def _validated_mutations(node, value: dict, path: tuple, field: str):
    """A ``Validated`` object's fields set to values its own rule refuses (the engine's: each
    field's fuzz comes from the rule, whatever the field), named by the field."""
    for key, old in value.items():
        near = string_candidates(old) if isinstance(old, str) else []
        near += [0, old - 1] if S.is_int(old) else []
        for new in [*CANDIDATES, *near]:
            if not refused(node.inner, edited(value, (key,), new)) and refused(
                node, edited(value, (key,), new)
            ):
                yield Mutation((*path, key), "refused by its rule", new, S.join(field, key))


def accepted_values(node, value) -> list:
    """Other values ``node`` accepts (the model decides): at most one per leaf."""
    if isinstance(node, S.Int):
        candidates = [value + 1, node.lo if node.lo > -(2**40) else 0]
    elif isinstance(node, S.Float):
        candidates = [value * 2 + 1]
    elif isinstance(node, S.Str):
        candidates = [f"{value}x", *(node.choices or ())]
    elif isinstance(node, S.Bool):
        candidates = [not value]
    else:
        return []
    return [c for c in candidates if c != value and not refused(node, c)][:1]


def leaves(node, value, path=()):
    """(path, accepted other value) for every leaf under ``node``, and each optional key deleted."""
    if isinstance(node, S.AnyOf):
        yield from leaves(next(o for o in node.options if not refused(o, value)), value, path)
    elif isinstance(node, S.Validated):
        yield from leaves(node.inner, value, path)
    elif isinstance(node, S.Obj):
        for key in value:
            if key in node.optional:
                yield (*path, key), DELETE
            yield from leaves(
                node.required.get(key) or node.optional[key], value[key], (*path, key)
            )
    elif isinstance(node, S.Map | S.List):
        items = value.items() if isinstance(node, S.Map) else enumerate(value)
        for key, item in items:
            yield from leaves(
                node.value if isinstance(node, S.Map) else node.item, item, (*path, key)
            )
    else:
        for new in accepted_values(node, value):
            yield path, new


def _run():
    return model(TIED_TILED), int8_opt(), config("cpu", master="remainder")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint, its manifest, its rows): every part of the schema holds a value in it."""
    state = train(zf.init(*_run(), seed=0), batches(1))[0]
    path = checkpoints.save(tmp_path_factory.mktemp("schema") / "good", state)
    manifest = checkpoints.read_manifest(path)
    assert manifest["ties"] and manifest["tiles"] and manifest["formats"]["compressed"]
    return path, manifest, local_rows(state)


def _write(directory: str, doc) -> None:
    write_json(os.path.join(directory, MANIFEST), doc)


def test_every_mutation_the_schema_implies_is_refused_naming_the_field(saved, tmp_path):
    _, manifest, _ = saved
    case = str(tmp_path / "case")
    os.makedirs(case)
    found = list(mutations(MANIFEST_SCHEMA, manifest))
    kinds = {m.kind for m in found}
    assert kinds >= {
        "wrong type",
        "out of range",
        "unknown value",
        "missing",
        "duplicate",
        "extra key",
        "unknown key",
        "refused by its rule",
    }, kinds
    for m in found:
        if not m.path:
            continue  # the whole document: test_checkpoints_untrusted_edits
        _write(case, edited(manifest, m.path, m.value))
        with pytest.raises(checkpoints.CheckpointError) as err:
            checkpoints.read_manifest(case)
        assert m.reported in str(err.value), (m, str(err.value))
    issue = {
        (m.reported, json.dumps(m.value)) for m in found if m.value is not DELETE
    }  # issue 35 names these
    assert ("step", json.dumps(2**64)) in issue
    for bad in (7, "", "../x", "NaN"):
        assert ("formats.moments.rounding", json.dumps(bad)) in issue, bad
    assert any(m.reported == "formats.compressed" and m.kind == "duplicate" for m in found)
    for name, bad in (
        ("device", "NaN"),
        ("device", "../x"),
        ("offload_params", "cpux"),
        ("frozen_storage", "7"),
        ("partition", ""),
    ):  # issue 35: any string
        assert (f"config.{name}", json.dumps(bad)) in issue, (name, bad)
    rules = {m.path for m in found if m.kind == "refused by its rule"}  # zf.adamw's own checks
    assert {("optimizer", "b1"), ("optimizer", "moments")} <= rules, rules
    for key in ("ties", "formats"):  # optional in format version 1 only
        _write(case, edited(manifest, (key,), DELETE))
        with pytest.raises(checkpoints.CheckpointError, match=f"field {key}: expected"):
            checkpoints.read_manifest(case)


def test_every_value_the_schema_accepts_restores_the_same_or_is_refused(saved, tmp_path):
    good, manifest, rows = saved
    case = str(tmp_path / "case")
    shutil.copytree(good, case)
    edits = [*leaves(MANIFEST_SCHEMA, manifest), (("optimizer", "unexpected"), 0.5)]
    outcomes = {}
    for path, new in edits:
        _write(case, edited(manifest, path, new))
        try:
            state = checkpoints.restore(case, *_run())
        except checkpoints.CheckpointError as e:
            outcomes[path] = f"refused: {e}"
            continue
        back = local_rows(state)
        zf.close(state)
        assert all(torch.equal(back[k], rows[k]) for k in rows), (path, new)
        outcomes[path] = "same"
    assert (
        "optimizer: expected the hyperparameters of 'adamw'"
        in outcomes[("optimizer", "unexpected")]
    )
    assert (
        outcomes[("optimizer", "lr")] == "same"
    )  # a new learning rate is the restoring optimizer's
    assert outcomes[("ties",)].startswith("refused") and outcomes[("formats",)].startswith(
        "refused"
    )


def test_a_key_given_twice_is_refused_not_silently_the_last(saved, tmp_path):
    _, manifest, _ = saved
    case = str(tmp_path / "case")
    os.makedirs(case)
    text = json.dumps(manifest)
    with open(os.path.join(case, MANIFEST), "w") as f:  # a later "step" would silently win
        f.write(text[:-1] + ', "step": 7}')
    with pytest.raises(checkpoints.CheckpointError, match="the key 'step' is given twice"):
        checkpoints.read_manifest(case)


def test_every_config_a_run_can_have_is_accepted():
    """The config's string patterns refuse nothing zf.Config takes: every string field set (paths
    with spaces, a CUDA device by index, spills, the non-default choices)."""
    from checkpoints.manifest_schema import CONFIG

    run = zf.Config(
        offload_params="cpu",
        offload_optimizer="nvme",
        nvme_path="/data/my run/nvme",
        device="cuda:1",
        trace="/tmp/trace 1.json",
        partition="allgather",
        nvme_engine="tensorstore",
        spill_params="3:nvme",
        spill_optimizer=None,
        master="remainder",
        param_rounding="ties_away",
        frozen_storage="nf4",
        offload_activations="cpu",
        compute_dtype=torch.float16,
        clip_grad_norm=1.0,
    )
    described = run.describe()
    assert all(
        described[f.name] is not None
        for f in dataclasses.fields(zf.Config)
        if f.type.startswith("str") and f.name != "spill_optimizer"
    )
    S.check(CONFIG, described, "config")
    S.check(
        CONFIG,
        {**described, "device": "cpu", "spill_optimizer": "3:nvme", "offload_optimizer": "cpu"},
        "config",
    )
    S.check(CONFIG, zf.Config(nvme_path="", trace="").describe(), "config")  # empty paths
