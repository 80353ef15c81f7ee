"""Dataclass fields that are command-line flags: a command's ``*Args`` dataclass declares each
flag once, as a field (its name is the flag's dest, its default the flag's default, the rest in
the field's metadata), and the command's parser is generated from the fields (``add_flags``).

A flag renamed keeps its old spelling as an alias (``flag(old=...)``, ``add_flag``): it parses
as the flag does, and each use says the new name in one line on stderr (``renamed``).

The flags are added in the order of ``ordered_fields``: the class's own fields, then those of
each base class (``EvalArgs(JudgeArgs, DecodingArgs)``: eval's own flags, the judges', the
decoding flags), so that a group of flags shared by several commands is one base class.

Standard library only: cli.py parses a command line before it imports the command (torch).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, Field, field, fields
from typing import Any


def flag(default: Any = MISSING, *, names: tuple[str, ...] = (), old: tuple[str, ...] = (),
         group: str | None = None, **argparse_kw: Any) -> Any:  # fmt: skip
    """A field that is a flag. ``names``: its option strings (default: ``--`` and the field's
    name with dashes); ``old``: former spellings, still taken, each use said on stderr
    (``renamed``); ``group``: the title of the help's group it is listed in (default: the
    parser's own options); ``argparse_kw``: ``add_argument``'s keywords (help, metavar,
    choices, action, type). No default: a required flag. A list default is copied for each
    value (and each parser). ``type`` is the default's when that is an int or a float, and a
    False default makes a ``store_true`` flag, unless ``action`` or ``type`` says otherwise."""
    metadata = {"names": tuple(names), "old": tuple(old), "group": group, "argparse": argparse_kw}
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


def ordered_fields(cls: type) -> list[Field]:
    """The fields of the dataclass ``cls`` in its flags' order: those the class itself declares,
    then each base class's (in the method resolution order), each class's in its order."""
    by_name, out = {f.name: f for f in fields(cls)}, {}
    for klass in cls.__mro__:
        for name in vars(klass).get("__annotations__", {}):
            if name in by_name:
                out.setdefault(name, by_name[name])
    return list(out.values())


def flag_fields(cls: type) -> list[Field]:
    """The flag fields of ``cls``, in its flags' order."""
    return [f for f in ordered_fields(cls) if is_flag(f)]


def from_namespace(cls: type, ns: argparse.Namespace, **others: Any) -> Any:
    """The ``cls`` value of a parsed command line: each flag field from ``ns`` (``others``:
    the fields that are not flags)."""
    return cls(**{f.name: getattr(ns, f.name) for f in flag_fields(cls)}, **others)


def renamed(action: str | type[argparse.Action] | None, old: tuple[str, ...], new: str
            ) -> type[argparse.Action]:  # fmt: skip
    """The argparse action ``action`` (a name such as ``"store_true"``, a class, None: store)
    that, given by one of the ``old`` spellings, also prints one line on stderr saying to use
    ``new``: an old flag keeps working and says its new name."""
    if isinstance(action, type):
        base = action
    else:  # argparse's class of that name
        base = type(argparse.ArgumentParser(add_help=False).add_argument("--x", action=action))

    class Renamed(base):
        def __call__(self, parser, namespace, values, option_string=None):
            if option_string in old:
                print(f"{parser.prog}: {option_string} is now {new}: use {new} (the old "
                      "spelling still works)", file=sys.stderr)  # fmt: skip
            super().__call__(parser, namespace, values, option_string)

    Renamed.__name__ = Renamed.__qualname__ = f"Renamed{base.__name__.lstrip('_')}"
    return Renamed


def add_flag(target, *names: str, old: tuple[str, ...] = (), **kw: Any) -> argparse.Action:
    """``target.add_argument(*names, *old, **kw)``: the flag ``names[0]`` with its old
    spellings ``old`` as aliases (``renamed``; its help says them)."""
    if old:
        kw["action"] = renamed(kw.get("action"), old, names[0])
        said = f"{', '.join(old)}: the old spelling, still taken"
        kw["help"] = f"{kw['help']} ({said})" if kw.get("help") else said
    return target.add_argument(*names, *old, **kw)


def add_flags(p: argparse.ArgumentParser, cls: type, names: tuple[str, ...] | None = None) -> None:
    """Add the flag fields of the dataclass ``cls`` (those of ``names`` only, when given) to
    ``p``, in its flags' order (``ordered_fields``), each in its group (made on its first
    flag)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in flag_fields(cls):
        if names is not None and f.name not in names:
            continue
        title = f.metadata["group"]
        if title is not None and title not in groups:
            groups[title] = p.add_argument_group(title)
        target = p if title is None else groups[title]
        add_flag(target, *option_strings(f), old=f.metadata["old"], **add_argument_kw(f))


def command_line(value: Any, names: list[str] | None = None) -> list[str]:
    """The flags that give the flag fields ``names`` (all by default) of the dataclass value
    ``value`` their values: a switch when it is on, a repeated flag per item of a list, the
    others with their value (str); unset (None) ones left out."""
    out: list[str] = []
    chosen = [f for f in flag_fields(type(value)) if names is None or f.name in names]
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
