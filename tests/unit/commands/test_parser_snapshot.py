"""Every command's parser, action for action (its flags, dest, default, type, choices, help,
group), against a snapshot taken from the hand-written parsers before they were generated from
the ``*Args`` dataclasses (commands/flag_fields.py): the generated parsers keep every flag's
name, help, default and group. A deliberate change (a rename: the new name first, the old one
an alias) is made in the snapshot by hand, or the snapshot is written again with
``python tests/unit/commands/test_parser_snapshot.py`` and the diff read."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from torchtitan_speechlm.cli import PARSERS
from torchtitan_speechlm.commands.prepare_args import build_parser as build_prepare_parser

SNAPSHOT = Path(__file__).with_name("parser_snapshot.json")
COMMANDS = ("eval", "export", "generate", "prefer", "prepare", "serve")


def parsers() -> dict[str, argparse.ArgumentParser]:
    return {**{name: build() for name, build in PARSERS.items()}, "prepare": build_prepare_parser()}


def _value(v):
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list | tuple):
        return [_value(x) for x in v]
    return getattr(v, "__name__", repr(v))


def describe(parser: argparse.ArgumentParser) -> dict:
    """The parser as data: its prog and description, and per action its fields and group."""
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    actions = []
    for a in parser._actions:
        actions.append({
            "option_strings": list(a.option_strings),
            "dest": a.dest,
            "action": type(a).__name__.lstrip("_"),
            "default": _value(a.default),
            "type": _value(a.type),
            "choices": _value(a.choices),
            "required": a.required,
            "nargs": _value(a.nargs),
            "const": _value(a.const),
            "metavar": _value(a.metavar),
            "help": a.help,
            "group": group_of.get(id(a)),
        })  # fmt: skip
    return {"prog": parser.prog, "description": parser.description, "actions": actions}


def current() -> dict:
    return {name: describe(p) for name, p in sorted(parsers().items())}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_parser_is_its_snapshot(command):
    want = json.loads(SNAPSHOT.read_text())[command]
    got = json.loads(json.dumps(current()[command]))
    assert [a["dest"] for a in got["actions"]] == [a["dest"] for a in want["actions"]]
    for g, w in zip(got["actions"], want["actions"], strict=True):
        assert g == w, g["dest"]
    assert got == want


def test_every_command_parser_has_a_snapshot():
    assert sorted(json.loads(SNAPSHOT.read_text())) == sorted(parsers()) == list(COMMANDS)


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(current(), indent=1) + "\n")
    print(f"wrote {SNAPSHOT}", file=sys.stderr)
