"""The arguments of ``torchtitan generate`` and ``torchtitan eval`` (commands/generate.py):
``GenerateArgs`` and ``EvalArgs``, whose fields are the flags (commands/flag_fields.py); the
decoding flags (``DecodingArgs``: ``serve`` and ``prefer`` take them too) and the judge flags
(``JudgeArgs``: ``prefer`` too) are base classes of them.

Standard library only: cli.py parses a command line with these parsers before it imports the
command (torch, the model, the judges), so ``--help`` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from torchtitan_speechlm.commands.flag_fields import (
    add_flags,
    command_line,
    flag,
    from_namespace,
)
from torchtitan_speechlm.evaluation.pairs import check_sampling

EVAL_TASKS = ("asr", "tts", "tts_prompt", "dialogue")  # the TASK of ``--valid TASK:DATA``
MODEL_HELP = "a checkpoint step folder or an export folder"


def progress_help(what: str) -> str:
    return f"no progress lines on stderr ({what}; a line at least every 5 s otherwise)"


PAIRS = "preference pairs (docs/preference.md)"
JUDGES = "judges (independent models scoring TTS; see docs/generation.md)"
DECODING = "decoding"


@dataclass(kw_only=True)
class DecodingArgs:
    """The decoding flags, shared by ``generate``, ``eval``, ``serve`` and ``prefer``
    (commands/decoding.py's ``decode_config`` makes them a ``DecodeConfig``)."""

    temperature: float = flag(0.0, group=DECODING, help="audio sampling (%(default)g; 0 = greedy)")
    top_k: int = flag(0, group=DECODING, help="audio: the k most likely codes (0 = all)")
    top_p: float = flag(1.0, group=DECODING, help="audio: nucleus mass (1 = off)")
    text_temperature: float = flag(0.0, group=DECODING, help="text (%(default)g; 0 = greedy)")
    text_top_k: int = flag(0, group=DECODING, help="text: as --top-k (0 = all)")
    text_top_p: float = flag(1.0, group=DECODING, help="text: as --top-p (1 = off)")
    cfg_scale: float = flag(1.0, group=DECODING, help="TTS guidance (1 = off)")
    min_frames: int = flag(1, group=DECODING, help="TTS: no end before (1)")
    max_frames: int = flag(
        500,
        group=DECODING,
        help="TTS: audio frames at most (500); a generation cut here is reported as such",
    )
    max_text_tokens: int = flag(200, group=DECODING, help="ASR: text tokens at most (200)")
    seed: int = flag(0, group=DECODING, help="the sampling seed (0)")
    best_of: int = flag(
        1,
        group=DECODING,
        metavar="N",
        help="TTS: sample N renditions of each text (seeds --seed .. --seed + N - 1; needs "
        "--temperature > 0) and keep the one the model's own ASR reads back closest to the "
        "text (1 = off; docs/generation.md, Best of N)",
    )
    no_cache: bool = flag(False, group=DECODING, help="recompute every step (slow)")
    compile: str = flag(
        "auto",
        group=DECODING,
        choices=("auto", "on", "graphs", "off"),
        help="the one-frame decode step under torch.compile (auto: on CUDA, for the native and "
        "qwen3 backbones' static cache; on: also on a CPU; graphs: torch.compile's "
        "reduce-overhead mode, replayed as CUDA graphs, CUDA only; off) (default: auto)",
    )
    device: str = flag("cpu", group=DECODING, help="torch device (cpu), e.g. cuda")

    def check_decoding(self) -> None:
        """The decoding flags' own checks, which every command taking them runs: a ValueError
        naming the flag."""
        if self.best_of < 1:
            raise ValueError(f"--best-of {self.best_of}: at least 1")
        if self.best_of > 1 and self.temperature <= 0:
            raise ValueError(
                f"--best-of {self.best_of} with --temperature {self.temperature:g}: greedy "
                "decoding speaks every sample alike; sample, e.g. --temperature 0.6"
            )


@dataclass(kw_only=True)
class JudgeArgs:
    """The judge flags, shared by ``eval`` and ``prefer``."""

    judge_asr: str = flag(
        "pocketsphinx",
        group=JUDGES,
        metavar="NAME_OR_DIR",
        help="ASR judge: a judge name, a transformers ASR model folder, or none (pocketsphinx)",
    )
    judge_vocabulary: str | None = flag(
        None,
        group=JUDGES,
        metavar="eval|open|FILE",
        help="pocketsphinx: eval (default: a free word loop over the set's words), open (its "
        "shipped LM) or a file of words",
    )
    judge_grammar: str | None = flag(
        None, group=JUDGES, metavar="FILE.jsgf", help="pocketsphinx: a JSGF grammar"
    )
    judge_word_loop: bool = flag(
        False,
        group=JUDGES,
        help="also score TTS with pocketsphinx's free word loop over each set's words (the "
        "results' word_loop: WER, its floor on the references), e.g. beside --judge-grammar",
    )
    judge_speaker: str = flag(
        "resemblyzer",
        group=JUDGES,
        metavar="NAME_OR_DIR",
        help="speaker judge (SIM): a judge name, a transformers speaker-verification folder, or "
        "none (resemblyzer)",
    )
    judge_quality: str = flag(
        "dnsmos", group=JUDGES, metavar="NAME", help="quality judge: dnsmos or none (dnsmos)"
    )
    judge_quality_items: int = flag(
        0,
        group=JUDGES,
        metavar="N",
        help="the quality judge scores only the first N items of each TTS set (0: all); "
        "DNSMOS costs about 1.5 s per short clip, for the generated and the reference audio",
    )


@dataclass(kw_only=True)
class EvalArgs(JudgeArgs, DecodingArgs):
    """The settings of ``torchtitan eval``: each field is a flag (its dest, default, help:
    commands/flag_fields.py), ``build_eval_parser`` is generated from them, and ``evaluate``
    (commands/generate.py) takes the value whole. The judge and decoding flags are shared with
    ``generate``, ``serve`` and ``prefer`` (``add_judge_args``, ``add_decoding_args``)."""

    model: str = flag(help=MODEL_HELP)
    valid: list[str] = flag(
        action="append",
        metavar="TASK:DATA",
        help="asr:NAME, tts:NAME, tts_prompt:NAME or dialogue:NAME (a dataset of the run, or "
        "a prepared folder; tts_prompt: each item prompted with another utterance of its "
        "speaker, scored by SIM to the prompt and speaker ID; dialogue: the answer each "
        "dialogue ends in, e.g. spoken QA)",
    )
    valid_fraction: float = flag(
        0.0,
        help="only the items training held out with this fraction (its id hash; 0: all items)",
    )
    limit: int = flag(0, help="at most this many items per set (0: all)")
    out: str | None = flag(None, metavar="FILE.json", help="write the results as JSON here")
    report: str | None = flag(
        None, metavar="DIR", help="write DIR/index.html with audio and spectrograms"
    )
    progress: bool = flag(
        True,
        names=("--no-progress", "--quiet"),
        action="store_false",
        help=progress_help("per item: done, seconds per phase"),
    )
    samples: int = flag(
        1,
        group=PAIRS,
        metavar="K",
        help="with --pairs: K samples per item, sample k decoded with seed --seed + k (1)",
    )
    pairs: str | None = flag(
        None,
        group=PAIRS,
        metavar="FILE.jsonl",
        help="write each item's best and worst judged sample as a preference pair (the "
        "`torchtitan prepare --preference` format; tts, asr and tts_prompt sets) and every sample to "
        "FILE.samples.jsonl",
    )
    reward: list[str] | None = flag(
        None,
        group=PAIRS,
        action="append",
        metavar="[TASK:]SCORE=W,...",
        help="the reward ranking the samples: a weighted sum of wer, cer, sim, dnsmos, ended, "
        "duration_ratio_error, self_wer, self_cer (asr sets: wer, cer; tts_prompt sets: sim is "
        "SIM to the prompt); TASK: for one task's sets only, e.g. --reward tts:wer=-1,ended=0.5 "
        "--reward asr:wer=-1 --reward tts_prompt:sim=1,wer=-1 (default wer=-1)",
    )
    pair_margin: float = flag(
        0.0,
        group=PAIRS,
        help="no pair where the best and worst rewards differ by this or less (0)",
    )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EvalArgs:
        """The parsed ``torchtitan eval`` command line (``build_eval_parser().parse_args``)."""
        return from_namespace(cls, ns)

    def validate(self) -> None:
        """The checks of the settings themselves (before any model or data is read): a
        ValueError naming the flag."""
        self.check_decoding()
        if self.pairs and self.best_of > 1:
            raise ValueError(
                f"--best-of {self.best_of} with --pairs: the pairs are ranked from every sample "
                "as drawn (--samples); drop --best-of"
            )
        for spec in self.valid:
            task = spec.partition(":")[0]
            if task not in EVAL_TASKS:
                raise ValueError(f"--valid {spec!r}: the task is asr, tts, tts_prompt or dialogue")
            if self.pairs:
                check_sampling(task, self.samples, self.temperature, self.text_temperature)

    def command_line(self, names: list[str] | None = None) -> list[str]:
        """The ``torchtitan eval`` flags giving the fields ``names`` (all by default) their
        values (flag_fields.command_line)."""
        return command_line(self, names)


@dataclass(kw_only=True)
class GenerateArgs(DecodingArgs):
    """The settings of ``torchtitan generate``: each field is a flag (commands/flag_fields.py),
    ``build_generate_parser`` is generated from them, and ``generate`` (commands/generate.py)
    takes the value whole. One request (``--task`` and its inputs, written to ``--out``, a
    FILE) or a batch file of them (``--batch``, written into ``--out-dir``, a FOLDER)."""

    model: str = flag(help=MODEL_HELP)
    task: str | None = flag(None, help="tts, asr, continuation or answer (spoken QA)")
    text: str | None = flag(None, help="tts: the text to speak; answer: an instruction (optional)")
    audio: str | None = flag(
        None, help="asr / continuation / answer: an audio file (any rate, any channels)"
    )
    prompt: str | None = flag(
        None,
        help="tts: a recording of the voice to speak in (any rate, any channels; cut to the "
        "model's prompt_seconds); for models trained with the tts_prompt task",
    )
    out: str | None = flag(None, help="the wav (tts, continuation) or text file (asr, answer)")
    batch: str | None = flag(None, help="a JSONL file of requests")
    out_dir: str | None = flag(None, help="with --batch: where outputs and results.jsonl go")
    batch_size: int = flag(
        8, help="with --batch: requests decoded together (grouped by task and length; 8)"
    )
    stream: bool = flag(
        False,
        help="write each wav while it is generated (the codec's stream decoder); the result "
        "line gives the time to first audio",
    )
    progress: bool = flag(
        True,
        names=("--no-progress", "--quiet"),
        action="store_false",
        help=progress_help("the model loaded, frames decoded"),
    )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> GenerateArgs:
        """The parsed ``torchtitan generate`` command line (``build_generate_parser``)."""
        return from_namespace(cls, ns)

    def validate(self) -> None:
        """The checks of the settings themselves (before the model is read): a ValueError
        naming the flag. (A request's task and inputs are checked against the model.)"""
        self.check_decoding()
        if self.best_of > 1 and self.task not in (None, "tts"):
            raise ValueError(f"--best-of is for --task tts (speech from text), not {self.task}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size {self.batch_size}: at least 1")
        if self.out_dir is not None and not self.batch:
            raise ValueError("--out-dir is the folder of a --batch's outputs; one request "
                             "writes --out FILE")  # fmt: skip
        if self.out is not None and self.batch:
            raise ValueError("--out is one request's FILE; a --batch writes into --out-dir "
                             "FOLDER")  # fmt: skip

    def command_line(self, names: list[str] | None = None) -> list[str]:
        """The ``torchtitan generate`` flags giving the fields ``names`` (all by default)."""
        return command_line(self, names)


def build_generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchtitan generate", description="generate with a SpeechLM")
    add_flags(p, GenerateArgs)
    return p


def build_eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchtitan eval", description="score a SpeechLM")
    add_flags(p, EvalArgs)
    return p


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The decoding flags (``DecodingArgs``)."""
    add_flags(p, DecodingArgs)


def add_judge_args(p: argparse.ArgumentParser) -> None:
    """The judge flags (``JudgeArgs``)."""
    add_flags(p, JudgeArgs)
