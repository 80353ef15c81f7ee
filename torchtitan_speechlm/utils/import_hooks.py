"""Run code around the first import of a module, without importing it now.

The package must be cheap to import (``torchtitan --help`` in well under 2 s loads neither torch
nor torchtitan), yet its torchtitan fixes (utils/compat.py) must be in place before torchtitan's
modules run: fix 1 before ``torchtitan.tools.utils`` caches its device type, the others before
any caller uses the patched functions. ``around_import`` installs a one-shot finder on
``sys.meta_path`` that wraps the module's loader: ``before()`` runs just before the module's code,
``after()`` just after, and the import then completes as usual. Standard library only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable


class _WrappedLoader(importlib.abc.Loader):
    def __init__(self, loader, before: Callable[[], None], after: Callable[[], None]) -> None:
        self.loader, self.before, self.after = loader, before, after

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.before()
        module.__spec__.loader = module.__loader__ = self.loader  # as if never wrapped
        self.loader.exec_module(module)
        self.after()

    def __getattr__(self, name: str):  # get_resource_reader, is_package, ...: the loader's own
        return getattr(self.loader, name)


class _AroundImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, before: Callable[[], None], after: Callable[[], None]) -> None:
        self.name, self.before, self.after = name, before, after

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; the finders after us find the real module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _WrappedLoader(spec.loader, self.before, self.after)
        return spec


def around_import(name: str, before: Callable[[], None], after: Callable[[], None]) -> None:
    """Run ``before()`` and ``after()`` around the first import of top-level module ``name``;
    at once (both) when it is already imported."""
    if name in sys.modules:
        before()
        after()
        return
    if not any(isinstance(f, _AroundImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AroundImport(name, before, after))
