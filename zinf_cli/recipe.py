"""Recipes: each option of a subcommand declared once, read from a YAML file and the command line.

An option has one name: ``lora_rank`` in a recipe file, ``lora_rank=8`` or ``--lora-rank 8`` on the
command line. The value of a run is, from lowest to highest precedence: the option's default, the
recipe file (``--config recipe.yaml``), the ``--flags``, the ``key=value`` overrides. Unknown keys
and values of the wrong type are ``RecipeError``s naming the key, and for a file its path and line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

import yaml

OVERRIDE = re.compile(r"^([a-z][a-z0-9_]*)=(.*)$", re.DOTALL)
RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")
TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")


class RecipeError(ValueError):
    """A recipe (file or command line) naming an unknown key or giving a value of the wrong type."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting of a subcommand: name, type (int, float, str, bool, list of str), default, help.

    ``training=False`` marks a setting that leaves the training as it is (where files go, how often
    to evaluate or save): a resumed run may change it; any other change is refused.
    """

    name: str
    type: type
    default: object
    help: str
    choices: tuple | None = None
    training: bool = True
    aliases: tuple[str, ...] = ()   # other flags of the same option, e.g. ("--offload",)
    path: bool = False   # a file or directory: "~" is the home directory

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def parser(prog: str, doc: str, options: tuple[Option, ...]) -> argparse.ArgumentParser:
    """An argparse parser of ``--config`` and every option's ``--flag`` (absent flags stay unset);
    ``split_overrides`` takes the ``key=value`` overrides out before argparse sees the line."""
    p = argparse.ArgumentParser(prog=prog, description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="a recipe file (YAML: one key per option below)")
    for o in options:
        help_text = f"{o.help} (default: {o.default!r}; recipe key {o.name})"
        flags = (o.flag, *o.aliases)
        if o.type is bool:
            p.add_argument(*flags, dest=o.name, action="store_true", help=help_text)
        elif o.type is list:
            p.add_argument(*flags, dest=o.name, nargs="+", help=help_text)
        else:
            p.add_argument(*flags, dest=o.name, type=o.type, choices=o.choices, help=help_text)
    return p


def with_defaults(options: tuple[Option, ...], **defaults) -> tuple[Option, ...]:
    """``options`` with other defaults by name (a subcommand sharing another's options)."""
    unknown = set(defaults) - {o.name for o in options}
    if unknown:
        raise KeyError(f"with_defaults: no options {sorted(unknown)}")
    return tuple(dataclasses.replace(o, default=defaults.get(o.name, o.default)) for o in options)


def split_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(the flags, the ``key=value`` overrides) of a command line; a word ``name=...`` overrides."""
    flags, overrides = [], []
    for word in argv:
        match = OVERRIDE.match(word)
        if match:
            overrides.append((match.group(1), match.group(2)))
        else:
            flags.append(word)
    return flags, overrides


def check(option: Option, value, where: str):
    """``value`` as ``option`` takes it, or a RecipeError naming the key and where it came from."""
    if value is None and option.default is None:
        return None
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                list: "a list of strings"}[option.type]
    good = _coerced(option.type, value)
    if good is None:
        raise RecipeError(f"{where}: {option.name}: expected {expected}, got {value!r} "
                          f"({type(value).__name__})")
    if option.path and option.type is list:
        good = [os.path.expanduser(v) for v in good]
    elif option.path:
        good = os.path.expanduser(good)
    if option.choices and good not in option.choices:
        raise RecipeError(f"{where}: {option.name}: expected one of {list(option.choices)}, "
                          f"got {good!r}")
    return good


def _coerced(kind: type, value):
    """``value`` as ``kind`` when it is one (an int is a float; "1e-3" is a float, as YAML 1.1 reads
    it as a string), else None."""
    if kind is bool:
        return value if isinstance(value, bool) else None
    if kind is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if kind is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return None
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return float(value) if number else None
    if kind is list:
        if isinstance(value, str):
            value = [value]
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return list(value) if ok else None
    return value if isinstance(value, str) else None


def parse_text(option: Option, text: str, where: str):
    """A ``key=value`` override's text as ``option`` takes it."""
    if option.default is None and text.lower() in ("", "none", "null"):
        return None
    if option.type is bool:
        lowered = text.lower()
        value = True if lowered in TRUE_WORDS else False if lowered in FALSE_WORDS else text
    elif option.type is int:
        value = int(text) if re.fullmatch(r"[+-]?\d+", text) else text
    elif option.type is list:
        value = yaml.safe_load(text) if text.startswith("[") else [t for t in text.split(",") if t]
    else:
        value = text
    return check(option, value, where)


def read_file(path: str, options: dict[str, Option]) -> dict:
    """The settings of the recipe file at ``path``: a YAML mapping of option names to values."""
    with open(path) as f:
        text = f.read()
    try:
        values = yaml.safe_load(text) or {}
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not a YAML file: {e}") from e
    if not isinstance(values, dict):
        raise RecipeError(f"{path}: expected a mapping of option names to values, got "
                          f"{type(values).__name__}")
    lines = {key.value: key.start_mark.line + 1 for key, _ in root.value}
    out = {}
    for key, value in values.items():
        where = f"{path}, line {lines.get(key, '?')}"
        if key not in options:
            raise RecipeError(f"{where}: unknown key {key!r}; expected one of: "
                              f"{', '.join(sorted(options))}")
        out[key] = check(options[key], value, where)
    return out


def resolve(prog: str, doc: str, options: tuple[Option, ...],
            argv: list[str]) -> argparse.Namespace:
    """The run's settings: defaults < ``--config`` file < ``--flags`` < ``key=value`` overrides.

    The namespace has one attribute per option, plus ``config`` (the recipe file or None).
    """
    by_name = {o.name: o for o in options}
    flags, overrides = split_overrides(list(argv))
    given = vars(parser(prog, doc, options).parse_args(flags))
    config = given.pop("config", None)
    values = {o.name: o.default for o in options}
    if config:
        config = recipe_path(config)
        values.update(read_file(config, by_name))
    for name, value in given.items():
        values[name] = check(by_name[name], value, f"--{name.replace('_', '-')}")
    for name, text in overrides:
        if name not in by_name:
            raise RecipeError(f"command line: unknown key {name!r} in {name}={text}; expected one "
                              f"of: {', '.join(sorted(by_name))}")
        values[name] = parse_text(by_name[name], text, f"command line {name}={text}")
    return argparse.Namespace(config=config, **values)


def recipe_path(name: str) -> str:
    """``name`` when it is a file, else the recipe of that name shipped in ``zinf_cli/recipes``."""
    shipped = os.path.join(RECIPES, name)
    if os.path.isfile(name) or not os.path.isfile(shipped):
        return name
    return shipped


def as_dict(args: argparse.Namespace, options: tuple[Option, ...]) -> dict:
    """The run's settings by option name (a recipe that reproduces the run)."""
    return {o.name: getattr(args, o.name) for o in options}


def write(path: str, args: argparse.Namespace, options: tuple[Option, ...]) -> None:
    """The resolved recipe as YAML at ``path``: ``--config path`` runs the same settings again."""
    with open(path, "w") as f:
        f.write("# the resolved recipe of this run (defaults, recipe file, flags and overrides)\n")
        yaml.safe_dump(as_dict(args, options), f, sort_keys=False)


def training_changes(saved: dict, args: argparse.Namespace,
                     options: tuple[Option, ...]) -> list[str]:
    """The settings that change the training (``Option.training``) where ``args`` differs from the
    ``saved`` recipe, as ``"key: saved -> now"``; a key the saved recipe lacks is at its default."""
    changes = []
    for o in options:
        if not o.training:
            continue
        before, now = saved.get(o.name, o.default), getattr(args, o.name)
        if before != now:
            changes.append(f"{o.name}: {before!r} -> {now!r}")
    return changes
