"""``torchtitan generate`` and ``torchtitan eval``.

    torchtitan generate --model DIR --task tts --text "Hello there." --out out.wav
    torchtitan generate --model DIR --task tts --text "Hello there." --prompt ref.wav --out out.wav
    torchtitan generate --model DIR --task asr --audio in.wav
    torchtitan generate --model DIR --task continuation --audio prompt.wav --out out.wav
    torchtitan generate --model DIR --task answer --audio question.wav [--text "Who?"]
    torchtitan generate --model DIR --batch requests.jsonl --out-dir outputs/
    torchtitan eval --model DIR --valid asr:NAME [--valid tts:NAME] [--valid dialogue:NAME]
        [--valid-fraction F]
        [--judge-asr pocketsphinx|DIR|none] [--judge-speaker resemblyzer|DIR|none]
        [--judge-quality dnsmos|none] [--out results.json] [--report DIR]
    torchtitan eval --model DIR --valid tts:NAME --samples 4 --temperature 0.8
        --pairs pairs.jsonl [--reward wer=-1,ended=0.5]   (preference pairs of tts, asr and
        tts_prompt sets, docs/preference.md)

DIR is a training checkpoint's step folder (the run's config, vocabulary and codec are found from
it) or a ``torchtitan export`` folder. A batch file has one JSON object per line: ``{"id": ...,
"task": "tts", "text": ...[, "prompt": WAV]}`` or ``{"id": ..., "task": "asr" | "continuation" | "answer",
"audio": ...}`` (``answer``: and an optional ``text`` instruction);
each result is written to ``out-dir/ID.wav`` or ``ID.txt`` and a line of ``results.jsonl``.
``eval`` scores TTS with independent judges (``evaluation/judge_setup.py``: which judges,
``evaluation/tts_scores.py``: the scoring; ASR and dialogue sets: ``evaluation/text_scores.py``),
prints ``evaluation/results_table.py``'s table and writes an HTML report with ``--report``
(``evaluation/report.py``).

``generate(GenerateArgs)`` and ``evaluate(EvalArgs)`` are the commands as Python functions
(commands/generate_args.py: the settings, one field per flag, checked once by their
``validate``); ``generate_main(argv)`` / ``eval_main(argv)`` parse a command line into them.
The decoding flags become the decoder's ``DecodeConfig`` in commands/decoding.py (``serve``
uses it too).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

from torchtitan_speechlm.commands.decoding import decode_config
from torchtitan_speechlm.commands.generate_args import (
    EvalArgs,
    GenerateArgs,
    build_eval_parser,
    build_generate_parser,
)
from torchtitan_speechlm.data.catalog import open_prepared, split_indices
from torchtitan_speechlm.evaluation.judge_setup import (
    JudgeOptions,
    build_judges,
    check_judge_flags,
)
from torchtitan_speechlm.evaluation.prompted_tts import prompted_set
from torchtitan_speechlm.evaluation.recordings import find_recordings
from torchtitan_speechlm.evaluation.report import slug, write_report
from torchtitan_speechlm.evaluation.results_table import format_table
from torchtitan_speechlm.evaluation.sampled_pairs import (
    counts_line,
    pair_prompts,
    rewards_by_task,
    sample_configs,
    samples_audio_root,
    samples_of,
    write_pairs,
)
from torchtitan_speechlm.evaluation.text_scores import score_answers, score_asr
from torchtitan_speechlm.evaluation.tts_scores import score_tts
from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import load_model
from torchtitan_speechlm.generation.progress_lines import FrameCounter, frame_limit_line
from torchtitan_speechlm.generation.requests import TEXT_OUT, Outcome, Request, run_requests
from torchtitan_speechlm.generation.streaming import WavFileStream
from torchtitan_speechlm.utils.progress import Progress
from torchtitan_speechlm.utils.text_files import line_not_utf8


def write_outcome(
    loaded, task: str, outcome: Outcome, out: str | None, wav=None, stream=None
) -> dict:
    """A request's result line; writes ``out`` (wav or txt). ``wav``: the audio already decoded
    (a batch's, decoded together), else it is decoded here; ``stream``: the request's
    ``WavFileStream`` (``--stream``), which has written it as it was generated."""
    if stream is not None and outcome.error is None:
        samples = stream.finish(outcome.codes)
    if outcome.error is not None:
        return {"task": task, "error": outcome.error}
    if task in TEXT_OUT:
        if out:
            with open(out, "w") as f:
                f.write(outcome.text + "\n")
        return {"task": task, "text": outcome.text, "out": out}
    result = {"task": task, "frames": int(len(outcome.codes)), "out": out}
    if outcome.ended is not None:  # False: --max-frames cut it (frame_limit_line says so)
        result["ended"] = bool(outcome.ended)
    if stream is not None:
        result.update(samples=samples, first_audio_s=round(stream.first_audio_s or 0.0, 4))
    elif out:
        result["samples"] = tasks.write_wav(loaded, outcome.codes, out, wav)
    if out:
        result["sample_rate"] = loaded.codec.sample_rate
    return result


class _Streams(dict):
    """``--stream``: request i's ``WavFileStream``, opened with its first frames (a request that
    fails before it speaks leaves no file); ``on_frames`` for ``run_requests``."""

    def __init__(self, loaded, outs: dict[int, str]) -> None:
        super().__init__()
        self.loaded, self.outs = loaded, outs
        self.started = time.perf_counter()  # the time to first audio counts from here

    def on_frames(self, i: int, codes) -> None:
        if i not in self.outs:
            return
        if i not in self or len(codes) < self[i].sent:  # new, or rerun alone after its batch failed
            if i in self:
                self[i].file.close()
            self[i] = WavFileStream(self.loaded.codec, self.outs[i], self.started)
        self[i].frames(codes)


def generate_main(argv: list[str] | None = None) -> int:
    """``torchtitan generate`` of a command line (without the command's name)."""
    return generate(GenerateArgs.from_namespace(build_generate_parser().parse_args(argv)))


def run_generate(a: argparse.Namespace) -> int:
    """``torchtitan generate`` of the command line cli.py parsed."""
    return generate(GenerateArgs.from_namespace(a))


def generate(args: GenerateArgs) -> int:
    """``torchtitan generate``: one request (``args.task``, written to ``args.out``) or a
    batch file of them (``args.batch``, written into ``args.out_dir``) with ``args.model``; the
    exit status (2: an error, said on stderr; 1: a batch with failed requests)."""
    with Progress("torchtitan generate", args.progress) as progress:
        return _generate(args, progress)


def _generate(a: GenerateArgs, progress: Progress) -> int:
    try:
        a.validate()
        loaded = _load(a.model, a.device, progress)
        cfg = decode_config(a)
        if a.batch:
            return _batch(loaded, a.batch, a.out_dir or ".", cfg, a.batch_size, a.stream, progress)
        if a.out:
            tasks.make_parent_folder(a.out)  # before generating: a bad --out fails at once
        streaming = a.stream and a.out and a.task not in TEXT_OUT
        streams = _Streams(loaded, {0: a.out} if streaming else {})
        req = Request(a.task, a.text, a.audio, prompt=a.prompt)
        frames = FrameCounter(float(loaded.codec.frame_rate), progress, streams.on_frames)
        limit = (f"--max-text-tokens {cfg.max_text_tokens}" if a.task in TEXT_OUT
                 else f"--max-frames {cfg.max_frames}")  # fmt: skip
        progress.say(f"{a.task}: decoding (at most {limit})")
        outcome = run_requests(loaded, [req], cfg, on_frames=frames)[0]
        progress.say(f"{a.task}: decoded in {frames.seconds():.1f}s; writing")
        result = write_outcome(loaded, a.task, outcome, a.out, stream=streams.get(0))
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"torchtitan generate: error: {e}", file=sys.stderr)
        return 2
    if "error" in result:
        print(f"torchtitan generate: error: {result['error']}", file=sys.stderr)
        return 2
    if result.get("ended") is False:
        line = frame_limit_line(1, 1, cfg.max_frames, float(loaded.codec.frame_rate))
        print(f"torchtitan generate: {line}", file=sys.stderr)
    print(result["text"] if a.task in TEXT_OUT else json.dumps(result))
    return 0


def _load(model: str, device: str, progress: Progress):
    t = time.perf_counter()
    progress.say(f"loading {model}")
    loaded = load_model(model, device)
    progress.say(f"loaded {model} in {time.perf_counter() - t:.1f}s")
    return loaded


def _batch(
    loaded,
    path: str,
    out_dir: str,
    cfg: DecodeConfig,
    batch_size: int = 8,
    stream: bool = False,
    progress: Progress | None = None,
) -> int:
    """A batch file's requests (one JSON object per line), run by ``run_requests``: grouped by
    task and length into batched decoder calls; a bad line fails alone."""
    os.makedirs(out_dir, exist_ok=True)
    ids, reqs, bad = [], [], {}
    with open(path, "rb") as f:  # per line: a line that is not UTF-8 fails alone, named
        offset = 0
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                req = json.loads(raw.decode("utf-8"))
                if not isinstance(req, dict):
                    raise ValueError("not a JSON object")
            except UnicodeDecodeError as e:
                req, bad[len(reqs)] = {}, line_not_utf8(path, lineno, raw, start, e)
            except ValueError as e:
                req, bad[len(reqs)] = {}, f"{path} line {lineno}: not a JSON request ({e})"
            ids.append(str(req.get("id", f"line{lineno}")))
            reqs.append(
                Request(
                    req.get("task"),
                    req.get("text"),
                    req.get("audio"),
                    req.get("seed"),
                    req.get("prompt"),
                )
            )
    good = [i for i in range(len(reqs)) if i not in bad]
    outs = [os.path.join(out_dir, ids[i] + _ext(reqs[i].task)) for i in range(len(reqs))]
    audio_out = {k: outs[i] for k, i in enumerate(good) if reqs[i].task not in TEXT_OUT}
    streams = _Streams(loaded, audio_out if stream else {})
    progress = progress or Progress("torchtitan generate", enabled=False)
    frames = FrameCounter(float(loaded.codec.frame_rate), progress, streams.on_frames)
    started = [0]

    def on_batch(task: str, rows: int) -> None:
        frames.frames.clear()
        progress.say(f"{task}: requests {started[0] + 1}-{started[0] + rows} of {len(good)}")
        started[0] += rows

    found = run_requests(loaded, [reqs[i] for i in good], cfg, batch_size, frames, on_batch)
    outcomes = [Outcome(error=bad.get(i)) for i in range(len(reqs))]
    for i, outcome in zip(good, found, strict=True):
        outcomes[i] = outcome
    streamed = {good[k]: v for k, v in streams.items()}
    audio = [i for i, o in enumerate(outcomes) if o.codes is not None and i not in streamed]
    wavs = dict(
        zip(audio, tasks.decode_audio(loaded, [outcomes[i].codes for i in audio]), strict=True)
    )
    failed, ended = 0, []
    with open(os.path.join(out_dir, "results.jsonl"), "w") as res:
        for i, (rid, req, outcome) in enumerate(zip(ids, reqs, outcomes, strict=True)):
            try:
                row = write_outcome(
                    loaded, req.task, outcome, outs[i], wavs.get(i), streamed.get(i)
                )
            except OSError as e:
                row = {"task": req.task, "error": str(e)}
            failed += "error" in row
            res.write(json.dumps({"id": rid, **row}) + "\n")
            ended.append(row.get("ended"))
    if False in ended:
        line = frame_limit_line(ended.count(False), len(ended) - ended.count(None),
                                cfg.max_frames, float(loaded.codec.frame_rate))  # fmt: skip
        print(f"torchtitan generate: {line}", file=sys.stderr)
    print(f"wrote {os.path.join(out_dir, 'results.jsonl')} ({failed} failed)")
    return 1 if failed else 0


def _ext(task: str | None) -> str:
    return ".txt" if task in TEXT_OUT else ".wav"


def eval_main(argv: list[str] | None = None) -> int:
    """``torchtitan eval`` of a command line (without the command's name)."""
    return evaluate(EvalArgs.from_namespace(build_eval_parser().parse_args(argv)))


def run_eval(a: argparse.Namespace) -> int:
    """``torchtitan eval`` of the command line cli.py parsed."""
    return evaluate(EvalArgs.from_namespace(a))


def evaluate(args: EvalArgs) -> int:
    """``torchtitan eval``: score ``args.model`` on the ``args.valid`` sets (and write the
    preference pairs of ``args.pairs``); the exit status (2: an error, said on stderr)."""
    with Progress("torchtitan eval", args.progress) as progress:
        return _eval(args, progress)


def _eval(a: EvalArgs, progress: Progress) -> int:
    try:
        a.validate()
        options = JudgeOptions(
            a.judge_asr, a.judge_vocabulary, a.judge_grammar, a.judge_speaker, a.judge_quality,
            a.judge_quality_items, a.judge_word_loop,
        )  # fmt: skip
        if any(spec.partition(":")[0] in TTS_TASKS for spec in a.valid):
            check_judge_flags(options)  # before the model loads: a typo costs no loading
        loaded = _load(a.model, a.device, progress)
        cfg, results, sets, prompted = decode_config(a), {}, [], {}
        for spec in a.valid:
            task, _, name = spec.partition(":")
            if task == "tts_prompt":  # each item with another utterance of its speaker
                prompted[spec] = prompted_set(eval_dataset(loaded, name), a.valid_fraction, a.limit)
                items = prompted[spec]["items"]
            else:
                items = eval_items(loaded, name, a.valid_fraction, a.limit, EVAL_KINDS[task])
            sets.append((spec, task, eval_dataset(loaded, name), items))
        reward = rewards_by_task(a.reward or []) if a.pairs else None
        progress.say("loading the judges")
        judges = build_judges(
            options, {s: [it.text for it in items] for s, t, _, items in sets if t in TTS_TASKS}
        )

        manifests: dict = {}  # manifest lines read, shared by the sets
        pairs_prompts, pairs_samples = [], {}
        for i, (spec, task, path, items) in enumerate(sets):
            score = functools.partial(
                score_set, loaded, spec, task, path, items, judges, prompted.get(spec, {}),
                manifests,
            )  # fmt: skip
            if not a.pairs:
                progress.prefix = f"torchtitan eval: {spec}"
                results[spec] = score(progress, cfg, a.report, f"{i}-{_slug(spec)}")
                continue
            root = a.report or samples_audio_root(a.pairs)
            hear = bool(a.report) or (spec in judges and judges[spec].hears_audio())
            runs = []
            for k, cfg_k in enumerate(sample_configs(cfg, a.seed, a.samples)):
                # each sample counts its items anew: the prefix says which sample it is
                progress.prefix = f"torchtitan eval: {spec} sample {k + 1}/{a.samples}"
                runs.append(
                    score(progress, cfg_k, root, f"{i}-{_slug(spec)}/sample{k}", references=hear)
                )
                results[f"{spec} #{k}"] = runs[-1]
            folder = f"{i}-{_slug(spec)}"
            pairs_prompts += pair_prompts(loaded, task, path, items, runs, root, folder, manifests)
            pairs_samples.update(samples_of(task, items, runs, root))
        progress.prefix = "torchtitan eval"
        if a.pairs:
            counts = write_pairs(a.pairs, pairs_prompts, pairs_samples, reward, a.pair_margin,
                                 a.seed)  # fmt: skip
        if a.report:
            page = write_report(results, a.report, f"torchtitan eval: {a.model}")
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"torchtitan eval: error: {_one_line(e)}", file=sys.stderr)
        return 2
    print(format_table(results))
    for spec, res in results.items():
        if "prompted" in res and res["prompted"].get("sim_prompt") is not None:
            q = res["prompted"]
            print(
                f"{spec}: SIM(generated, prompt) {q['sim_prompt']:.3f} vs SIM(generated, other "
                f"speakers) {q['sim_other']:.3f}; speaker ID {q['speaker_id_accuracy']:.2f} among "
                f"{q['speakers']} speakers; {q['skipped']} items without a second utterance "
                "of their speaker left out"
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    if a.report:
        print(f"report: {page}")
    if a.pairs:
        print(counts_line(a.pairs, counts))
    return 0


def score_set(loaded, spec: str, task: str, path: str, items: list, judges: dict, prompted: dict,
              manifests: dict, progress: Progress | None, cfg: DecodeConfig,
              audio_root: str | None, folder: str, references: bool = True) -> dict:  # fmt: skip
    """One ``--valid`` set decoded with ``cfg`` and scored (TTS: its wavs under
    ``audio_root/folder`` when ``audio_root`` is given; ``references=False``: without the
    references' audio, which nothing then listens to)."""
    if task == "asr":
        return score_asr(loaded, items, cfg, progress=progress)
    if task == "dialogue":
        return score_answers(loaded, items, cfg, progress=progress)
    # the prompts' recordings too: the report plays them beside the prompts heard
    ids = [it.id for it in items] + [q.id for q in prompted.get("prompts", [])]
    found = find_recordings(path, list(dict.fromkeys(ids)), manifests)
    result = score_tts(
        loaded, items, cfg, judges[spec], audio_root, folder, recordings=found,
        progress=progress, prompts=prompted.get("prompts"), speakers=prompted.get("speakers"),
        reference_audio=references,
    )  # fmt: skip
    if prompted:
        result.setdefault("prompted", {})["skipped"] = prompted["skipped"]
    return result


def _slug(spec: str) -> str:
    return slug(spec)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def eval_dataset(loaded, name: str) -> str:
    """The prepared folder (absolute) of ``name``: a dataset of the run, or a folder."""
    path = loaded.record.get("datasets", {}).get(name, name)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise ValueError(
            f"{name!r} is neither a dataset of the run "
            f"({sorted(loaded.record.get('datasets', {}))}) nor a prepared folder"
        )
    return os.path.abspath(path)


EVAL_KINDS = {
    "asr": "speech",
    "tts": "speech",
    "tts_prompt": "speech",
    "dialogue": "dialogue",
}  # set -> item kind
TTS_TASKS = ("tts", "tts_prompt")  # the sets the judges score


def eval_items(loaded, name: str, valid_fraction: float, limit: int, kind: str = "speech") -> list:
    """The items of ``kind`` of ``name`` (``eval_dataset``) to evaluate: all, or those held
    out with ``valid_fraction``; at most ``limit``."""
    ds = open_prepared(eval_dataset(loaded, name))
    split = "valid" if valid_fraction > 0 else "all"
    idx = [int(i) for i in split_indices(ds.ids, valid_fraction, split) if ds.kinds[i] == kind]
    if not idx:
        raise ValueError(f"{name}: no {kind} items to evaluate")
    return [ds[i] for i in (idx[:limit] if limit else idx)]
