"""Dataclass fields that are command-line flags: a command's ``*Args`` dataclass declares each
flag once, as a field (its name is the flag's dest, its default the flag's default, the rest in
the field's metadata), and the command's parser is generated from the fields (``add_flags``).

Standard library only: cli.py parses a command line before it imports the command (torch).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, field, fields
from typing import Any


def flag(default: Any = MISSING, *, names: tuple[str, ...] = (), group: str | None = None,
         **argparse_kw: Any) -> Any:  # fmt: skip
    """A field that is a flag. ``names``: its option strings (default: ``--`` and the field's
    name with dashes); ``group``: the title of the help's group it is listed in (default: the
    parser's own options); ``argparse_kw``: ``add_argument``'s keywords (help, metavar,
    choices, action, type). No default: a required flag. A list default is copied for each
    value (and each parser). ``type`` is the default's when that is an int or a float, and a
    False default makes a ``store_true`` flag, unless ``action`` or ``type`` says otherwise."""
    metadata = {"names": tuple(names), "group": group, "argparse": argparse_kw}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def is_flag(f: Field) -> bool:
    return "argparse" in f.metadata


def default_of(f: Field) -> Any:
    """The field's default (a fresh copy of a list), MISSING when it has none."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def option_strings(f: Field) -> tuple[str, ...]:
    return f.metadata["names"] or ("--" + f.name.replace("_", "-"),)


def add_argument_kw(f: Field) -> dict[str, Any]:
    """``add_argument``'s keywords for the flag field ``f`` (dest, default, type, action...)."""
    kw = dict(f.metadata["argparse"], dest=f.name)
    default = default_of(f)
    if default is MISSING:
        kw["required"] = True
        return kw
    kw["default"] = default
    if "action" not in kw and "type" not in kw:
        if default is False:
            kw["action"] = "store_true"
        elif isinstance(default, int | float) and not isinstance(default, bool):
            kw["type"] = type(default)
    return kw


def add_flags(p: argparse.ArgumentParser, cls: type, names: tuple[str, ...] | None = None) -> None:
    """Add the flag fields of the dataclass ``cls`` (those of ``names`` only, when given) to
    ``p``, in the fields' order, each in its group (made on its first flag)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(cls):
        if not is_flag(f) or (names is not None and f.name not in names):
            continue
        title = f.metadata["group"]
        if title is not None and title not in groups:
            groups[title] = p.add_argument_group(title)
        target = p if title is None else groups[title]
        target.add_argument(*option_strings(f), **add_argument_kw(f))


def command_line(value: Any, names: list[str] | None = None) -> list[str]:
    """The flags that give the flag fields ``names`` (all by default) of the dataclass value
    ``value`` their values: a switch when it is on, a repeated flag per item of a list, the
    others with their value (str); unset (None) ones left out."""
    out: list[str] = []
    chosen = [f for f in fields(value) if is_flag(f) and (names is None or f.name in names)]
    if names is not None:
        chosen.sort(key=lambda f: names.index(f.name))
    for f in chosen:
        v, first = getattr(value, f.name), option_strings(f)[0]
        action = add_argument_kw(f).get("action")
        if action in ("store_true", "store_false"):
            out += [first] if v == (action == "store_true") else []
        elif isinstance(v, list):
            for item in v:
                out += [first, str(item)]
        elif v is not None:
            out += [first, str(v)]
    return out
