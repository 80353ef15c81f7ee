"""The arguments of ``torchtitan generate`` and ``torchtitan eval`` (commands/generate.py).

Standard library only: cli.py parses a command line with these parsers before it imports the
command (torch, the model, the judges), so ``--help`` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from torchtitan_speechlm.evaluation.pairs import check_sampling

EVAL_TASKS = ("asr", "tts", "tts_prompt", "dialogue")  # the TASK of ``--valid TASK:DATA``


def build_generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchtitan generate", description="generate with a SpeechLM")
    p.add_argument("--model", required=True, help="a checkpoint step folder or an export folder")
    p.add_argument("--task", help="tts, asr, continuation or answer (spoken QA)")
    p.add_argument("--text", help="tts: the text to speak; answer: an instruction (optional)")
    p.add_argument(
        "--audio", help="asr / continuation / answer: an audio file (any rate, any channels)"
    )
    p.add_argument(
        "--prompt",
        help="tts: a recording of the voice to speak in (any rate, any channels; cut to the "
        "model's prompt_seconds); for models trained with the tts_prompt task",
    )
    p.add_argument("--out", help="the wav (tts, continuation) or text file (asr, answer)")
    p.add_argument("--batch", help="a JSONL file of requests")
    p.add_argument("--out-dir", help="with --batch: where outputs and results.jsonl go")
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="with --batch: requests decoded together (grouped by task and length; 8)",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="write each wav while it is generated (the codec's stream decoder); the result "
        "line gives the time to first audio",
    )
    add_progress_arg(p, "the model loaded, frames decoded")
    add_decoding_args(p)
    return p


def add_progress_arg(p: argparse.ArgumentParser, what: str) -> None:
    """``--no-progress`` (``--quiet``): no progress lines on stderr, for scripts."""
    p.add_argument(
        "--no-progress",
        "--quiet",
        dest="progress",
        action="store_false",
        help=f"no progress lines on stderr ({what}; a line at least every 5 s otherwise)",
    )


def build_eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchtitan eval", description="score a SpeechLM")
    p.add_argument("--model", required=True, help="a checkpoint step folder or an export folder")
    p.add_argument(
        "--valid",
        action="append",
        required=True,
        metavar="TASK:DATA",
        help="asr:NAME, tts:NAME, tts_prompt:NAME or dialogue:NAME (a dataset of the run, or "
        "a prepared folder; tts_prompt: each item prompted with another utterance of its "
        "speaker, scored by SIM to the prompt and speaker ID; dialogue: the answer each "
        "dialogue ends in, e.g. spoken QA)",
    )
    p.add_argument(
        "--valid-fraction",
        type=float,
        default=0.0,
        help="only the items training held out with this fraction (its id hash)",
    )
    p.add_argument("--limit", type=int, default=0, help="at most this many items per set")
    p.add_argument("--out", metavar="FILE.json", help="write the results as JSON here")
    p.add_argument(
        "--report", metavar="DIR", help="write DIR/index.html with audio and spectrograms"
    )
    add_progress_arg(p, "per item: done, seconds per phase")
    g = p.add_argument_group("preference pairs (docs/preference.md)")
    g.add_argument(
        "--samples",
        type=int,
        default=1,
        metavar="K",
        help="with --pairs: K samples per item, sample k decoded with seed --seed + k",
    )
    g.add_argument(
        "--pairs",
        metavar="FILE.jsonl",
        help="write each item's best and worst judged sample as a preference pair (the "
        "`torchtitan prepare --preference` format; tts, asr and tts_prompt sets) and every sample to "
        "FILE.samples.jsonl",
    )
    g.add_argument(
        "--reward",
        action="append",
        metavar="[TASK:]SCORE=W,...",
        help="the reward ranking the samples: a weighted sum of wer, cer, sim, dnsmos, ended, "
        "duration_ratio_error, self_wer, self_cer (asr sets: wer, cer; tts_prompt sets: sim is "
        "SIM to the prompt); TASK: for one task's sets only, e.g. --reward tts:wer=-1,ended=0.5 "
        "--reward asr:wer=-1 --reward tts_prompt:sim=1,wer=-1 (default wer=-1)",
    )
    g.add_argument(
        "--pair-margin",
        type=float,
        default=0.0,
        help="no pair where the best and worst rewards differ by this or less (0)",
    )
    add_judge_args(p)
    add_decoding_args(p)
    return p


@dataclass(kw_only=True)
class EvalArgs:
    """The settings of ``torchtitan eval``: one field per flag of ``build_eval_parser`` (the
    flag's dest, type and default), in the parser's order; ``evaluate`` (commands/generate.py)
    takes it whole. tests/unit/commands/test_command_args.py holds the fields to the parser."""

    model: str
    valid: list[str]  # TASK:DATA, repeatable
    valid_fraction: float = 0.0
    limit: int = 0
    out: str | None = None
    report: str | None = None
    progress: bool = True  # --no-progress / --quiet: False
    # preference pairs
    samples: int = 1
    pairs: str | None = None
    reward: list[str] | None = None  # [TASK:]SCORE=W,..., repeatable
    pair_margin: float = 0.0
    # judges (add_judge_args)
    judge_asr: str = "pocketsphinx"
    judge_vocabulary: str | None = None
    judge_grammar: str | None = None
    judge_word_loop: bool = False
    judge_speaker: str = "resemblyzer"
    judge_quality: str = "dnsmos"
    judge_quality_items: int = 0
    # decoding (add_decoding_args)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    text_temperature: float = 0.0
    text_top_k: int = 0
    text_top_p: float = 1.0
    cfg_scale: float = 1.0
    min_frames: int = 1
    max_frames: int = 500
    max_text_tokens: int = 200
    seed: int = 0
    no_cache: bool = False
    compile: str = "auto"
    device: str = "cpu"

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EvalArgs:
        """The parsed ``torchtitan eval`` command line (``build_eval_parser().parse_args``)."""
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})

    def validate(self) -> None:
        """The checks of the settings themselves (before any model or data is read): a
        ValueError naming the flag."""
        for spec in self.valid:
            task = spec.partition(":")[0]
            if task not in EVAL_TASKS:
                raise ValueError(f"--valid {spec!r}: the task is asr, tts, tts_prompt or dialogue")
            if self.pairs:
                check_sampling(task, self.samples, self.temperature, self.text_temperature)

    def command_line(self, names: list[str] | None = None) -> list[str]:
        """The ``torchtitan eval`` flags giving the fields ``names`` (all by default) their
        values: each field's flag is its name with dashes (``progress``: ``--no-progress``);
        unset (None, False, the default True of ``progress``) fields are left out."""
        out: list[str] = []
        for name in names if names is not None else [f.name for f in fields(self)]:
            value = getattr(self, name)
            if name == "progress":
                out += [] if value else ["--no-progress"]
                continue
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                out += [flag] if value else []
            elif isinstance(value, list):
                for v in value:
                    out += [flag, str(v)]
            elif value is not None:
                out += [flag, str(value)]
        return out


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--temperature", type=float, default=0.0, help="audio sampling (0 = greedy)")
    g.add_argument("--top-k", type=int, default=0, help="audio: the k most likely codes (0 = all)")
    g.add_argument("--top-p", type=float, default=1.0, help="audio: nucleus mass (1 = off)")
    g.add_argument("--text-temperature", type=float, default=0.0, help="text (0 = greedy)")
    g.add_argument("--text-top-k", type=int, default=0, help="text: as --top-k (0 = all)")
    g.add_argument("--text-top-p", type=float, default=1.0, help="text: as --top-p (1 = off)")
    g.add_argument("--cfg-scale", type=float, default=1.0, help="TTS guidance (1 = off)")
    g.add_argument("--min-frames", type=int, default=1, help="TTS: no end before (1)")
    g.add_argument(
        "--max-frames",
        type=int,
        default=500,
        help="TTS: audio frames at most (500); a generation cut here is reported as such",
    )
    g.add_argument(
        "--max-text-tokens", type=int, default=200, help="ASR: text tokens at most (200)"
    )
    g.add_argument("--seed", type=int, default=0, help="the sampling seed (0)")
    g.add_argument("--no-cache", action="store_true", help="recompute every step (slow)")
    g.add_argument(
        "--compile",
        default="auto",
        choices=("auto", "on", "graphs", "off"),
        help="the one-frame decode step under torch.compile (auto: on CUDA, for the native and "
        "qwen3 backbones' static cache; on: also on a CPU; graphs: torch.compile's "
        "reduce-overhead mode, replayed as CUDA graphs, CUDA only; off) (default: auto)",
    )
    g.add_argument("--device", default="cpu", help="torch device (cpu), e.g. cuda")


def add_judge_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("judges (independent models scoring TTS; see docs/generation.md)")
    g.add_argument(
        "--judge-asr",
        default="pocketsphinx",
        metavar="NAME_OR_DIR",
        help="ASR judge: a judge name, a transformers ASR model folder, or none (pocketsphinx)",
    )
    g.add_argument(
        "--judge-vocabulary",
        metavar="eval|open|FILE",
        help="pocketsphinx: eval (default: a free word loop over the set's words), open (its "
        "shipped LM) or a file of words",
    )
    g.add_argument("--judge-grammar", metavar="FILE.jsgf", help="pocketsphinx: a JSGF grammar")
    g.add_argument(
        "--judge-word-loop",
        action="store_true",
        help="also score TTS with pocketsphinx's free word loop over each set's words (the "
        "results' word_loop: WER, its floor on the references), e.g. beside --judge-grammar",
    )
    g.add_argument(
        "--judge-speaker",
        default="resemblyzer",
        metavar="NAME_OR_DIR",
        help="speaker judge (SIM): a judge name, a transformers speaker-verification folder, or "
        "none (resemblyzer)",
    )
    g.add_argument(
        "--judge-quality",
        default="dnsmos",
        metavar="NAME",
        help="quality judge: dnsmos or none (dnsmos)",
    )
    g.add_argument(
        "--judge-quality-items",
        type=int,
        default=0,
        metavar="N",
        help="the quality judge scores only the first N items of each TTS set (0: all); "
        "DNSMOS costs about 1.5 s per short clip, for the generated and the reference audio",
    )
