"""The commands as Python functions taking their ``*Args`` (commands/__init__.py), the renamed
flags' old spellings (commands/flag_fields.py ``renamed``: they parse as the new flag and say
its name in one line on stderr), every default shown in ``--help``, and serve's start-up
checks run once: the flags, then the keys and the exposure rule, before anything is loaded.
Cheap cases only (no model is loaded: each call stops at a check, or at a model that is not
there); export of a real checkpoint: tests/integration/test_export.py."""

from __future__ import annotations

import argparse
import pickle
import re

import pytest

from tests.unit.commands.test_parser_snapshot import parsers
from torchtitan_speechlm.commands import serve as serve_mod
from torchtitan_speechlm.commands import serve_args
from torchtitan_speechlm.commands.export import export_command
from torchtitan_speechlm.commands.export_args import ExportArgs
from torchtitan_speechlm.commands.export_args import build_parser as build_export_parser
from torchtitan_speechlm.commands.generate import evaluate, generate
from torchtitan_speechlm.commands.generate_args import EvalArgs, GenerateArgs
from torchtitan_speechlm.commands.prefer_args import build_parser as build_prefer_parser
from torchtitan_speechlm.commands.prepare import prepare
from torchtitan_speechlm.commands.prepare_args import PrepareArgs
from torchtitan_speechlm.commands.prepare_args import build_parser as build_prepare_parser
from torchtitan_speechlm.commands.serve import serve
from torchtitan_speechlm.commands.serve_args import ServeArgs
from torchtitan_speechlm.serving.keys import KeyRing

# (parser, the command line with the old spelling, with the new one, the old, the new)
RENAMED = [
    (build_export_parser, ["--checkpoint", "c", "--out", "o"], ["--checkpoint", "c", "--out-dir", "o"],
     "--out", "--out-dir"),
    (build_export_parser, ["--checkpoint", "c", "--out=o"], ["--checkpoint", "c", "--out-dir=o"],
     "--out", "--out-dir"),
    (build_prepare_parser, ["--batch-size", "3"], ["--codec-batch-size", "3"], "--batch-size",
     "--codec-batch-size"),
    (build_prepare_parser, ["--manifest", "m", "--out", "o"], ["--manifest", "m", "--out-dir", "o"],
     "--out", "--out-dir"),
    (build_prepare_parser, ["--out=s3://b/p"], ["--out-dir=s3://b/p"], "--out", "--out-dir"),
    (build_prefer_parser, ["--config", "c.toml", "--prompts", "tts:p", "--work", "w"],
     ["--job.config_file", "c.toml", "--prompts", "tts:p", "--work", "w"], "--config",
     "--job.config_file"),
]  # fmt: skip


@pytest.mark.parametrize("build, old_argv, new_argv, old, new", RENAMED)
def test_an_old_spelling_parses_as_the_new_flag_and_says_it_in_one_line(
    capsys, build, old_argv, new_argv, old, new
):
    by_new = build().parse_args(new_argv)
    assert capsys.readouterr().err == ""  # the new name: nothing said
    by_old = build().parse_args(old_argv)
    err = capsys.readouterr().err
    assert vars(by_old) == vars(by_new)
    assert err.count("\n") == 1 and f"{old} is now {new}: use {new}" in err, err
    assert err.startswith(build().prog + ": ")
    help_text = build().format_help()
    assert f"{old}: the old spelling, still taken" in " ".join(help_text.split())


def test_the_old_spelling_through_the_console_script_is_said_once(capsys, monkeypatch):
    """cli.py parses export's command line once, then runs it (here: a stand-in)."""
    from torchtitan_speechlm import cli

    got = []
    monkeypatch.setattr(cli, "_command", lambda cmd, parsed: got.append)
    assert cli.main(["export", "--checkpoint", "c", "--out", "o", "--force"]) == 0
    assert capsys.readouterr().err.count("--out is now --out-dir") == 1
    assert ExportArgs.from_namespace(got[0]) == ExportArgs(checkpoint="c", out_dir="o", force=True)


def test_prepare_old_out_through_the_console_script_is_said_once(capsys):
    """prepare parses its command line once (in cli.py, before torch, where it names no
    ``--import`` modules; else in its own main, after importing them): the old ``--out`` is
    said in one line, and a missing flag names ``--out-dir``."""
    from torchtitan_speechlm import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["prepare", "--manifest", "m.jsonl", "--out", "o"])  # no --tokenizer
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("--out is now --out-dir: use --out-dir") == 1, err
    assert "the following arguments are required: --tokenizer, --out-dir" in err


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action)


def test_every_default_is_shown_in_help():
    """A flag that has a value when not given says it in its help (a switch, a list or a
    None default excepted): a user reads what happens without it."""
    missing = []
    for name, parser in parsers().items():
        for a in parser._actions:
            d = a.default
            if a.nargs == 0 or d in (None, [], "", argparse.SUPPRESS) or d is False:
                continue
            said = " ".join(_expanded_help(parser, a).split())
            shown = {str(d), f"{d:g}" if isinstance(d, float) else str(d)}
            if not any(re.search(rf"(?<![\w.]){re.escape(s)}(?![\w.])", said) for s in shown):
                missing.append(f"{name} {a.option_strings[0]} ({d!r}): {said}")
    assert not missing, "\n".join(missing)


def test_prefer_help_shows_its_own_temperature_defaults():
    text = " ".join(build_prefer_parser().format_help().split())
    assert "audio sampling (0.8; 0 = greedy)" in text and "text (0.8; 0 = greedy)" in text


# ---- each command called from Python with its Args ---------------------------------------------


def test_generate_checks_its_args_before_the_model(capsys, tmp_path):
    assert generate(GenerateArgs(model=str(tmp_path / "none"), batch="b.jsonl", batch_size=0)) == 2
    assert "--batch-size 0: at least 1" in capsys.readouterr().err
    assert generate(GenerateArgs(model="m", task="tts", text="hi", out_dir="o")) == 2
    assert "--out-dir is the folder of a --batch's outputs" in capsys.readouterr().err
    assert generate(GenerateArgs(model="m", batch="b.jsonl", out="o.wav")) == 2
    assert "--out is one request's FILE; a --batch writes into --out-dir" in capsys.readouterr().err
    args = GenerateArgs(model=str(tmp_path / "none"), task="tts", text="hi", progress=False)
    assert generate(args) == 2  # no such model: one line
    assert "torchtitan generate: error:" in capsys.readouterr().err


def test_evaluate_checks_its_args_before_the_model(capsys):
    assert evaluate(EvalArgs(model="m", valid=["mt:x"], progress=False)) == 2
    assert "--valid 'mt:x': the task is asr, tts" in capsys.readouterr().err


def test_prepare_checks_its_args(capsys):
    args = PrepareArgs(sources={"manifest": "m.jsonl"}, tokenizer="t", out_dir="o", dev_seed=1)
    assert prepare(args) == 1
    assert "--dev-seed seeds the split of --dev-fraction" in capsys.readouterr().err


def test_export_command_checks_its_args_and_refuses_a_model_folder(capsys, tmp_path):
    args = ExportArgs(checkpoint=str(tmp_path), out_dir=str(tmp_path / "o"), max_shard_size="big")
    assert export_command(args) == 2
    assert "--max-shard-size 'big': a size such as 5GB" in capsys.readouterr().err
    assert ExportArgs(checkpoint="c", out_dir="o", max_shard_size="2MB").shard_bytes() == 2 << 20
    (tmp_path / "config.json").write_text("{}")  # an export folder, not a checkpoint
    assert export_command(ExportArgs(checkpoint=str(tmp_path), out_dir=str(tmp_path / "o"))) == 2
    assert "is a model folder (it has a config.json)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ---- serve's checks, once -----------------------------------------------------------------------


class _Stop(Exception):
    pass


@pytest.fixture
def counted(monkeypatch):
    """serve with the serve extra taken as installed, each check counted, and the server's
    construction (``build``) replaced by a stand-in that records what it got and stops."""
    counts = {"engine": 0, "bounds": 0, "keys": 0, "exposure": 0}
    built = []

    def count(name, real):
        def wrapper(*a, **k):
            counts[name] += 1
            return real(*a, **k)

        return wrapper

    monkeypatch.setattr(serve_mod, "MISSING", None)
    monkeypatch.delenv(serve_mod.ENV_KEY, raising=False)
    monkeypatch.setattr(serve_args, "check_engine_flags",
                        count("engine", serve_args.check_engine_flags))  # fmt: skip
    monkeypatch.setattr(serve_args, "check_bounds", count("bounds", serve_args.check_bounds))
    monkeypatch.setattr(serve_mod, "KeyRing", count("keys", KeyRing))
    monkeypatch.setattr(serve_mod, "check_exposure", count("exposure", serve_mod.check_exposure))

    def build(a, keys, sock=None, device=None):
        built.append((a, keys))
        raise ValueError("stopped here by the test")

    monkeypatch.setattr(serve_mod, "build", build)
    return counts, built


def test_serve_runs_each_check_once_then_builds_with_the_key_ring(counted, capsys, tmp_path):
    counts, built = counted
    keys = tmp_path / "keys"
    keys.write_text("alice sk-1\n")
    args = ServeArgs(model="m", api_key_file=str(keys), host="0.0.0.0")
    assert serve(args) == 2
    assert "stopped here by the test" in capsys.readouterr().err
    assert counts == {"engine": 1, "bounds": 1, "keys": 1, "exposure": 1}
    ((a, ring),) = built
    assert a is args and isinstance(ring, KeyRing) and ring.match("sk-1") == "alice"


def test_serve_refuses_bad_flags_before_the_keys_and_exposure(counted, capsys):
    counts, built = counted
    assert serve(ServeArgs(model="m", replicas=0)) == 2
    assert "--replicas 0: at least 1" in capsys.readouterr().err
    assert serve(ServeArgs(model="m", vllm_url="http://h:1/v1")) == 2
    assert "--vllm-url: only with --engine vllm" in capsys.readouterr().err
    assert serve(ServeArgs(model="m", host="0.0.0.0")) == 2  # not loopback, no key
    err = capsys.readouterr().err
    assert counts == {"engine": 2, "bounds": 1, "keys": 1, "exposure": 1}, err
    assert not built


def test_serve_replicas_get_the_checked_key_ring_and_check_nothing_again(
    counted, monkeypatch, capsys
):
    """--replicas N: the supervisor checks once and hands each replica its args and the key
    ring (pickled, as a spawned process gets them); a replica builds with them."""
    counts, built = counted
    started = []

    class Replicas:
        def __init__(self, n, sock, main, settings, device, say):
            started.append(pickle.loads(pickle.dumps(settings)))
            self.main = main

        def start(self):
            return _Stop("no replica started by the test")

    class Sock:
        def getsockname(self):
            return ("127.0.0.1", 1)

        def close(self):
            pass

    monkeypatch.setattr(serve_mod, "Replicas", Replicas, raising=False)
    monkeypatch.setattr(serve_mod, "bind", lambda host, port: Sock(), raising=False)
    monkeypatch.setattr(serve_mod.signal, "signal", lambda *a: None)  # this process's stay
    args = ServeArgs(model="m", api_key="sk-2", replicas=2)
    assert serve(args) == 2
    assert "no replica started by the test" in capsys.readouterr().err
    ((a, ring),) = started
    assert a == args and ring.match("sk-2") == "api-key"

    class Ready:
        def put(self, item):
            started.append(item)

    with pytest.raises(SystemExit) as e:
        serve_mod.replica_main((a, ring), None, 0, "cpu", 0, Ready())
    assert e.value.code == 2 and started[-1] == (0, "stopped here by the test")
    assert built[0] == (a, ring)
    assert counts == {"engine": 1, "bounds": 1, "keys": 1, "exposure": 1}


def test_a_key_ring_survives_pickling_and_still_reloads(tmp_path):
    path = tmp_path / "keys"
    path.write_text("bob sk-3\n")
    ring = pickle.loads(pickle.dumps(KeyRing("sk-4", str(path), say=print)))
    assert ring.match("sk-3") == "bob" and ring.match("sk-4") == "api-key"
    path.write_text("carol sk-5\n")
    ring._checked = -1e9  # the next match looks at the file again
    assert ring.match("sk-5") == "carol" and ring.match("sk-3") is None
