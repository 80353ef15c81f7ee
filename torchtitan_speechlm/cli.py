"""The `torchtitan` console script: one subcommand per job (`train`, `prepare`, ...), each
implemented in its own module (commands/).

Start-up is one rule: a command line is parsed by the command's argument module (standard library
only: commands/*_args.py) before the command's implementation, and with it torch, is imported.
So `torchtitan --help`, `torchtitan generate --help` and a mistyped flag answer in a fraction of
a second; tests/unit/commands/test_startup.py holds it. `train` parses with torchtitan's config
manager, so it imports first; `train --help` is a page made from our config's docstrings
(commands/train_help.py), before torch. `prepare` parses with its sources' flags: its own are
registered without torch (commands/prepare_args.py), so it parses before torch too, unless the
command line names `--import` modules, whose sources must be registered first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from torchtitan_speechlm.commands import (
    export_args,
    generate_args,
    prefer_args,
    prepare_args,
    serve_args,
)
from torchtitan_speechlm.commands.train_help import train_help
from torchtitan_speechlm.utils.progress import Progress

QUIET = ("--no-progress", "--quiet")  # the commands' flag turning progress lines off

SUBCOMMANDS = {
    "train": "train a model with torchtitan's loop (torchtitan train --job.config_file X.toml)",
    "prepare": "turn a JSONL manifest, Kaldi folder or HF dataset into a prepared (tokenised) dataset",
    "export": "write a training checkpoint as a self-contained model folder (and its text LM)",
    "generate": "TTS to a wav, ASR to text, speech continuation, from a checkpoint or an export",
    "eval": "word/character error rates and TTS scores of a model on prepared data",
    "serve": "an HTTP server with OpenAI's speech and transcription routes over one model",
    "prefer": "rounds of sampling, judging and DPO/SimPO training (the online preference loop)",
}

# the subcommands whose arguments are parsed before their implementation is imported
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "generate": generate_args.build_generate_parser,
    "eval": generate_args.build_eval_parser,
    "export": export_args.build_parser,
    "serve": serve_args.build_parser,
    "prefer": prefer_args.build_parser,
}


def _usage() -> str:
    lines = ["usage: torchtitan <command> [args]", "", "commands:"]
    lines += [f"  {name:<9}{text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", "Run `torchtitan <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in SUBCOMMANDS:
        print(f"torchtitan: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if cmd == "train" and any(a in ("-h", "--help") for a in rest):  # a page, before torch
        print(train_help())
        return 0
    args = PARSERS[cmd]().parse_args(rest) if cmd in PARSERS else None  # --help ends here
    if cmd == "prepare" and not prepare_args.named_imports(rest):  # its own flags: before torch
        args = prepare_args.build_parser().parse_args(rest)
    quiet = not getattr(args, "progress", True) or any(a in QUIET for a in rest)
    # importing torch and the command takes seconds (more on a busy machine): said, if it lasts
    with Progress(f"torchtitan {cmd}", enabled=not quiet) as starting:
        starting.status = "starting (importing torch and the command)"
        command = _command(cmd, parsed=args is not None)
    return command(rest if args is None else args) or 0


def _command(cmd: str, parsed: bool) -> Callable:
    """The function that runs ``cmd`` (importing it imports torch): on the parsed arguments, or
    (``parsed`` false: `train`, `prepare` with ``--import``) on the command line."""
    if cmd == "train":
        from torchtitan_speechlm.commands.train import train_command

        return train_command
    if cmd == "prepare":
        from torchtitan_speechlm.commands.prepare import main as prepare_main
        from torchtitan_speechlm.commands.prepare import run as prepare_run

        return prepare_run if parsed else prepare_main
    if cmd in ("generate", "eval"):
        from torchtitan_speechlm.commands.generate import run_eval, run_generate

        return run_generate if cmd == "generate" else run_eval
    if cmd == "prefer":
        from torchtitan_speechlm.commands.prefer import run as run_prefer

        return run_prefer
    if cmd == "serve":
        from torchtitan_speechlm.commands.serve import run as run_serve

        return run_serve
    from torchtitan_speechlm.commands.export import run as run_export

    return run_export


if __name__ == "__main__":
    sys.exit(main())
