"""What README.md and docs/*.md tell a new user to run after `make demo` runs, as written.

In a fresh folder the demo's own corpus builder (demo/speaking.py: espeak-ng speech, the
tokenizer, the `torchtitan prepare` commands with the k-means codec) makes `demo_work/`, at a
small size and with a small backbone so that the demo config's 400 steps take seconds; the
repository's `train_configs/` are copied in. Then every shown `torchtitan ...` command that
names no placeholder (DIR, X.toml, ...) and is not a synopsis runs, in the order the pages show
them (README first), each to exit status 0; and every ```python example that is not marked
`# fragment:` in its first line runs in that folder. A command refused where a user would run
it (docs/checkpoints.md's LoRA fine-tuning once was), or an example with a name it never
defines (docs/python-api.md's once had), fails here. tests/docs/test_doc_commands.py checks that every
other command parses.
"""

from __future__ import annotations

import os
import shlex
import shutil

import pytest

from tests import forked
from tests.command_parsing import ROOT, _is_synopsis, is_placeholder
from tests.docs.test_doc_commands import DOCS, FENCE, SHOWN

pytestmark = [pytest.mark.slow, pytest.mark.long]

TORCHTITAN = ("torchtitan", ".venv/bin/torchtitan")
PACKAGE = "torchtitan_speechlm.demo."  # the demo's asset makers (a bf16 backbone folder)
FRAGMENT = "# fragment:"


def runnable(text: str) -> list[str] | None:
    """The argv of a shown `torchtitan` command (or `python -m torchtitan_speechlm.demo.X`: then
    ["-m", X, ...]) a user can run as written, else None."""
    words = shlex.split(text, comments=True)
    if len(words) > 2 and words[:2] == ["python", "-m"] and words[2].startswith(PACKAGE):
        words = ["-m", *words[2:]]
    elif not words or words[0] not in TORCHTITAN or len(words) < 2 or _is_synopsis(words):
        return None
    else:
        words = words[1:]
    if any(is_placeholder(w) for w in words[1:] if not w.startswith("-")):
        return None
    return words


def python_examples() -> list[tuple[str, str]]:
    """(where, code) of every ```python block of the docs, in page order."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(2).lower() == "python":
                line = text[: m.start()].count("\n") + 1
                out.append((f"{doc.name}:{line}", m.group(3)))
    return out


@pytest.fixture(scope="module")
def after_demo(tmp_path_factory):
    """A fresh folder as `make demo` leaves it (small corpus, small backbone)."""
    from torchtitan_speechlm.demo.speaking import CorpusPlan, build_corpus

    # The k-means codec, not `make demo`'s mel codec (demo/run.py's DEMO_CODEC): the commands
    # are the same for either (README shows the one that fits the codec inline), and the mel
    # codec's HiFi-GAN decode of every sample the docs' DPO and `prefer` commands draw made
    # this test about 12 minutes instead of 3 on 2 CPU cores. The mel codec's own tests:
    # tests/unit/codecs/test_vocoder_codecs.py.

    root = tmp_path_factory.mktemp("after_demo")
    shutil.copytree(ROOT / "train_configs", root / "train_configs")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        plan = CorpusPlan(train=48, held_out=4, hidden=32, layers=2, heads=2,
                          tokenizer_vocab=320, kmeans_seconds=60.0)  # fmt: skip
        build_corpus("demo_work", plan, workers=2)
    finally:
        os.chdir(cwd)
    return root


def test_the_docs_commands_and_examples_run_as_written_after_the_demo(after_demo):
    ran, examples = [], []
    for shown in SHOWN:
        argv = None if shown.inline else runnable(shown.text)
        if argv is None:
            continue
        if argv[0] == "-m":  # python -m torchtitan_speechlm.X (checkpoints.md's bf16 folder)
            r = forked.python_module(argv[1], argv[2:], cwd=str(after_demo), timeout=900)
        else:
            r = forked.torchtitan(argv, cwd=str(after_demo), timeout=900)
        assert r.returncode == 0, f"{shown.where}: `{shown.text}`\n{(r.stdout + r.stderr)[-4000:]}"
        ran.append((shown.where, shown.text))
    for where, code in python_examples():
        if code.lstrip().startswith(FRAGMENT):
            continue
        if "register_codec(" in code or "register_source(" in code or "register_task(" in code:
            continue  # docs/extending.md's recipes: tests/docs/test_extending_docs.py runs them in order
        r = forked.python_code(code, cwd=str(after_demo), timeout=600)
        assert r.returncode == 0, f"{where}:\n{code}\n{(r.stdout + r.stderr)[-4000:]}"
        examples.append(where)
    # what a user runs after the demo: README's prepare, train, eval, export and generate, the
    # LoRA fine-tuning and its two exports, and the examples that load those folders
    readme = [text.split()[1] for where, text in ran if where.startswith("README.md")]
    assert readme[:6] == ["prepare", "train", "eval", "export", "generate", "generate"], ran
    assert sum(w.startswith("checkpoints.md") for w, _ in ran) >= 5, ran  # LoRA, the bf16 Qwen3
    assert any("backbone_folder" in text for _, text in ran), ran
    loads = [w for w, c in python_examples() if "exported/" in c or "exported_adapter" in c]
    assert len(loads) == 2 and set(loads) <= set(examples), examples
    assert (after_demo / "exported_adapter" / "adapter" / "adapter_config.json").is_file()


def test_every_python_example_is_run_or_marked_a_fragment():
    """An example that cannot run by itself says so in its first line (`# fragment: ...`,
    naming what the reader supplies); the rest run above (or in tests/docs/test_extending_docs.py)."""
    for where, code in python_examples():
        first = code.lstrip().splitlines()[0]
        if first.startswith(FRAGMENT):
            assert len(first) > len(FRAGMENT) + 10, f"{where}: say what the fragment lacks"
    marked = [w for w, c in python_examples() if c.lstrip().startswith(FRAGMENT)]
    assert "python-api.md:6" in marked, marked  # needs ESPnet's objects: visibly a fragment
