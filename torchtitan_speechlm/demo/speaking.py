"""A corpus a small model can learn to speak and hear from, made here: the grammar's sentences
spoken by espeak-ng, a held-out set of sentences that never occur in training, the assets a user
would bring (a text tokenizer, a random-init backbone), and the ``torchtitan prepare`` commands
that turn it into training data with the offline k-means codec fitted on the training audio.

Shared by ``make demo`` (a few minutes on a 2-core CPU) and ``benchmarks/bench_learning.py``
(a larger corpus and model, learning curves): both run the real console commands, printed as a
user would type them.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields

from torchtitan_speechlm.demo import grammar
from torchtitan_speechlm.demo.assets import build_backbone, build_tokenizer, synthesize_corpus
from torchtitan_speechlm.utils.progress import Progress

VOICE = "en-us"  # one voice: the demo trains unprompted tts, so the voice is part of the task
OTHER_VOICE = "en-us+f3"  # another speaker saying the same texts: SIM's comparison point
SPEED = 175  # words per minute, espeak-ng's default


@dataclass(frozen=True)
class CorpusPlan:
    train: int  # distinct training sentences (one utterance each)
    held_out: int  # held-out sentences, never in training
    tokenizer_vocab: int = 512
    hidden: int = 256
    layers: int = 6
    heads: int = 4
    family: str = "llama"
    frame_rate: int = 25  # k-means codec frames/s: half the default 50, so half the sequence
    seed: int = 0
    kmeans_seconds: float = 600.0  # audio the codec is fitted on (torchtitan prepare's default;
    # bench_learning fits on 2400 s: docs/quality.md)
    codec: str = (
        "kmeans"  # the fitted codec's kind: kmeans, mel or world (prepare --fit-KIND-codec)
    )
    codebooks: int = 4  # k-means and mel codecs: codebooks (streams)
    codebook_size: int = 0  # 0: the kind's default (k-means 256, mel and WORLD 1024)

    def codec_flags(self, folder: str) -> list[str]:
        """``torchtitan prepare``'s flags that fit this plan's codec into ``folder`` (a flag at
        prepare's default is left out, so the printed command stays what a user types)."""
        flags = [f"--fit-{self.codec}-codec", folder]
        if self.codec == "kmeans":
            flags += ["--kmeans-frame-rate", str(self.frame_rate)]
        if self.codec != "world" and self.codebooks != 4:
            flags += ["--codebooks", str(self.codebooks)]
        if self.codebook_size:
            flags += ["--codebook-size", str(self.codebook_size)]
        if self.kmeans_seconds != 600.0:  # prepare's default
            flags += ["--kmeans-seconds", f"{self.kmeans_seconds:g}"]
        return flags


def console(tool: str) -> str:
    """The console script next to this interpreter (``.venv/bin/torchtitan``)."""
    path = os.path.join(os.path.dirname(sys.executable), tool)
    return path if os.path.exists(path) else tool


def run_command(cmd: list[str], log: str | None = None) -> None:
    """Print and run one command; its output goes to the terminal as it comes, and to ``log``
    too if given (a step the user waits on is never hidden in a file)."""
    shown = " ".join(shlex.quote(c) for c in [os.path.basename(cmd[0]), *cmd[1:]])
    print(f"[demo] $ {shown}" + (f"  (also in {log})" if log else ""), flush=True)
    if log:
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for line in iter(proc.stdout.readline, b""):
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                f.write(line.decode(errors="replace"))
            rc = proc.wait()
    else:
        rc = subprocess.call(cmd)
    if rc != 0:
        tail = ""
        if log:
            with open(log) as f:
                tail = "".join(f.readlines()[-15:])
        raise RuntimeError(f"command failed (exit {rc}): {shown}\n{tail}")


def _check_plan(work: str, plan: CorpusPlan) -> None:
    """Everything under ``work`` is reused by later runs, so it must have been made with this
    plan: another one (more sentences, another model) would mix stale prepared data with a new
    corpus. The plan is recorded in ``work/plan.json`` on the first run."""
    record = os.path.join(work, "plan.json")
    want = asdict(plan)
    if os.path.isfile(record):
        with open(record) as f:
            have = json.load(f)
        # a key added to the plan later reads as its default in older records
        have = {**{f.name: f.default for f in fields(CorpusPlan)}, **have}
        diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
        if diff:
            raise ValueError(
                f"{work} was made with another plan ({', '.join(f'{k}: {a} there, {b} now' for k, (a, b) in diff.items())}); "
                f"remove it (`make clean` for the demo) or choose another work folder"
            )
    else:
        with open(record, "w") as f:
            json.dump(want, f, indent=2)


def build_corpus(work: str, plan: CorpusPlan, workers: int = 2) -> dict:
    """Make (or reuse) everything up to prepared data; returns the paths.

    Layout: ``corpus/{train,heldout,heldout_other_voice}/manifest.jsonl`` (+ wavs),
    ``tokenizer/``, ``backbone/``, ``grammar.jsgf`` (the language, for the restricted
    recogniser judge: it accepts any sentence of the grammar, not just these), ``codec/`` (k-means, fitted on the training audio only) and
    ``prepared/{train,heldout}``.
    """
    from transformers import AutoTokenizer

    os.makedirs(work, exist_ok=True)
    _check_plan(work, plan)
    p = {
        k: os.path.join(work, k)
        for k in ("tokenizer", "backbone", "codec", "corpus", "prepared", "grammar.jsgf")
    }
    train, held = grammar.split_sentences(plan.train, plan.held_out, plan.seed)
    t0 = time.perf_counter()
    said = Progress("[demo] corpus").start()  # espeak-ng speaks thousands of sentences
    said.say(f"speaking {len(train)} training and {len(held)} held-out sentences (x2 voices)")
    manifests = {
        "train": synthesize_corpus(
            os.path.join(p["corpus"], "train"), train, len(train), [VOICE], speeds=(SPEED,)
        ),
        "heldout": synthesize_corpus(
            os.path.join(p["corpus"], "heldout"), held, len(held), [VOICE], speeds=(SPEED,)
        ),
        "heldout_other_voice": synthesize_corpus(
            os.path.join(p["corpus"], "heldout_other_voice"),
            held,
            len(held),
            [OTHER_VOICE],
            speeds=(SPEED,),
        ),  # fmt: skip
    }
    said.stop()
    print(
        f"[demo] corpus: {len(train)} training + {len(held)} held-out sentences of the grammar "
        f"(none shared), espeak-ng voice {VOICE} ({time.perf_counter() - t0:.0f}s)",
        flush=True,
    )
    with open(p["grammar.jsgf"], "w") as f:
        f.write(grammar.jsgf())
    if not os.path.isfile(os.path.join(p["tokenizer"], "tokenizer.json")):
        build_tokenizer(p["tokenizer"], train, vocab_size=plan.tokenizer_vocab)
    if not os.path.isfile(os.path.join(p["backbone"], "config.json")):
        vocab = len(AutoTokenizer.from_pretrained(p["tokenizer"], local_files_only=True))
        build_backbone(
            p["backbone"],
            family=plan.family,
            vocab_size=vocab,
            hidden_size=plan.hidden,
            num_layers=plan.layers,
            num_heads=plan.heads,
            num_kv_heads=plan.heads,
            intermediate_size=3 * plan.hidden,
            seed=plan.seed,
        )
    tool = console("torchtitan")
    for name, fit in (("train", True), ("heldout", False)):
        out = os.path.join(p["prepared"], name)
        if os.path.isfile(os.path.join(out, "metadata.json")):
            continue
        codec = plan.codec_flags(p["codec"]) if fit else ["--codec", p["codec"]]
        run_command(
            [tool, "prepare", "--manifest", manifests[name], *codec, "--tokenizer",
             p["tokenizer"], "--out-dir", out, "--workers", str(workers)],
        )  # fmt: skip
    p["manifests"] = manifests
    return p
