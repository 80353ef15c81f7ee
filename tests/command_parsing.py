"""Parse a command line with the parser of the program it names, without running the program:
the `torchtitan` subcommands, `python benchmarks/X.py`, `python tools/X.py`,
`make X` and `bash X.sh` (``check``; the rules are in tests/docs/test_doc_commands.py's docstring). Used by
tests/docs/test_doc_commands.py (the commands README.md and docs/ show) and tests/integration/test_benchmarks_run.py (the
benchmarks' own usage lines, run_all.py's list, gpu_check.sh's steps)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
STAND_IN_TOML = "train_configs/speechlm_debug.toml"  # for a placeholder config file name
PLACEHOLDER = re.compile(r"(^|[/=:])([A-Z][A-Z0-9_]*)(\.[a-z]+)?($|[/.])")


class CommandError(AssertionError):
    """The command does not parse (the parser's message), or names what does not exist."""


def is_placeholder(value: str) -> bool:
    """DIR, RUN_DIR, X.toml, OUTPUT_DIR/titan_trainer.toml, my_module: a value to fill in."""
    return bool(PLACEHOLDER.search(value)) or value.startswith("my_")


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def captured_parser(main: Callable, *args) -> argparse.ArgumentParser:
    """The ArgumentParser ``main`` builds, taken at its first ``parse_args`` call (``main``
    stops there): for programs that build their parser inside ``main``."""
    original = argparse.ArgumentParser.parse_args

    def capture(self, *a, **k):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        main(*args)
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{main} returned without parsing its arguments")


def parse(parser: argparse.ArgumentParser, argv: list[str], *, relaxed: bool = False):
    """``parser.parse_args(argv)``; CommandError with argparse's message instead of exiting.
    ``relaxed``: required options may be missing (a command quoted in part)."""
    if relaxed:
        for action in parser._actions:
            action.required = False
        for group in parser._mutually_exclusive_groups:
            group.required = False
    argv = list(argv)
    for i in range(len(argv) - 1):  # `--limit N`: a placeholder for a number
        action = parser._option_string_actions.get(argv[i])
        if action is not None and action.type in (int, float) and is_placeholder(argv[i + 1]):
            argv[i + 1] = "1"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit as e:
        raise CommandError(f"{argv}: {err.getvalue().strip() or e}") from None


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def load_script(path: str | Path):
    """Import benchmarks/X.py or tools/X.py as a module (its folder on sys.path, as
    `python X.py` has it)."""
    path = Path(path)
    if not path.is_absolute():
        path = ROOT / path
    if not path.is_file():
        raise CommandError(f"{path} does not exist")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    name = path.stem
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def script_parser(path: str | Path) -> argparse.ArgumentParser:
    """A script's parser: its ``build_parser()``, else the one its ``main`` builds."""
    module = load_script(path)
    if hasattr(module, "build_parser"):
        return module.build_parser()
    return captured_parser(module.main)


def module_parser(name: str) -> argparse.ArgumentParser | None:
    """``python -m NAME``'s parser (its ``build_parser()``), None if it parses no flags."""
    if importlib.util.find_spec(name) is None:
        raise CommandError(f"no module {name}")
    module = importlib.import_module(name)
    return module.build_parser() if hasattr(module, "build_parser") else None


def subcommand_parser(sub: str, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of ``torchtitan SUB`` (cli.py's dispatch); prepare first imports the
    ``--import`` modules of ``argv``, as it does when run."""
    from torchtitan_speechlm import cli

    if sub not in cli.SUBCOMMANDS:
        raise CommandError(f"torchtitan has no subcommand {sub!r} ({sorted(cli.SUBCOMMANDS)})")
    if sub == "prepare":
        from torchtitan_speechlm.commands import prepare, prepare_args

        prepare.import_extensions(argv)
        return prepare_args.build_parser()
    if sub in cli.PARSERS:
        return cli.PARSERS[sub]()
    raise CommandError(f"torchtitan {sub}: no argparse parser (train: use parse_train)")


def parse_train(argv: list[str], relaxed: bool = False):
    """`torchtitan train ARGV` as the command parses it (launcher flags split off, our config
    module merged, booleans normalised), through torchtitan's ConfigManager, with the TOML's
    keys checked against the config classes; the job is not validated (its data need not
    exist here) and not run. A placeholder config file name (X.toml) is replaced by the
    debug config, so that the overrides are still checked."""
    from torchtitan.config import ConfigManager

    from torchtitan_speechlm.commands.train import _split_launcher_args, torchtitan_args
    from torchtitan_speechlm.config import check_toml

    _, args = _split_launcher_args(argv)
    keys = ("--job.config_file", "--job.config-file")
    at = [i for i, a in enumerate(args) if a in keys]
    if not at or at[0] + 1 >= len(args):
        if relaxed:
            args = ["--job.config_file", STAND_IN_TOML, *args]
            at = [0]
        else:
            raise CommandError(f"torchtitan train {argv}: no --job.config_file FILE")
    i = at[0] + 1
    if not (ROOT / args[i]).is_file():
        if not is_placeholder(args[i]):
            raise CommandError(f"torchtitan train: {args[i]} does not exist")
        args = [*args[:i], STAND_IN_TOML, *args[i + 1 :]]
    args = [str(ROOT / a) if j == i else a for j, a in enumerate(args)]
    args = torchtitan_args(args)
    manager = ConfigManager()
    values = manager._maybe_load_toml(args)
    check_toml(values, manager._maybe_add_custom_config(args, values), source=args[i])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return manager.parse_args(args)
    except SystemExit as e:
        raise CommandError(f"torchtitan train {argv}: {err.getvalue().strip() or e}") from None


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def bash_syntax_ok(path: str | Path) -> None:
    import subprocess

    r = subprocess.run(["bash", "-n", str(ROOT / path)], capture_output=True, text=True)
    if r.returncode != 0:
        raise CommandError(f"bash -n {path}: {r.stderr.strip()}")


# ---- checking one command as shown ------------------------------------------------------------
TORCHTITAN = ("torchtitan", ".venv/bin/torchtitan")
PYTHON = ("python", "python3", ".venv/bin/python")
PROGRAMS = (*TORCHTITAN, *PYTHON, "make", "bash", "sbatch", "source")
ACTIVATE = ".venv/bin/activate"  # the Makefile's virtual environment (VENV), made by `make`


@dataclass
class Shown:
    """A command as a document shows it (``inline``: quoted in a sentence, maybe in part)."""

    where: str
    text: str
    inline: bool


def _words(text: str) -> list[str]:
    return shlex.split(text, comments=True)


def _is_synopsis(words: list[str]) -> bool:
    return any(w.startswith(("[", "(")) or w.endswith(("]", ")")) or w == "|" for w in words)


def _synopsis(text: str, parse_one, options: set[str], skip: int) -> None:
    """Flags exist; without the optional [...] parts it parses, and with each one added."""
    flags = {w.strip("[]()") for w in _words(text) if w.strip("[(").startswith("--")}
    unknown = sorted(f for f in flags if f.split("=")[0] not in options)
    if unknown:
        raise CommandError(f"no such option(s) {unknown}")
    groups = re.findall(r"\[([^\[\]]*)\]", text)
    base = text
    while re.search(r"\[[^\[\]]*\]", base):
        base = re.sub(r"\[[^\[\]]*\]", "", base)
    if "(" in base or "|" in base:  # alternatives of required parts: flags checked above
        return
    base_argv = _words(base)[skip:]
    parse_one(base_argv)
    for g in groups:
        tokens = g.split()
        if not tokens or not tokens[0].startswith("--") or "[" in g:
            continue
        values = tokens[1:]
        if len(values) == 1 and "|" in values[0]:
            for alt in values[0].split("|"):
                parse_one([*base_argv, tokens[0], alt])
        else:
            parse_one([*base_argv, *tokens])


def _partial(argv: list[str], parser) -> list[str]:
    """An inline quote's arguments: `...` dropped (as a flag's value: a placeholder), and a
    trailing flag without its value (`--fit-kmeans-codec`) checked to exist, then dropped."""
    out = []
    for a in argv:
        if a not in ("...", "…"):
            out.append(a)
        elif out and _takes_value(parser, out[-1]):
            out.append("VALUE")
    argv = out
    if argv and argv[-1].startswith("--"):
        action = parser._option_string_actions.get(argv[-1].split("=")[0])
        if action is None:
            raise CommandError(f"no such option {argv[-1]}")
        if action.nargs != 0 and "=" not in argv[-1]:
            argv = argv[:-1]
    return argv


def _with_parser(parser, argv: list[str], shown: Shown, text: str, skip: int) -> None:
    def one(a):
        from copy import deepcopy

        parse(deepcopy(parser), a, relaxed=shown.inline)

    if _is_synopsis(argv):
        _synopsis(text, one, option_strings(parser), skip)
    elif shown.inline:
        one(_partial(argv, parser))
    else:
        one(argv)


def check(shown: Shown) -> None:
    text = shown.text
    words = _words(text)
    prog = words[0]
    if prog in TORCHTITAN:
        from torchtitan_speechlm.cli import SUBCOMMANDS

        sub, argv = (words[1], words[2:]) if len(words) > 1 else (None, [])
        if sub is None or (shown.inline and sub.endswith(":")):
            return  # `torchtitan` alone, or a quoted message (`torchtitan train: rank 3: ...`)
        if sub in ("-h", "--help", "help") and not argv:
            return  # the console script's own usage (cli.main)
        if sub == "train" and argv in (["-h"], ["--help"], ["--help-all"]):
            return  # cli.py's page and tyro's full list (tests/unit/commands/test_startup.py)
        if argv in (["-h"], ["--help"]) and sub != "train":
            subcommand_parser(sub, [])  # a subcommand's usage: the subcommand must exist
            return
        if sub not in SUBCOMMANDS:
            raise CommandError(f"torchtitan has no subcommand {sub!r}")
        if shown.inline and not argv:
            return  # `torchtitan prepare`: a mention of the command
        if sub == "train":
            if _is_synopsis(argv):
                raise CommandError("a train synopsis: not checked (write the command)")
            parse_train(_partial(argv, _NoParser()) if shown.inline else argv, shown.inline)
            return
        _with_parser(subcommand_parser(sub, argv), argv, shown, text, skip=2)
    elif prog == "make":
        targets = make_targets()
        missing = [t for t in words[1:] if "=" not in t and t not in targets]
        if missing or len(words) < 2:
            raise CommandError(f"Makefile has no target(s) {missing or words[1:]}")
    elif prog == "source":  # the quickstart's activation of the environment make installs into
        if shown.inline and len(words) == 1:
            return  # the word itself (a field named `source`), not a command
        venv = re.search(r"^VENV \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
        if words[1:] != [ACTIVATE] or not venv or f"{venv.group(1)}/bin/activate" != ACTIVATE:
            raise CommandError(f"source: only `source {ACTIVATE}` (the Makefile's VENV): {text}")
    elif prog == "bash":
        bash_syntax_ok(words[1])
    elif prog == "sbatch":  # a batch script of the repo, its config argument a file of the repo
        bash_syntax_ok(words[1])
        if len(words) > 2 and words[2].endswith(".toml") and not (ROOT / words[2]).is_file():
            raise CommandError(f"sbatch: no config file {words[2]}")
    elif prog in PYTHON or prog.startswith("benchmarks/"):
        rest = words[1:] if prog in PYTHON else words
        if rest[:2] == ["-m", "torch.distributed.run"]:  # torchrun's flags, then its program
            from torch.distributed.run import get_args_parser

            ns = get_args_parser().parse_args(rest[2:])
            inner = ["-m"] if ns.module else []
            inner += [ns.training_script, *ns.training_script_args]
            return check(Shown(shown.where, shlex.join([prog, *inner]), shown.inline))
        if rest[:1] == ["-m"]:
            parser = module_parser(rest[1])
            argv, skip = rest[2:], 4 if prog in PYTHON else 3
            if parser is None:
                if argv:
                    raise CommandError(f"python -m {rest[1]} takes no parsed flags: {argv}")
                return
        elif rest and rest[0].startswith(("benchmarks/", "tools/")) and rest[0].endswith(".py"):
            parser, argv = script_parser(rest[0]), rest[1:]
            skip = 2 if prog in PYTHON else 1
        else:
            raise CommandError(f"not a command this test knows how to check: {text}")
        _with_parser(parser, argv, shown, text, skip)
    else:
        raise CommandError(f"unknown program {prog}")


def _takes_value(parser, word: str) -> bool:
    action = parser._option_string_actions.get(word)
    return action is not None and action.nargs != 0 and "=" not in word


class _NoParser:
    _option_string_actions: dict = {}
