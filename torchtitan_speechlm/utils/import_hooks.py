"""Run code around the first import of a module, without importing it now.

The package must be cheap to import (``torchtitan --help`` in well under 2 s loads neither torch
nor torchtitan), yet its torchtitan fixes (utils/compat.py) must be in place before torchtitan's
modules run: fix 1 before ``torchtitan.tools.utils`` caches its device type, the others before
any caller uses the patched functions. ``around_import`` installs a one-shot finder on
``sys.meta_path`` that wraps the module's loader: ``before()`` runs just before the module's code,
``after()`` just after, and the import then completes as usual. ``run_on_first_use`` defers a
module's code instead: its import is cheap, and the code runs when one of its names is first
used (compat fix 18: a module of torchtitan that imports a heavy library no SpeechLM run uses;
fix 22: scipy's optimisers, which transformers' detection losses import for one function).
Standard library only.
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
    """Run ``before()`` and ``after()`` around the first import of module ``name`` (a
    submodule's parents are imported first, as usual); at once (both) when it is already
    imported."""
    if name in sys.modules:
        before()
        after()
        return
    if not any(isinstance(f, _AroundImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AroundImport(name, before, after))


class _RunOnFirstUse(importlib.abc.Loader):
    """Creates the module as its own loader would, but runs its code only when first needed: a
    name of ``called`` is called, or any other name is read (PEP 562 ``__getattr__``). The code
    then runs in that same module object, so every ``from MODULE import name`` done before sees
    the real object through its stand-in (a function that calls the real one).
    ``importlib.util.LazyLoader`` would not do: ``from MODULE import name``, which is how
    torchtitan imports this module's functions, reads the name and so runs the module at once."""

    def __init__(self, loader, called: tuple[str, ...]) -> None:
        self.loader, self.called = loader, called

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        loader, state = self.loader, {"ran": False}

        def run() -> None:
            if state["ran"]:
                return
            state["ran"] = True
            for name in (*self.called, "__getattr__"):
                module.__dict__.pop(name, None)
            module.__spec__.loader = module.__loader__ = loader  # as if never deferred
            loader.exec_module(module)

        def stand_in(name: str):
            def call(*args, **kwargs):
                run()
                return getattr(module, name)(*args, **kwargs)

            call.__name__ = call.__qualname__ = name
            call.__module__ = module.__name__
            call.__doc__ = f"Runs {module.__name__} (deferred), then calls its {name}."
            return call

        def __getattr__(name: str):
            # dunder probes (copy, pickle, inspect) do not load it; `from MODULE import *` does
            if name.startswith("__") and name != "__all__":
                raise AttributeError(name)
            run()
            return getattr(module, name)

        for name in self.called:
            setattr(module, name, stand_in(name))
        module.__getattr__ = __getattr__

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


class _DeferModule(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, called: tuple[str, ...]) -> None:
        self.name, self.called = name, called

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RunOnFirstUse(spec.loader, self.called)
        return spec


def run_on_first_use(name: str, called: tuple[str, ...]) -> bool:
    """Defer the code of submodule ``name`` until first use: ``called`` are the functions other
    modules import from it by name (each gets a stand-in that runs the module, then calls the
    real one); reading any other attribute runs it too. False, and nothing done, when it is
    already imported (its code has run)."""
    if name in sys.modules:
        return False
    if not any(isinstance(f, _DeferModule) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferModule(name, called))
    return True
