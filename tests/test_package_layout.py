"""The package's layout keeps its promises: training never imports the preparation side (nor a
codec), the module import graph has no cycles, every package says what it holds."""

import ast
import os
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "torchtitan_speechlm"
TRAINING_SIDE = (
    "data",
    "model",
    "components",
    "infra",
    "spec.py",
    "run_context.py",
    "config.py",
    "launch.py",
    "train.py",
    "compat.py",
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
        "from torchtitan_speechlm.data import loader, stream, reader, tasks\n"
        "from torchtitan_speechlm.components import loss, metrics, validate, resume\n"
        "from torchtitan_speechlm.infra import parallelize\n"
        "from torchtitan_speechlm.model import model\n"
        f"bad = [m for m in sys.modules if m.startswith({OFFLINE!r})]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_no_import_cycles_between_modules():
    graph = {module_name(f): imports(f, top_level_only=True) for f in PKG.rglob("*.py")}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n) :] + [n]))
            if n in graph and not state.get(n):
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if not state.get(m):
            visit(m, [m])


def test_every_package_says_what_it_holds():
    for init in PKG.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(PKG.parent)} has no docstring"
    for d, _, files in os.walk(PKG):
        if any(f.endswith(".py") for f in files) and "__pycache__" not in d:
            assert (Path(d) / "__init__.py").exists(), d
