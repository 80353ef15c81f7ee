"""`EvalArgs` and `PrepareArgs` (commands/generate_args.py, commands/prepare_args.py): one field
per flag of the command's parser, with the flag's default, built from a parsed command line; and
`torchtitan prefer` hands `evaluate` and `prepare` the same values their command lines would
give (it builds the values, no command line). The parsers (generated from the fields:
commands/flag_fields.py) are walked here through argparse's actions, the independent reading of
what each command line means."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from torchtitan_speechlm.commands import prefer
from torchtitan_speechlm.commands.flag_fields import command_line, flag_fields
from torchtitan_speechlm.commands.generate_args import EVAL_TASKS, EvalArgs, build_eval_parser
from torchtitan_speechlm.commands.prefer_args import build_parser as build_prefer_parser
from torchtitan_speechlm.commands.prepare_args import PrepareArgs, UsageError
from torchtitan_speechlm.commands.prepare_args import build_parser as build_prepare_parser
from torchtitan_speechlm.prepare.sources import SOURCES

MISSING = dataclasses.MISSING


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.dest != "help"]


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def test_every_eval_flag_is_a_field_of_eval_args_with_its_default_in_order():
    actions, fields = _actions(build_eval_parser()), flag_fields(EvalArgs)
    assert [a.dest for a in actions] == [f.name for f in fields]
    for action, f in zip(actions, fields, strict=True):
        if action.required:
            assert f.default is MISSING and f.default_factory is MISSING, f.name
        else:
            assert _default(f) == action.default, f.name
        # command_line writes each field with its parser flag
        assert f.name == "progress" or action.option_strings[0] == "--" + f.name.replace("_", "-")


ARGV = ["--model", "m", "--valid", "tts:a", "--valid", "asr:b", "--limit", "3", "--samples", "2",
        "--pairs", "p.jsonl", "--reward", "tts:wer=-1", "--pair-margin", "0.5", "--judge-asr",
        "none", "--judge-word-loop", "--temperature", "0.7", "--top-k", "5", "--no-cache",
        "--compile", "off", "--no-progress", "--max-frames", "40"]  # fmt: skip


def test_eval_args_from_a_command_line_and_back():
    ns = build_eval_parser().parse_args(ARGV)
    args = EvalArgs.from_namespace(ns)
    assert dataclasses.asdict(args) == vars(ns)
    assert args.valid == ["tts:a", "asr:b"] and args.no_cache and not args.progress
    again = EvalArgs.from_namespace(build_eval_parser().parse_args(args.command_line()))
    assert again == args
    default = EvalArgs(model="m", valid=["tts:a"])
    assert (
        EvalArgs.from_namespace(build_eval_parser().parse_args(default.command_line())) == default
    )


def test_eval_args_validate_names_the_flag():
    from torchtitan_speechlm.commands.generate import EVAL_KINDS

    assert set(EVAL_TASKS) == set(EVAL_KINDS)  # what validate lets through, eval can read
    EvalArgs(model="m", valid=[f"{t}:x" for t in EVAL_TASKS]).validate()
    with pytest.raises(ValueError, match="--valid 'mt:x': the task is asr, tts"):
        EvalArgs(model="m", valid=["mt:x"]).validate()
    with pytest.raises(ValueError, match="all the same greedy decode: set --temperature > 0"):
        EvalArgs(model="m", valid=["tts:x"], samples=3, pairs="p.jsonl").validate()
    with pytest.raises(ValueError, match="--pairs needs --samples K with K >= 2"):
        EvalArgs(model="m", valid=["tts:x"], pairs="p.jsonl", temperature=1.0).validate()


def test_every_prepare_flag_is_a_field_of_prepare_args_with_its_default_in_order():
    actions = _actions(build_prepare_parser())
    options = {o.name: o.default for _, s in SOURCES.items() for o in s.options}
    own = []
    for a in actions:
        if a.dest.startswith("source_"):  # a source's flag: a key of `sources`
            assert a.dest.removeprefix("source_") in SOURCES and a.default is None
        elif a.dest.startswith("option_"):  # a source's option: a key of `source_options`
            assert a.default == options[a.dest.removeprefix("option_")]
        else:
            own.append(a)
    fields = [
        f for f in dataclasses.fields(PrepareArgs) if f.name not in ("sources", "source_options")
    ]
    assert [a.dest for a in own] == [f.name for f in fields]
    for action, f in zip(own, fields, strict=True):
        assert _default(f) == action.default, f.name
    assert PrepareArgs.from_namespace(build_prepare_parser().parse_args([])) == PrepareArgs()


def test_prepare_args_from_a_command_line():
    argv = ["--kaldi", "k/", "--tokenizer", "t", "--out-dir", "o", "--workers", "2", "--strict",
            "--import", "mod", "--no-progress", "--dev-fraction", "0.1"]  # fmt: skip
    args = PrepareArgs.from_namespace(build_prepare_parser().parse_args(argv))
    want = PrepareArgs(sources={"kaldi": "k/"}, tokenizer="t", out_dir="o", workers=2, strict=True,
                       imports=["mod"], no_progress=True, dev_fraction=0.1)  # fmt: skip
    assert args == want
    args.validate()
    assert args.source == "kaldi" and args.options_of_source() == {
        o.name: o.default for o in SOURCES.get("kaldi").options
    }


def test_prepare_args_through_a_command_line_and_back():
    """A value written as a command line (the source's flags, then flag_fields.command_line of
    the other fields) parses back to itself."""
    args = PrepareArgs(sources={"hf_dataset": "ds/"}, source_options={"text_column": "sentence"},
                       tokenizer="t", out_dir="o", codebook_size=64, kmeans_seconds=30.5,
                       imports=["a", "b"], overwrite=True, no_progress=True, part="1/2")  # fmt: skip
    flags = {s.name: s.flag for _, s in SOURCES.items()}
    argv = [flags["hf_dataset"], "ds/", "--text-column", "sentence", *command_line(args)]
    assert PrepareArgs.from_namespace(build_prepare_parser().parse_args(argv)) == args


def test_prepare_args_validate_in_order():
    ok = dict(sources={"manifest": "m.jsonl"}, tokenizer="t", out_dir="o")
    PrepareArgs(**ok).validate()
    with pytest.raises(UsageError, match="required: --tokenizer, --out-dir"):
        PrepareArgs(sources={"manifest": "m"}, out_dir="o").validate()
    with pytest.raises(UsageError, match="--staging is for an --out-dir that is a URL"):
        PrepareArgs(**ok, staging="s").validate()
    with pytest.raises(ValueError, match="give exactly one source"):
        PrepareArgs(**dict(ok, sources={"manifest": "m", "kaldi": "k"})).validate()
    with pytest.raises(ValueError, match="--dev-seed seeds the split of --dev-fraction"):
        PrepareArgs(**ok, dev_seed=1).validate()
    with pytest.raises(ValueError, match="--waveforms reads the audio again"):
        PrepareArgs(**dict(ok, sources={"kaldi": "k"}), waveforms=16000).validate()
    with pytest.raises(ValueError, match="--waveforms -1: give a sample rate"):
        PrepareArgs(**ok, waveforms=-1).validate()
    PrepareArgs(join="o", no_progress=True).validate()
    with pytest.raises(ValueError, match=r"--join OUT_DIR takes no other flags \(got --tokenizer"):
        PrepareArgs(join="o", tokenizer="t").validate()


PREFER = ["--job.config_file", "c.toml", "--prompts", "tts:d1", "--prompts", "asr:d2", "--work", "w",
          "--limit", "7", "--samples", "3", "--reward", "tts:cer=-1", "--pair-margin", "0.25",
          "--judge-asr", "none", "--judge-word-loop", "--top-p", "0.9", "--no-cache",
          "--max-frames", "40", "--device", "cuda"]  # fmt: skip


def _old_passed_eval_flags(a: argparse.Namespace) -> list[str]:
    """The decoding and judge flags prefer passed as a command line before it built EvalArgs
    (read from eval's parser): loop.json records them, so a loop started then must go on."""
    out = []
    for action in build_eval_parser()._actions:
        if action.dest in prefer.OWN | {"help"} or not action.option_strings:
            continue
        value = getattr(a, action.dest)
        if isinstance(action, argparse._StoreTrueAction):
            out += [action.option_strings[0]] if value else []
        elif value is not None:
            out += [action.option_strings[0], str(value)]
    return out


@pytest.mark.parametrize("extra", [[], ["--temperature", "1.5", "--text-top-k", "4"]])
def test_prefer_hands_evaluate_what_the_eval_command_line_would_give(monkeypatch, extra):
    a = build_prefer_parser().parse_args(PREFER + extra)
    got = []
    monkeypatch.setattr(prefer, "evaluate", lambda args: got.append(args) or 0)
    assert prefer._eval_pairs(a, "step-2", "pairs.jsonl", 1005) == 0
    argv = ["--model", "step-2", "--samples", "3", "--pairs", "pairs.jsonl", "--seed", "1005",
            "--limit", "7", "--pair-margin", "0.25", "--valid", "tts:d1", "--valid", "asr:d2",
            "--reward", "tts:cer=-1", *_old_passed_eval_flags(a)]  # fmt: skip
    (args,) = got
    assert isinstance(args, EvalArgs)
    assert args == EvalArgs.from_namespace(build_eval_parser().parse_args(argv))
    assert args.temperature == (1.5 if extra else 0.8)  # prefer's own default
    assert prefer.passed_eval_flags(a) == _old_passed_eval_flags(a)


def test_prefer_hands_prepare_what_the_prepare_command_line_would_give(monkeypatch):
    a = build_prefer_parser().parse_args(PREFER)
    got = []
    monkeypatch.setattr(prefer, "prepare", lambda args: got.append(args) or 0)
    monkeypatch.setattr(prefer, "_prompt_metadata", lambda spec: {"tokenizer": {"path": "tok"}})
    monkeypatch.setattr(prefer, "codec_of", lambda meta: SimpleNamespace(path="codec"))
    assert prefer._prepare(a, "pairs.jsonl", "out") == 0
    argv = ["--preference", "pairs.jsonl", "--codec", "codec", "--tokenizer", "tok", "--out-dir",
            "out", "--no-progress"]  # fmt: skip
    assert got == [PrepareArgs.from_namespace(build_prepare_parser().parse_args(argv))]


def test_best_of_is_checked_by_every_command_that_takes_it():
    """``--best-of N`` (DecodingArgs): at least 1, sampled (greedy would speak every rendition
    alike), TTS only in generate, not with eval's --pairs nor serve's --engine vllm; and it
    reaches the decoder's ``DecodeConfig``."""
    from torchtitan_speechlm.commands.decoding import decode_config
    from torchtitan_speechlm.commands.generate_args import GenerateArgs
    from torchtitan_speechlm.commands.serve_args import ServeArgs

    ok = EvalArgs(model="m", valid=["tts:x"], best_of=4, temperature=0.6)
    ok.validate()
    assert (
        decode_config(ok).best_of == 4 and decode_config(EvalArgs(model="m", valid=[])).best_of == 1
    )
    with pytest.raises(ValueError, match="--best-of 0: at least 1"):
        EvalArgs(model="m", valid=["tts:x"], best_of=0).validate()
    with pytest.raises(ValueError, match="--best-of 2 with --temperature 0: greedy"):
        EvalArgs(model="m", valid=["tts:x"], best_of=2).validate()
    with pytest.raises(ValueError, match="--best-of 2 with --pairs: .* drop --best-of"):
        EvalArgs(model="m", valid=["tts:x"], best_of=2, temperature=1.0, samples=2,
                 pairs="p.jsonl").validate()  # fmt: skip
    GenerateArgs(model="m", task="tts", best_of=2, temperature=1.0).validate()
    with pytest.raises(ValueError, match="--best-of is for --task tts .*, not asr"):
        GenerateArgs(model="m", task="asr", best_of=2, temperature=1.0).validate()
    with pytest.raises(ValueError, match="--best-of 3 with --temperature 0"):
        GenerateArgs(model="m", task="tts", best_of=3).validate()
    ServeArgs(model="m", best_of=2, temperature=1.0).validate()
    with pytest.raises(ValueError, match="--best-of 2 with --temperature 0"):
        ServeArgs(model="m", best_of=2).validate()
    with pytest.raises(ValueError, match="--best-of is not taken with --engine vllm"):
        ServeArgs(model="m", engine="vllm", vllm_url="http://h:1/v1", best_of=2,
                  temperature=1.0).validate()  # fmt: skip
