"""``torchtitan prefer``: the online preference loop (issue 40, item 3).

    torchtitan prefer --job.config_file dpo.toml --prompts tts:data/prepared/train --limit 400 \\
        --rounds 2 --steps 50 --samples 6 --reward tts:self_wer=-1 --work runs/prefer

Round ``r`` (folder ``WORK/round-r/``) is four stages, each one command this package already
has, run in order:

1. **pairs**: ``torchtitan eval --samples K --pairs`` (``evaluate(EvalArgs)``, called here) with
   the round's model (round 0: the config's ``speechlm.init_from``; then the last checkpoint of
   the round before), seed ``--seed + 1000 r`` (evaluation/sampled_pairs.py);
2. **prepare**: ``torchtitan prepare --preference`` (``prepare(PrepareArgs)``, called here) with
   the prompts' codec and tokenizer;
3. **train**: ``torchtitan train`` of the config for ``--steps`` steps from the round's model
   (DPO's reference: the round's model, as iterative DPO has it), on the round's pairs: a
   process of its own (``_train``);
4. the round's figures: the mean reward of every sample (the policy's reward: it should rise
   from round to round), of the chosen and of the rejected, to ``WORK/loop.json``.

Resumable at every stage: a finished stage leaves ``round-r/{pairs,prepare,train}.done`` and is
not run again; an interrupted training resumes from its own checkpoint (torchtitan's); an
interrupted sampling or prepare is rerun (seeded: the same pairs). A rerun with other settings
than ``WORK/loop.json`` recorded is refused naming them (``--rounds`` may grow).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from torchtitan_speechlm.commands.flag_fields import flag_fields
from torchtitan_speechlm.commands.generate import evaluate
from torchtitan_speechlm.commands.generate_args import EvalArgs
from torchtitan_speechlm.commands.prepare import prepare
from torchtitan_speechlm.commands.prepare_args import PrepareArgs
from torchtitan_speechlm.config.toml_check import load_toml_file
from torchtitan_speechlm.data.format import PREFERENCE, codec_of
from torchtitan_speechlm.evaluation.sampled_pairs import PAIR_SETS, samples_file

# EvalArgs fields the loop sets itself (or leaves at their defaults); every other one (the
# decoding and judge flags, which prefer's parser shares with eval's) is passed through
OWN = {"model", "valid", "limit", "samples", "pairs", "reward", "pair_margin", "seed",
       "out", "report", "progress", "valid_fraction"}  # fmt: skip
PASSED = tuple(f.name for f in flag_fields(EvalArgs) if f.name not in OWN)
RECORDED = ("config", "prompts", "steps", "limit", "samples", "reward", "pair_margin", "seed",
            "nproc_per_node", "train_arg")  # fmt: skip


def run(a: argparse.Namespace) -> int:
    try:
        work = os.path.abspath(a.work)
        state = _state(a, work)
        model = _first_model(a.config)
        for r in range(a.rounds):
            model = _round(a, work, r, model, state)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        print(f"torchtitan prefer: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(_table(state))
    print(f"torchtitan prefer: {a.rounds} rounds done; the last model: {model}")
    return 0


def _round(a, work: str, r: int, model: str, state: dict) -> str:
    folder = os.path.join(work, f"round-{r}")
    os.makedirs(folder, exist_ok=True)
    pairs, prepared = os.path.join(folder, "pairs.jsonl"), os.path.join(folder, "prepared")
    dump = os.path.join(folder, "train")
    if not _done(folder, "pairs"):
        _say(f"round {r}: sampling {a.samples} answers per prompt with {model}")
        if _eval_pairs(a, model, pairs, a.seed + 1000 * r) != 0:
            raise RuntimeError(f"round {r}: `torchtitan eval --pairs` failed (its error above)")
        figures = _rewards(pairs)
        if not figures["pairs"]:
            raise RuntimeError(
                f"round {r}: no pairs from {figures['samples']} samples (every prompt's samples "
                "tie or are identical): raise --samples or --temperature, or lower --pair-margin"
            )
        _mark(folder, "pairs", figures)
    if not _done(folder, "prepare"):
        _say(f"round {r}: preparing {pairs}")
        if _prepare(a, pairs, prepared) != 0:
            raise RuntimeError(f"round {r}: `torchtitan prepare --preference` failed (above)")
        _mark(folder, "prepare", {})
    if not _done(folder, "train"):
        _say(f"round {r}: training {a.steps} steps from {model}")
        tasks = _read_mark(folder, "pairs")["tasks"]
        if _train(a, model, prepared, dump, tasks) != 0:
            raise RuntimeError(f"round {r}: `torchtitan train` failed (its log above); rerun "
                               "the same command to continue")  # fmt: skip
        _mark(folder, "train", {"model": _checkpoint(dump, a.steps)})
    state.setdefault("rounds", {})[str(r)] = {"model": model, **_read_mark(folder, "pairs")}
    _write_state(work, state)
    return _checkpoint(dump, a.steps)


def _eval_pairs(a, model: str, pairs: str, seed: int) -> int:
    return evaluate(eval_args(a, model, pairs, seed))


def eval_args(a: argparse.Namespace, model: str, pairs: str, seed: int) -> EvalArgs:
    """``torchtitan eval``'s settings for a round: K samples of every prompt with ``model``
    (seeds ``seed + k``) judged into ``pairs``; decoding and judges as ``a`` gives them."""
    return EvalArgs(
        model=model, valid=list(a.prompts), limit=a.limit, samples=a.samples, pairs=pairs,
        reward=list(a.reward) if a.reward else None, pair_margin=a.pair_margin, seed=seed,
        **{name: getattr(a, name) for name in PASSED},
    )  # fmt: skip


def passed_eval_flags(a: argparse.Namespace) -> list[str]:
    """The decoding and judge flags of ``a`` as ``torchtitan eval`` takes them (loop.json
    records them: a rerun with others is refused)."""
    return eval_args(a, "", "", 0).command_line(list(PASSED))


def _prepare(a, pairs: str, out: str) -> int:
    meta = _prompt_metadata(a.prompts[0])
    return prepare(PrepareArgs(sources={PREFERENCE: pairs}, codec=codec_of(meta).path,
                               tokenizer=meta["tokenizer"]["path"], out_dir=out,
                               no_progress=True))  # fmt: skip


def _train(a, model: str, prepared: str, dump: str, tasks: list[str]) -> int:
    """``torchtitan train`` of the round: the ``*_pref`` task of each task with pairs.

    The one stage run as a command line, in a process of its own: a training run is launched
    (torchrun, ``--nproc-per-node`` ranks) and owns its processes' distributed state, CUDA
    devices and torchtitan's global settings, which must not outlive it in the loop's process."""
    cmd = [sys.executable, "-m", "torchtitan_speechlm.cli", "train", "--job.config_file",
           a.config, "--nproc-per-node", str(a.nproc_per_node), "--job.dump_folder", dump,
           "--speechlm.init_from", model, "--speechlm_data.datasets", f"pairs={prepared}",
           "--speechlm_data.train", ",".join(f"{t}_pref:pairs" for t in tasks),
           "--speechlm_data.valid", ",".join(f"{t}_pref:pairs" for t in tasks),
           "--validation.enable", "false", "--training.steps", str(a.steps),
           "--checkpoint.enable", "true"]  # fmt: skip
    for extra in a.train_arg:
        key, sep, value = extra.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--train-arg {extra!r}: write SECTION.KEY=VALUE")
        cmd += [f"--{key.lstrip('-')}", value]
    return subprocess.run(cmd).returncode


def _checkpoint(dump: str, steps: int) -> str:
    return os.path.join(dump, "checkpoint", f"step-{steps}")


def _first_model(config: str) -> str:
    cfg = load_toml_file(config)
    model = cfg.get("speechlm", {}).get("init_from", "")
    if not model:
        raise ValueError(f"{config}: [speechlm] init_from must name the model to improve (the "
                         "first round samples from it and starts there)")  # fmt: skip
    base = os.path.dirname(os.path.abspath(config))
    for candidate in (model, os.path.join(base, model)):
        if os.path.exists(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError(f"{config}: [speechlm] init_from {model!r} does not exist")


def _prompt_metadata(spec: str) -> dict:
    task, _, path = spec.partition(":")
    meta = os.path.join(path, "metadata.json")
    if task not in PAIR_SETS or not os.path.isfile(meta):
        raise ValueError(
            f"--prompts {spec!r}: write tts:DIR, asr:DIR or tts_prompt:DIR with DIR a prepared "
            "folder"
        )
    with open(meta) as f:
        return json.load(f)


def _rewards(pairs: str) -> dict:
    """The round's figures: pairs, and the mean reward of every sample, chosen and rejected."""
    with open(samples_file(pairs)) as f:
        samples = [json.loads(x) for x in f if x.strip()]
    with open(pairs) as f:
        lines = [json.loads(x) for x in f if x.strip()]

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    return {
        "pairs": len(lines),
        "tasks": sorted({x["task"] for x in lines}),
        "samples": len(samples),
        "reward_mean": mean([s["reward"] for s in samples]),
        "chosen_reward": mean([x["scores"]["chosen"]["reward"] for x in lines]),
        "rejected_reward": mean([x["scores"]["rejected"]["reward"] for x in lines]),
    }


def _state(a, work: str) -> dict:
    """``WORK/loop.json``: the settings of the first start (a rerun must match) and each
    finished round's figures."""
    path = os.path.join(work, "loop.json")
    settings = {k: getattr(a, k) for k in RECORDED}
    settings["config"] = os.path.abspath(a.config)
    settings["sampling_and_judges"] = passed_eval_flags(a)  # every decoding and judge flag
    if os.path.isfile(path):
        with open(path) as f:
            state = json.load(f)
        differ = sorted(k for k in settings if state["settings"].get(k) != settings[k])
        if differ:
            raise ValueError(
                f"{path} was started with other settings ({', '.join(differ)}: "
                f"{[state['settings'].get(k) for k in differ]} now {[settings[k] for k in differ]}); "
                "rerun with those, or use another --work"
            )
        return state
    os.makedirs(work, exist_ok=True)
    state = {"settings": settings, "rounds": {}}
    _write_state(work, state)
    return state


def _write_state(work: str, state: dict) -> None:
    tmp = os.path.join(work, "loop.json.tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, os.path.join(work, "loop.json"))


def _done(folder: str, stage: str) -> bool:
    return os.path.isfile(os.path.join(folder, f"{stage}.done"))


def _mark(folder: str, stage: str, record: dict) -> None:
    with open(os.path.join(folder, f"{stage}.done"), "w") as f:
        json.dump(record, f)


def _read_mark(folder: str, stage: str) -> dict:
    with open(os.path.join(folder, f"{stage}.done")) as f:
        return json.load(f)


def _table(state: dict) -> str:
    rows = ["round  pairs  mean reward  chosen  rejected  model"]
    for r, x in sorted(state.get("rounds", {}).items(), key=lambda kv: int(kv[0])):
        rows.append(f"{r:>5}  {x['pairs']:>5}  {x['reward_mean']:>11.4f}  "
                    f"{x['chosen_reward']:>6.3f}  {x['rejected_reward']:>8.3f}  {x['model']}")  # fmt: skip
    return "\n".join(rows)


def _say(line: str) -> None:
    print(f"torchtitan prefer: {line}", file=sys.stderr, flush=True)
