"""The `torchtitan` console script: one subcommand per job (`train`, `prepare`, ...), each
implemented in its own module (commands/train.py, prepare/)."""

from __future__ import annotations

import sys

SUBCOMMANDS = {
    "train": "train a model with torchtitan's loop (torchtitan train --job.config_file X.toml)",
    "prepare": "turn a JSONL manifest, Kaldi folder or HF dataset into a prepared (tokenised) dataset",
    "export": "write a training checkpoint as a self-contained model folder (and its text LM)",
    "generate": "TTS to a wav, ASR to text, speech continuation, from a checkpoint or an export",
    "eval": "word/character error rates and TTS scores of a model on prepared data",
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
    if cmd == "train":
        from torchtitan_speechlm.commands.train import train_command

        return train_command(rest)
    if cmd == "prepare":
        from torchtitan_speechlm.prepare.pipeline import main as prepare_main

        return prepare_main(rest) or 0
    if cmd in ("generate", "eval"):
        from torchtitan_speechlm.commands.generate import eval_main, generate_main

        return (generate_main if cmd == "generate" else eval_main)(rest)
    if cmd == "export":
        from torchtitan_speechlm.commands.export import main as export_main

        return export_main(rest)
    print(f"torchtitan: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
