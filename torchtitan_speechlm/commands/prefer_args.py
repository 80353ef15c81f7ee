"""The arguments of ``torchtitan prefer`` (commands/prefer.py): the online preference loop.

Standard library only: cli.py parses a command line with this parser before it imports the
command (torch, the model, the judges), so ``--help`` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse

from torchtitan_speechlm.commands.flag_fields import add_flag
from torchtitan_speechlm.commands.generate_args import add_decoding_args, add_judge_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchtitan prefer",
        description="rounds of: sample with the latest model -> judge -> pairs -> prepare -> "
        "train N steps of DPO/SimPO (docs/preference.md, The online loop); rerun the same "
        "command to continue after any interruption",
    )
    add_flag(
        p,
        "--job.config_file",  # train's name for it
        old=("--config",),
        dest="config",
        metavar="FILE.toml",
        required=True,
        help="the preference training TOML ([speechlm] preference_loss, init_from: the model "
        "the first round samples from and starts at); the loop sets its data",
    )
    p.add_argument(
        "--prompts",
        action="append",
        required=True,
        metavar="TASK:DATA",
        help="tts:DIR, asr:DIR or tts_prompt:DIR: a prepared folder whose items are the prompts "
        "(repeatable)",
    )
    p.add_argument("--work", required=True, help="the loop's folder: one round-N/ per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds (2)")
    p.add_argument("--steps", type=int, default=50, help="training steps per round (50)")
    p.add_argument("--limit", type=int, default=0, help="prompts per set (0: all)")
    p.add_argument("--samples", type=int, default=4, metavar="K", help="samples per prompt (4)")
    p.add_argument(
        "--reward",
        action="append",
        metavar="[TASK:]SCORE=W,...",
        help="as `torchtitan eval --reward` (default wer=-1)",
    )
    p.add_argument(
        "--pair-margin", type=float, default=0.0, help="as `torchtitan eval --pair-margin` (0)"
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="training processes (1)")
    p.add_argument(
        "--train-arg",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="one more `torchtitan train` override for every round, e.g. "
        "training.seq_len=2048 (repeatable)",
    )
    add_judge_args(p)
    add_decoding_args(p)
    p.set_defaults(temperature=0.8, text_temperature=0.8)
    return p
