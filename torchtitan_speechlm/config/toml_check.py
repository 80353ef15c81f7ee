"""The TOML check torchtitan does not do, before it parses: an unknown section or key gets a
"did you mean" and the file it came from, a value of the wrong type its expected type, a moved
key what replaces it, and a value that must name a registered extension the registered names
(the registries are handed in by the caller, which knows them)."""

import difflib
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Literal

from torchtitan_speechlm.config.errors import ConfigError

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
