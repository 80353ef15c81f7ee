"""The package's layout keeps its promises: training never imports the preparation side (nor a
codec), the module import graph has no cycles, every package says what it holds."""

import ast
import os
import subprocess
import sys
from pathlib import Path

from tools import import_graph

PKG = Path(__file__).resolve().parents[2] / "torchtitan_speechlm"
TRAINING_SIDE = (
    "utils",
    "config",
    "model",
    "data",
    "components",
    "distributed",
    "trainer",
    "commands/train.py",
    "train.py",
)
OFFLINE = ("torchtitan_speechlm.prepare", "torchtitan_speechlm.codecs")


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path, top_level_only: bool) -> set[str]:
    """Modules of this package that ``path`` imports (at module level, or anywhere)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = PKG.parent / Path(*f"{base}.{alias.name}".split("."))
                out.add(
                    f"{base}.{alias.name}"
                    if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
                    else base
                )
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("torchtitan_speechlm")}


def test_training_side_never_imports_the_preparation_side():
    for entry in TRAINING_SIDE:
        files = [PKG / entry] if entry.endswith(".py") else sorted((PKG / entry).rglob("*.py"))
        for f in files:
            bad = {m for m in imports(f, top_level_only=False) if m.startswith(OFFLINE)}
            assert not bad, f"{f.relative_to(PKG)} imports {bad}"
    # and at run time: build the spec, the model args, a model and the data loader's modules
    code = (
        "import sys, torchtitan_speechlm\n"
        "from torchtitan_speechlm.data import stream, reader, tasks\n"
        "from torchtitan_speechlm.components import dataloader, loss, metrics, validate, resume\n"
        "from torchtitan_speechlm.distributed import parallelize\n"
        "from torchtitan_speechlm.model import model\n"
        f"bad = [m for m in sys.modules if m.startswith({OFFLINE!r})]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]


# The only imports of this package's modules that run inside a function, each with its reason.
# Everything else imports at module level, where the cycle and layer checks below see it.
LAZY_IMPORTS = {
    ("", "python_api"): "`from torchtitan_speechlm import TitanTrainer`: the Python API loads on "
    "first use, so importing the package (every rank, every command) does not load it",
    (
        "cli",
        "commands.train",
    ): "`torchtitan --help` start-up: each subcommand's modules load only when "
    "that subcommand runs",
    ("cli", "commands.prepare"): "as above (prepare: codecs, sources)",
    ("cli", "commands.generate"): "as above (generate / eval: judges, the report page)",
    ("cli", "commands.export"): "as above (export)",
    ("cli", "commands.serve"): "as above (serve: the model, the server)",
    ("cli", "commands.prefer"): "as above (prefer: eval, prepare and the judges)",
    ("", "utils.compat"): "importing the package loads no torch: its torchtitan fixes run around "
    "the first `import torchtitan` (utils/import_hooks.py)",
    ("", "trainer.spec"): "`torchtitan_speechlm.register` / `SPEC_NAME` on first use (the spec "
    "imports torchtitan and the model)",
    ("generation.loading", "codecs"): "a codec loads only when audio is decoded: training imports "
    "generation.loading for its samples and must never import a codec (test above)",
}


def test_imports_keep_the_layer_order_and_form_no_cycle():
    """Every import, module-level or inside a function (ast over every file), goes to the
    importer's layer or one below it (tools/import_graph.py LAYERS, docs/architecture.md), and
    the module graph is acyclic."""
    problems = import_graph.report(import_graph.all_imports())
    assert not problems, "\n".join(problems)


def test_imports_inside_functions_are_only_the_listed_ones():
    lazy = {(i.source, i.target) for i in import_graph.all_imports() if i.in_function}
    unlisted = sorted(lazy - set(LAZY_IMPORTS))
    stale = sorted(set(LAZY_IMPORTS) - lazy)
    assert not unlisted, f"imports inside functions not in LAZY_IMPORTS (move them up): {unlisted}"
    assert not stale, f"LAZY_IMPORTS lists imports that no longer exist: {stale}"
    assert len(LAZY_IMPORTS) <= 15


def test_the_committed_import_picture_and_layer_table_are_current():
    fix = "run `python tools/import_graph.py`"
    fresh = import_graph.render_svg(import_graph.all_imports())
    assert import_graph.PICTURE.read_text() == fresh, fix
    doc = import_graph.DOC.read_text()
    assert import_graph.render_doc(doc) == doc, fix


def test_the_graph_reader_sees_function_level_imports_and_cycles(tmp_path, monkeypatch):
    """The checker itself: an import inside a function is an edge, a TYPE_CHECKING one is not,
    and a cycle through a function-level import is reported (a tree built here)."""
    pkg = tmp_path / "torchtitan_speechlm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from torchtitan_speechlm.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from torchtitan_speechlm import c\n"
        "def f():\n    from torchtitan_speechlm.a import x\n"
    )
    (pkg / "c.py").write_text("")
    monkeypatch.setattr(import_graph, "ROOT", pkg)
    edges = {(i.source, i.target, i.in_function) for i in import_graph.all_imports()}
    assert edges == {("a", "sub.b", False), ("sub.b", "a", True)}
    assert import_graph.cycles(import_graph.all_imports()) == [["a", "sub.b"]]


def test_the_package_ships_no_test_hooks():
    """The fault suite's plugin lives in tests/ (tests/fault_injection.py), and importing the
    package (with SPEECHLM_FAULTS set, as in a faulted run) patches nothing of the step guard
    or of DCP's file writer: only a run whose custom_import is the plugin gets faults."""
    assert not list(PKG.rglob("fault_injection.py"))
    code = (
        "import sys, torchtitan_speechlm\n"
        "from torch.distributed.checkpoint.filesystem import FileSystem\n"
        "from torchtitan_speechlm.components.nonfinite import StepGuard\n"
        "from torchtitan_speechlm.commands import train\n"
        "assert not [m for m in sys.modules if 'fault_injection' in m]\n"
        "assert not getattr(FileSystem, '_speechlm_faults', False)\n"
        "assert not getattr(StepGuard, '_speechlm_faults', False)\n"
        "assert StepGuard.note_loss.__module__ == 'torchtitan_speechlm.components.nonfinite'\n"
    )
    env = {**os.environ, "SPEECHLM_FAULTS": "nan_loss@1"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, env=env,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]


def test_every_package_says_what_it_holds():
    for init in PKG.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(PKG.parent)} has no docstring"
    for d, _, files in os.walk(PKG):
        if any(f.endswith(".py") for f in files) and "__pycache__" not in d:
            assert (Path(d) / "__init__.py").exists(), d


def test_only_the_contact_module_imports_torchtitan(tmp_path, monkeypatch):
    """Every torchtitan symbol reaches the package through utils/upstream.py (docs/architecture.md,
    The contact surface with torchtitan); the checker finds a direct import at any depth (a tree
    built here)."""
    assert import_graph.direct_upstream_imports() == []
    pkg = tmp_path / "torchtitan_speechlm"
    (pkg / "utils").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "utils" / "__init__.py"):
        init.write_text("")
    (pkg / "utils" / "upstream.py").write_text("import torchtitan.train\n")
    (pkg / "a.py").write_text("def f():\n    from torchtitan.tools.logging import logger\n")
    (pkg / "b.py").write_text("import torchtitan_speechlm.utils.upstream\n")
    monkeypatch.setattr(import_graph, "ROOT", pkg)
    assert import_graph.direct_upstream_imports() == [("a", 2, "torchtitan.tools.logging")]
    assert any("a imports torchtitan.tools.logging" in p for p in import_graph.report([]))


def test_the_contact_surface_resolves_against_the_installed_torchtitan():
    """A torchtitan upgrade is a reading of utils/upstream.py: each symbol still resolves, each
    method our subclasses override still exists upstream, each symbol is used by the package,
    and what a subclass of ours overrides of a torchtitan class is listed in OVERRIDES."""
    import importlib
    import re

    from torchtitan_speechlm.utils import upstream

    sources = {p: p.read_text() for p in PKG.rglob("*.py") if p != PKG / "utils" / "upstream.py"}
    for name in upstream.SYMBOLS:
        assert getattr(upstream, name) is not None, name
    for name in upstream.KNOWN_WITHOUT_IMPORT:  # named without importing torchtitan: the same
        module, attribute, _ = upstream.SYMBOLS[name]
        assert getattr(upstream, name) is getattr(importlib.import_module(module), attribute)
        assert any(re.search(rf"\b{name}\b", text) for text in sources.values()), f"{name} unused"
    for module in ("trainer.trainer", "components.metrics", "components.validate",
                   "components.dataloader", "model.state_dict_adapter", "model.model",
                   "python_api.trainer", "python_api.espnet_data", "python_api.wandb_run"):  # fmt: skip
        importlib.import_module(f"torchtitan_speechlm.{module}")
    for cls_name, methods in upstream.OVERRIDES.items():
        base = getattr(upstream, cls_name)
        declared = set(getattr(base, "__annotations__", {}))  # attributes set per instance
        missing = [m for m in methods if not hasattr(base, m) and m not in declared]
        assert not missing, f"torchtitan's {cls_name} no longer has {missing}"
        pending = list(base.__subclasses__())
        while pending:
            sub = pending.pop()
            pending.extend(sub.__subclasses__())
            if not sub.__module__.startswith("torchtitan_speechlm"):
                continue
            own = {  # methods and properties written in the class body that torchtitan has
                n for n, v in vars(sub).items()
                if (hasattr(base, n) or n in declared) and (n == "__init__" or not n.startswith("__"))
                and (callable(v) or isinstance(v, (property, classmethod, staticmethod)))
            }  # fmt: skip
            unlisted = own - set(methods)
            assert not unlisted, (
                f"{sub.__module__}.{sub.__name__} overrides {sorted(unlisted)} of torchtitan's "
                f"{cls_name}: list them in utils/upstream.py OVERRIDES"
            )
