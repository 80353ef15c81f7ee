"""The TOML check torchtitan does not do, before it parses: an unknown section or key gets a
"did you mean" and the file it came from, a value of the wrong type its expected type, a moved
key what replaces it, and a value that must name a registered extension the registered names
(the registries are handed in by the caller, which knows them)."""

import difflib
import re
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as torchtitan's own loader uses
    import tomli as tomllib

from torchtitan_speechlm.config.errors import ConfigError
from torchtitan_speechlm.utils.text_files import not_utf8

# keys that were replaced, with what to do instead
MOVED_KEYS = {
    "speechlm.load_backbone_weights": 'is now `speechlm.init = "pretrained"` (true) or '
    '`"normal"` (false)',
    "speechlm.backbone": "is now torchtitan's own `model.hf_assets_path` (the backbone's "
    "checkpoint folder): move the path there",
}


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def check_toml(
    values: dict, config_cls: type, source: str, prefix: str = "", registered: dict | None = None
) -> None:
    """Raise ConfigError on an unknown section/key or a value of the wrong type, and on a value
    that must name a registered extension but does not (``registered``: ``{"section.key":
    registry}``, given by the caller, which knows the registries: run_context.REGISTERED_VALUES)."""
    known = {f.name: f for f in fields(config_cls)}
    hints = {name: f.type for name, f in known.items()}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if dotted in MOVED_KEYS:
            raise ConfigError(f"{source}: `{dotted}` {MOVED_KEYS[dotted]}")
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f" Did you mean `{prefix}{close[0]}`?" if close else ""
            where = f"section [{prefix[:-1]}]" if prefix else "the top level"
            raise ConfigError(
                f"{source}: unknown key `{dotted}` in {where}.{hint} "
                f"Valid keys: {', '.join(sorted(known))}."
            )
        tp = hints[key]
        if is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: `{dotted}` must be a [{dotted}] table")
            check_toml(value, tp, source, prefix=f"{dotted}.", registered=registered)
        elif not _type_ok(value, tp):
            raise ConfigError(
                f"{source}: `{dotted}` = {value!r} has the wrong type; expected "
                f"{getattr(tp, '__name__', None) or str(tp).replace('typing.', '')}."
            )
        elif registered and dotted in registered:
            try:
                registered[dotted].get(value, dotted)
            except ValueError as e:
                raise ConfigError(f"{source}: {e}") from None


CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")
_AT = re.compile(r"^(?P<msg>.*) \(at line (?P<line>\d+), column (?P<col>\d+)\)$", re.S)


def load_toml_file(path: str) -> dict:
    """``tomllib.load`` of a config file whose errors name the file and the line: bytes that
    are not UTF-8 (``PATH:LINE: byte 0xe9 at column 3 ... save the file as UTF-8``) and TOML
    syntax (``PATH:LINE: Invalid value (column 9): `steps = = 6```), as ConfigError; torchtitan's
    own loader raises the bare decoder error, with a traceback."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"job.config_file: {path} not found") from None
    except OSError as e:
        raise ConfigError(f"job.config_file: {path} cannot be read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(not_utf8(path, data, e)) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = _AT.match(str(e))
        if m is None:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
        lineno = int(m["line"])
        lines = text.splitlines()
        shown = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
        raise ConfigError(
            f"{path}:{lineno}: not valid TOML: {m['msg']} (column {m['col']})"
            + (f": `{shown}`" if shown else "")
            + "; fix that line (TOML: key = value, strings in quotes, [section] headers)"
        ) from None


def check_toml_file(args: list[str]) -> dict | None:
    """The TOML named by ``--job.config_file`` in ``args`` loaded by ``load_toml_file`` (None
    without one): call it before torchtitan's ConfigManager reads the file, so that a file
    that is not UTF-8 or not TOML is one ``config error`` line naming the file and line."""
    for i, a in enumerate(args):
        key, eq, value = a.partition("=")
        if key in CONFIG_FILE_FLAGS:
            path = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            return load_toml_file(path) if path else None
    return None
