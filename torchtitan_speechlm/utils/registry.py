"""Named extension points: one small registry per axis (codecs, interleave patterns, tasks,
prepare sources, backbones). A new entry is one class or object plus one ``register`` call;
config values are checked against the registry (with a "did you mean"), never against a list
typed somewhere else. See docs/extending.md."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A name that is not registered; the message lists the registered ones."""


class Registry(Generic[T]):
    """``name -> object`` for one extension axis (``what`` names it in errors)."""

    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None, *, replace: bool = False):
        """Register ``obj`` under ``name``; without ``obj``, a decorator. Registering a name
        twice is an error unless ``replace`` (re-importing a module registers the same object,
        which is allowed)."""

        def add(o: T) -> T:
            old = self._items.get(name)
            if old is not None and old is not o and not replace and not _same_definition(old, o):
                raise ValueError(
                    f"{self.what} {name!r} is already registered ({old!r}); "
                    "pass replace=True to override it"
                )
            self._items[name] = o
            return o

        return add if obj is None else add(obj)

    def get(self, name: str, key: str = "") -> T:
        """The entry, or UnknownNameError naming ``key`` (the config key or flag it came from)."""
        if name in self._items:
            return self._items[name]
        close = difflib.get_close_matches(str(name), list(self._items), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        where = f"{key} = {name!r}: " if key else ""
        raise UnknownNameError(
            f"{where}unknown {self.what} {name!r}; registered: {', '.join(self.names())}.{hint}"
        )

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def items(self):
        return self._items.items()


def _same_definition(a: object, b: object) -> bool:
    """Equal entries, or the same class/function defined again (a module imported twice)."""
    if a == b:
        return True
    named = (isinstance(a, type) or callable(a)) and (isinstance(b, type) or callable(b))
    return named and (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
        getattr(b, "__module__", None),
        getattr(b, "__qualname__", None),
    )
