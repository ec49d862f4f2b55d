"""The manifest's schema (``MANIFEST_SCHEMA``): every field's type and bounds, no field unknown.

Every string is one of its known values or matches a documented pattern: names of groups, arrays,
state kinds and dtypes by their own patterns and choices; key paths and descriptions printable; the
saving run's ``config`` field by field as ``zf.Config.describe()`` writes it (its device a torch
device, its paths without NUL, its spills ``'<k>:<placement>'``, its other strings lower-case
names), then as a whole by the engine's own checks (``zf.Config``: every choice, every number's
range, how the fields go together), and a known optimizer's hyperparameters by its factory's
(``zf.adamw``: ``b1`` in [0, 1), ``moments`` a format it knows, ...), so that each rule is written
once, where the engine takes the value. Every list that names groups, leaves, arrays or ties
names none twice. The one free field is ``extra``: the user's own JSON (bounded by
``schema.load_json``).
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import zinf_fn as zf
from zinf_fn.state import Formats

from .arrays import DTYPE_NAMES, TORCH_DTYPES
from .schema import (
    INT64_MAX,
    AnyOf,
    Bool,
    Const,
    Float,
    Int,
    Json,
    List,
    Map,
    Null,
    Obj,
    SchemaError,
    Str,
    Validated,
    join,
)

FORMAT = "zinf-fn-checkpoint"
FORMAT_VERSION = 2
PRINTABLE = r"[^\x00-\x1f\x7f]+"  # no control character (no NUL, no newline)
KEY_PATH = Str(PRINTABLE, max_len=1024, what="a key path (printable characters)")
TEXT = Str(PRINTABLE, what="a line of printable text")
GROUP_NAME = Str(
    r"(embed|blocks|head)(:[^\x00-\x1f\x7f]+)?",
    max_len=1024,
    what="a group name: 'embed', 'blocks', 'head' or '<one of them>:<tiled leaf path>'",
)
# <group dir>/<kind>, neither part "." or "..", no NUL: the name is a path under the checkpoint
ARRAY_NAME = Str(
    r"(?!\.\.?/)[^/\x00]+/(?!\.\.?$)[^/\x00]+",
    max_len=1024,
    what="a relative path '<group directory>/<state kind>' with no '.' or '..' part",
)
DTYPE = Str(choices=sorted(DTYPE_NAMES.values()))
FLOAT_DTYPE = Str(choices=sorted(n for d, n in DTYPE_NAMES.items() if d.is_floating_point))
LEAF = Obj({"path": KEY_PATH, "shape": List(Int(0), max_len=32), "offset": Int(0), "numel": Int(0)})
GROUP = Obj(
    {
        "rows": Int(1),
        "numel": Int(0),
        "treedef": Str(PRINTABLE, max_len=1 << 20),
        "leaves": List(LEAF, unique="path"),
    }
)
# opt.<i>.<row a format adds>
KIND = Str(r"param|master|remainder|opt\.[0-9]{1,3}(\.[a-z]{1,16})?")
ARRAY = Obj(
    {
        "name": ARRAY_NAME,
        "group": GROUP_NAME,
        "kind": KIND,
        "dtype": DTYPE,
        "shape": List(Int(0), min_len=2, max_len=2),
        "chunk_cols": Int(1),
        "description": TEXT,
    }
)
TILE = Obj(
    {
        "stage": GROUP_NAME,
        "path": KEY_PATH,
        "axis": Int(0, 31),
        "shapes": List(List(Int(0), max_len=32), min_len=1),
    }
)
TIE = Obj({"embed": KEY_PATH, "head": KEY_PATH})
NAME = Str(r"[a-z0-9_]{1,32}", what="a lower-case name")  # a Config choice
# a number, a name ("adamw", "int8") or an lr schedule's (``<lambda>``); a known optimizer's values
# are held to its factory's checks (``_optimizer_accepts``)
HYPERPARAM = AnyOf(Float(), Str(PRINTABLE, max_len=256, what="a name (printable)"), Bool(), Null())
KNOWN_OPTIMIZERS = {"adamw": zf.adamw, "sgd": zf.sgd}


def _optimizer_accepts(hyperparams: dict, field: str) -> None:
    """SchemaError unless each hyperparameter of a known optimizer (``KNOWN_OPTIMIZERS``, by its
    ``name``) is one its factory takes (alone: its checks are per argument), naming the field;
    ``lr`` may be a schedule's name, and a name the factory does not take is left to the restore
    (``validate.check_optimizer``: the restoring optimizer's names)."""
    factory = KNOWN_OPTIMIZERS.get(hyperparams.get("name"))
    if factory is None:
        return
    takes = inspect.signature(factory).parameters
    for key, value in hyperparams.items():
        if key in ("name", "lr") or key not in takes:
            continue
        try:
            factory(**{key: value})
        except (ValueError, TypeError) as e:
            raise SchemaError(
                join(field, key), f"a value zf.{hyperparams['name']} takes ({e})", value
            ) from None


# hyperparameter names (a restore holds them to its optimizer's: validate.check_optimizer)
OPTIMIZER = AnyOf(
    Null(),
    Validated(Map(Str(r"[A-Za-z_][A-Za-z0-9_]{0,63}"), HYPERPARAM, max_len=64), _optimizer_accepts),
)


def _format_schema(default: dict) -> Obj:
    """The description of a stored format (``Formats.fp32()``'s ``default``): its class, kind and
    version are the engine's to know (``parse_formats`` names one it does not), and every other
    field (a block size, the int8 maps, the bf16 rounding) takes the one value this version writes
    and reads."""
    own = {"format": Str(r"[A-Za-z]{1,64}"), "kind": Str(r"[a-z0-9]{1,16}"), "version": Int(1)}
    return Obj({name: own.get(name) or Const(value) for name, value in default.items()})


_DEFAULT_FORMATS = Formats.fp32()
FORMATS = Obj(
    {
        "master": _format_schema(_DEFAULT_FORMATS.master),
        "moments": _format_schema(_DEFAULT_FORMATS.moments),
        "compressed": List(GROUP_NAME, max_len=1 << 16, unique=True),
        "param_rounding": Str(choices=["nearest_even", "ties_away"]),
    }
)

DEVICE = Str(
    r"(cpu|cuda)(:[0-9]{1,4})?", max_len=16, what="a torch device: 'cpu', 'cuda' or 'cuda:<index>'"
)
PATH = Str(r"[^\x00]*", what="a path (no NUL character)")
SPILL = Str(r"[0-9]{1,9}:[a-z]{1,16}", max_len=32, what="'<k>:<placement>', e.g. '3:nvme'")
# the str fields of zf.Config whose form is not a name; every other str field is a NAME
CONFIG_STRINGS = {
    "device": DEVICE,
    "nvme_path": PATH,
    "trace": PATH,
    "spill_params": SPILL,
    "spill_optimizer": SPILL,
}


def _config_fields() -> Obj:
    """Every field of ``zf.Config.describe()``, typed from its annotation (each may be absent: the
    default); the engine's own checks follow (``_engine_accepts``)."""
    kinds = {"int": Int(0), "float": Float(), "torch.dtype": FLOAT_DTYPE}
    fields = {}
    for f in dataclasses.fields(zf.Config):
        base, _, optional = f.type.partition(" | ")
        kind = CONFIG_STRINGS.get(f.name, NAME) if base == "str" else kinds[base]
        fields[f.name] = AnyOf(kind, Null()) if optional == "None" else kind
    return Obj({}, fields)


def _engine_accepts(config: dict, field: str) -> None:
    """SchemaError unless ``zf.Config`` takes ``config`` (its choices, ranges and how its fields go
    together: the engine's one answer), naming the field its message names. The device is checked
    by its form alone (``DEVICE``; "cpu" here): a CUDA device resolves only where one is."""
    kwargs = {
        k: TORCH_DTYPES[v] if isinstance(v, str) and v in TORCH_DTYPES else v
        for k, v in config.items()
    }
    try:
        zf.Config(**{**kwargs, "device": "cpu"})
    except (ValueError, TypeError) as e:
        named = re.search(r"Config\.(\w+)", str(e))
        key = named.group(1) if named and named.group(1) in config else None
        raise SchemaError(
            join(field, key) if key else field,
            f"a value zf.Config takes ({e})",
            config[key] if key else config,
        ) from None


CONFIG = Validated(_config_fields(), _engine_accepts)

MANIFEST_SCHEMA = Obj(
    {
        "format": Str(choices=[FORMAT]),
        "format_version": Int(1, FORMAT_VERSION),
        "step": Int(0, INT64_MAX - 1),  # an int64, and so is the next step's number
        "world_size": Int(1, 1 << 20),
        "n_layers": Int(0),
        "param_dtype": FLOAT_DTYPE,
        "groups": Map(GROUP_NAME, GROUP),
        "tiles": Map(GROUP_NAME, TILE),
        "arrays": List(ARRAY, unique="name"),
        "optimizer": OPTIMIZER,
        "optimizer_state": List(Str(r"[A-Za-z0-9_.]+", max_len=256), max_len=1000, unique=True),
        "config": CONFIG,
        "checksums": Bool(),
        "rng": Null(),
        "extra": AnyOf(Null(), Map(Str(max_len=1 << 16), Json())),
        "save_id": Str(r"[0-9a-f]{12}"),
        "created_unix": Float(0),
        "torch_version": Str(r"[A-Za-z0-9.+_-]{1,64}"),
    },
    {"ties": List(TIE, max_len=64, unique="head"), "formats": FORMATS},
)
