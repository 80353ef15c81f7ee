"""Every command README.md and docs/*.md show runs as written, as far as its parser can tell
without running it: the shell lines of the fenced code blocks (joined over `\\` and indented
continuation lines) and the inline `code` spans that start with a command.

- `torchtitan SUB ...` / `.venv/bin/torchtitan SUB ...`: SUB is one of cli.py's subcommands and
  the arguments parse with SUB's own parser (prepare: after importing its `--import` modules,
  as it does; the docs' `my_module` is docs/extending.md's codec and source recipes). `train`:
  through torchtitan's ConfigManager with our config module (cli -> commands/train.py's path), the TOML
  must exist and its keys are checked (a placeholder name such as X.toml stands for the debug
  config, so the overrides are still parsed);
- `python benchmarks/X.py ...` (or `benchmarks/X.py ...` in a table): the script's parser;
- `python -m torchtitan_speechlm.X ...`: the module exists and its `build_parser()` parses;
- `make X`: the Makefile has the target; `bash X.sh`: the file exists and `bash -n` passes.

Placeholders (DIR, RUN_DIR, my_module) are fine as values. A synopsis (`[--flag V]`, `(A | B)`)
must name only existing flags, and without its optional parts (each one added alone, every
`a|b|c` value tried) it must parse. An inline span may quote a command in part (`...`, no
required flags, a trailing flag without its value): its flags must exist and what it gives
must parse. Output and TOML are not commands: only lines starting with a command are read,
and every line of a ```bash block must be one."""

from __future__ import annotations

import re
import sys

import pytest

from tests.command_parsing import PROGRAMS, ROOT, CommandError, Shown, check

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = ("bash", "sh", "shell", "console")
NOT_COMMANDS = ("python", "json", "toml", "yaml", "text", "jsonl")  # block languages
FENCE = re.compile(r"^( *)```(\S*)[^\n]*\n(.*?)^\1```[^\n]*$", re.S | re.M)


def _starts_a_command(text: str) -> bool:
    first = text.split(maxsplit=1)[0] if text.strip() else ""
    return first in PROGRAMS or bool(re.fullmatch(r"benchmarks/\w+\.py", first))


def _blocks(doc, text: str):
    """(Shown commands, lines of shell blocks that are not commands) of the fenced blocks."""
    shown, strays = [], []
    for m in FENCE.finditer(text):
        lang = m.group(2).lower()
        if lang in NOT_COMMANDS:
            continue
        first_line = text[: m.start(3)].count("\n") + 1
        current = None
        for k, line in enumerate(m.group(3).splitlines()):
            stripped = line.strip()
            if current is not None and (
                current.text.endswith("\\")
                or (line[:1].isspace() and stripped[:1] in ("[", "(", "-", "|"))
            ):
                current.text = current.text.rstrip("\\").rstrip() + " " + stripped
                continue
            current = None
            if _starts_a_command(stripped):
                current = Shown(f"{doc.name}:{first_line + k}", stripped, inline=False)
                shown.append(current)
            elif lang in SHELL_BLOCKS and stripped and not stripped.startswith("#"):
                strays.append(f"{doc.name}:{first_line + k}: {stripped}")
    return shown, strays


def _inline(doc, text: str) -> list[Shown]:
    """Inline code spans starting with a command (a span may wrap over lines of a paragraph)."""
    blanked = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out = []
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", blanked):
        span = m.group(1)
        if "\n\n" in span or not _starts_a_command(span.strip()):
            continue
        line = blanked[: m.start()].count("\n") + 1
        out.append(Shown(f"{doc.name}:{line}", " ".join(span.split()), inline=True))
    return out


def shown_commands() -> tuple[list[Shown], list[str]]:
    shown, strays = [], []
    for doc in DOCS:
        text = doc.read_text()
        blocks, stray = _blocks(doc, text)
        shown += blocks + _inline(doc, text)
        strays += stray
    return shown, strays


SHOWN, STRAYS = shown_commands()


def test_the_docs_show_commands_and_every_shell_line_is_one():
    assert len(SHOWN) >= 40, [s.text for s in SHOWN]
    assert not STRAYS, "lines of ```bash blocks that this test does not check:\n" + "\n".join(
        STRAYS
    )


# ---- the docs' `--import my_module`: docs/extending.md's codec and source recipes -------------
@pytest.fixture
def extension_module(tmp_path, monkeypatch):
    """my_module.py in the current directory (as a user has it); registries restored after."""
    from torchtitan_speechlm.codecs.base import CODECS
    from torchtitan_speechlm.prepare.sources import SOURCES

    text = (ROOT / "docs" / "extending.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    recipes = [b for b in blocks if "register_codec(" in b or "register_source(" in b]
    assert len(recipes) == 2, "extending.md: one codec and one source recipe"
    (tmp_path / "my_module.py").write_text("\n\n".join(recipes))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved = {reg: dict(reg._items) for reg in (CODECS, SOURCES)}
    yield
    for reg, items in saved.items():
        reg._items.clear()
        reg._items.update(items)
    sys.modules.pop("my_module", None)


@pytest.mark.parametrize("shown", SHOWN, ids=[f"{s.where}:{i}" for i, s in enumerate(SHOWN)])
def test_shown_command_parses(shown, request):
    if "--import" in shown.text.split():
        request.getfixturevalue("extension_module")
    try:
        check(shown)
    except CommandError as e:
        pytest.fail(f"{shown.where}: `{shown.text}`:\n{e}", pytrace=False)


def test_a_broken_command_is_caught():
    """The checks fail where they should (so a passing run means something)."""
    bad = [
        "python benchmarks/bench_vs_llama3.py --sizes debug --steps 5",  # flags of old
        "torchtitan eval --model DIR",  # --valid is required
        "torchtitan export --checkpoint C --out-dir O --dtype fp8",  # not a choice
        "torchtitan train --job.config_file train_configs/no_such.toml",
        "torchtitan train --job.config_file X.toml --training.no_such_key 3",
        "torchtitan synthesise --model DIR",  # no such subcommand
        "make no-such-target",
        "python -m torchtitan_speechlm.commands.wandb_offline",  # RUN_DIR missing
        "torchtitan generate --model DIR [--temperature-typo 0.7]",  # synopsis, bad flag
        "source venv/bin/activate",  # not the environment make installs into
    ]
    for text in bad:
        with pytest.raises(CommandError):
            check(Shown("test", text, inline=False))
    with pytest.raises(CommandError):  # a quoted part still names real flags
        check(Shown("test", "torchtitan prepare --no-such-flag", inline=True))
