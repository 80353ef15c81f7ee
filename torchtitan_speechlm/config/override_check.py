"""Command-line overrides (``--section.key value``) checked against the merged JobConfig before
tyro parses them, so that a mistyped key is one line in the docs' spelling.

tyro's own answer is a box that suggests the hyphenated spelling (``--training.local-batch-size``)
while every doc, TOML and example here writes underscores, and that ends "For full helptext, run
torchtitan --help", which lists the commands, not the keys. Both spellings are accepted; this
check only names keys that exist in neither.
"""

from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass

from torchtitan_speechlm.config.errors import ConfigError

HELP = "`torchtitan train --help` lists our sections, `--help-all` every key"


def config_keys(config_cls: type, prefix: str = "") -> set[str]:
    """Every ``section.key`` (and deeper ``a.b.c``) of a JobConfig dataclass."""
    out = set()
    for f in fields(config_cls):
        name = f"{prefix}{f.name}"
        if is_dataclass(f.type):
            out |= config_keys(f.type, f"{name}.")
        else:
            out.add(name)
    return out


def _key_of(token: str, keys: set[str]) -> str | None:
    """The key ``token`` sets (``--a.b``, ``--a.b=v``, ``--a.no_b``/``--a.no-b`` for a bool),
    in underscores; None for a token that is no override (a value, ``-h``)."""
    if not token.startswith("--") or "." not in token:
        return None
    name = token[2:].partition("=")[0].replace("-", "_")
    section, _, last = name.rpartition(".")
    if name not in keys and last.startswith("no_") and f"{section}.{last[3:]}" in keys:
        return f"{section}.{last[3:]}"
    return name


def _nearest(name: str, keys: set[str]) -> str:
    """What to suggest for an unknown ``section.key``: its section's nearest keys, the same key
    in another section, or the nearest section."""
    section, _, last = name.rpartition(".")
    inside = sorted(k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section)
    if inside:
        near = [f"{section}.{k}" for k in difflib.get_close_matches(last, inside, n=3)]
        near += sorted(k for k in keys if k.rpartition(".")[2] == last and k not in near)
        if near:
            return "did you mean " + " or ".join(f"--{k}" for k in near[:3]) + "?"
        return f"[{section}] has no such key"
    sections = sorted({k.rpartition(".")[0] for k in keys})
    near = [f"{s}.{last}" for s in difflib.get_close_matches(section, sections, n=3)]
    near = [k for k in near if k in keys] or difflib.get_close_matches(name, sorted(keys), n=3)
    if near:
        return "did you mean " + " or ".join(f"--{k}" for k in near) + "?"
    return f"there is no section [{section}]"


def check_override_keys(args: list[str], config_cls: type) -> None:
    """Raise ConfigError naming the first ``--section.key`` of ``args`` that ``config_cls``
    (torchtitan's JobConfig with ours merged) has no key for, with the nearest keys."""
    keys = config_keys(config_cls)
    for token in args:
        name = _key_of(token, keys)
        if name is not None and name not in keys:
            raise ConfigError(f"unknown command-line key --{name}: {_nearest(name, keys)} ({HELP})")
