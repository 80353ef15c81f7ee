"""``prepare_dataset``: turn a corpus (JSONL manifest, Kaldi dir, HF dataset on disk, lhotse cuts
or Shar) into a prepared dataset (docs/data.md); ``join_parts``, and the summary lines. The
``torchtitan prepare`` command around them (its flags, ``prepare(PrepareArgs)``) is
commands/prepare.py.

Encoding audio with a codec is the expensive step of speech-LM training, so it is done once,
offline. Items are cut into shards of ``shard_size`` in input order; shards are encoded by one
or more worker processes and each appears atomically, so an interrupted run can simply be run
again: finished shards whose inputs, codec and tokenizer are unchanged are kept, the rest are
done. ``metadata.json`` is written last; its presence means the dataset is complete.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import sys
import time

from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.codecs.fitting import FITTERS, FitSettings
from torchtitan_speechlm.data.format import codec_of, read_json
from torchtitan_speechlm.data.tokenizer_check import LossyTokenizerError, check_inputs
from torchtitan_speechlm.prepare.items import ManifestError, ManifestItem
from torchtitan_speechlm.prepare.parts import (
    Mutex,
    PartError,
    PartLock,
    missing_message,
    owned,
    parse_part,
    part_device,
    read_checks,
    read_records,
    remove_state,
    run_id,
    write_checks,
    write_record,
)
from torchtitan_speechlm.prepare.plan import (
    PLAN,
    PlanMismatchError,
    build_plan,
    finalize,
    open_out_dir,
    shard_done,
)
from torchtitan_speechlm.prepare.run import fit_or_reuse_codec, run_shards
from torchtitan_speechlm.prepare.sources import SOURCES, read_source
from torchtitan_speechlm.prepare.split import (
    SPLIT_FILE,
    check_fraction,
    split_items,
)
from torchtitan_speechlm.prepare.worker import (
    BadItemError,
    ShardTask,
    WorkerConfig,
    import_modules,
)
from torchtitan_speechlm.utils.fileio import write_json_atomic
from torchtitan_speechlm.utils.text_tokenizer import load_text_tokenizer, tokenizer_fingerprint


class NoItemsError(RuntimeError):
    """Every input item failed (see failures.jsonl); nothing to train on."""


def _strict_precheck(items: list[ManifestItem], allow_audio_only: bool) -> None:
    """With ``strict``: fail before any output exists on problems visible without decoding."""
    for it in items:
        refs = [t.audio for t in it.turns or [] if t.audio] + ([it.ref] if it.ref else [])
        for ref in refs:
            if ref.path is not None and not os.path.isfile(ref.path):
                raise BadItemError(
                    f"{it.where}: item {it.id!r} (audio {ref.describe()}): audio file not found"
                )
        if (
            it.kind in ("speech", "text")
            and not it.text.strip()
            or (it.kind == "audio" and not allow_audio_only)
        ):
            raise BadItemError(f"{it.where}: item {it.id!r}: empty text")


def prepare_dataset(
    manifest: str | None,
    codec_path: str | None,
    tokenizer_path: str,
    out_dir: str,
    batch_size: int = 8,
    device: str = "cpu",
    progress: bool = True,
    overwrite: bool = False,
    *,
    kaldi: str | None = None,
    hf_dataset: str | None = None,
    audio_column: str = "audio",
    text_column: str = "text",
    split: str | None = None,
    workers: int = 1,
    shard_size: int = 1000,
    num_streams: int | None = None,
    strict: bool = False,
    allow_audio_only: bool = False,
    fit_kmeans_codec: str | None = None,
    fit_mel_codec: str | None = None,
    fit_world_codec: str | None = None,
    codebooks: int = 4,
    codebook_size: int | None = None,
    kmeans_seconds: float = 600.0,
    kmeans_frame_rate: float = 50.0,
    mel_stack: int = 4,
    seed: int = 0,
    allow_lossy_tokenizer: bool = False,
    source: tuple[str, str] | None = None,
    source_options: dict | None = None,
    imports: tuple[str, ...] = (),
    dev_fraction: float | None = None,
    dev_seed: int = 0,
    part: str | None = None,
) -> dict:
    """Prepare (or finish preparing) a dataset in ``out_dir``; return the summary dict.

    ``dev_fraction=F`` (``--dev-fraction``): carve a deterministic dev split (by speaker where
    the source names speakers, else by item; ``prepare/split.py``, seeded by ``dev_seed``) and
    write two datasets, ``out_dir/train`` and ``out_dir/dev``, plus ``out_dir/split.json``;
    the return value is then ``{"train": summary, "dev": summary, "split": info}``.

    Exactly one source: ``manifest``, ``kaldi``, ``hf_dataset`` (with ``audio_column``,
    ``text_column``, ``split``) or ``source=(name, path)`` for any registered source (e.g.
    ``("lhotse", "cuts.jsonl.gz")``) with its ``source_options``. Bad items are recorded in
    ``failures.jsonl`` and skipped; ``strict=True`` raises :class:`BadItemError` on the first
    one instead. Raises :class:`NoItemsError` if no item survives. ``imports``: extension
    modules (registering codecs or sources) to import here and in every worker process.
    The tokenizer must give back the input texts (``tokenizer_check``): a lossy one raises
    :class:`LossyTokenizerError` before any output exists, unless ``allow_lossy_tokenizer``.

    ``part="i/N"`` (``--part``; else torchrun's or a SLURM array's variables, see
    ``prepare/parts.py``): encode only the shards ``j % N == i``, with ``device="cuda"`` on
    ``cuda:LOCAL_RANK``; the part that finds every shard finished joins them. A part that does
    not join returns ``{"complete": False, "part": "i/N", "missing": ..., ...}``.
    """
    t0 = time.monotonic()
    if dev_fraction is not None:
        check_fraction(dev_fraction)
    import_modules(imports)
    given = [
        (n, p)
        for n, p in (("manifest", manifest), ("kaldi", kaldi), ("hf_dataset", hf_dataset))
        if p is not None
    ]
    given += [tuple(source)] if source is not None else []
    if len(given) != 1:
        flags = ", ".join(s.flag for _, s in SOURCES.items())
        raise ValueError(f"give exactly one source: {flags}")
    (source_name, source_path), options = given[0], dict(source_options or {})
    if hf_dataset is not None:  # the keyword form carries its options as keywords too
        options.update(audio_column=audio_column, text_column=text_column, split=split)
    fits = [(kind, d) for kind, d in (("kmeans", fit_kmeans_codec), ("mel", fit_mel_codec),
                                      ("world", fit_world_codec)) if d is not None]  # fmt: skip
    if (codec_path is not None) + len(fits) != 1:
        raise ValueError(
            "give exactly one of --codec DIR, --fit-kmeans-codec DIR, --fit-mel-codec DIR or "
            "--fit-world-codec DIR"
        )
    if batch_size < 1 or workers < 1 or shard_size < 1:
        raise ValueError("batch_size, workers and shard_size must be >= 1")
    out_dir = os.path.abspath(out_dir)
    this_part = parse_part(part)
    device = part_device(device)
    read = read_source(source_name, source_path, options)
    items, hf_reader = read.items, read.hf_reader
    if not items:
        raise ManifestError(f"{source_path}: no items")
    if strict:
        _strict_precheck(items, allow_audio_only)
    tok = load_text_tokenizer(tokenizer_path)  # checked before any output or codec work
    roundtrip = check_inputs(tok, items, os.path.abspath(tokenizer_path), allow_lossy_tokenizer)
    split = split_items(items, dev_fraction, dev_seed) if dev_fraction is not None else None
    if fits:  # fitted on the training items only
        (kind, folder), settings = fits[0], FitSettings(codebooks, codebook_size, seed,
                                                        kmeans_frame_rate, mel_stack)  # fmt: skip
        fit = functools.partial(fit_or_reuse_codec, FITTERS[kind], folder,
                                split.train if split else items, settings, kmeans_seconds,
                                overwrite, progress, hf_reader)  # fmt: skip
        if this_part[1] == 1:
            codec_path = fit()
        else:  # one part fits, the others then reuse its codec
            with Mutex(out_dir):
                codec_path = fit()
    codec = load_codec(codec_path, device if workers == 1 else "cpu", num_streams)
    if getattr(codec, "bandwidth_note", ""):  # which Encodec bandwidth --num-streams chose
        print(f"prepare: {codec.bandwidth_note}", file=sys.stderr, flush=True)
    cfg = WorkerConfig(os.path.abspath(codec_path), os.path.abspath(tokenizer_path), device,
                       num_streams, hf_reader, allow_audio_only, strict, batch_size,
                       {}, tuple(imports))  # fmt: skip
    part = functools.partial(_prepare_part, codec=codec, tok=tok, cfg=cfg, workers=workers,
                             shard_size=shard_size, allow_audio_only=allow_audio_only,
                             overwrite=overwrite, progress=progress, roundtrip=roundtrip,
                             part=this_part)  # fmt: skip
    if split is None:
        return part(items, read.description, out_dir, t0)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"output path {out_dir} exists and is not a directory")
    if os.path.isfile(os.path.join(out_dir, PLAN)):
        raise PlanMismatchError(
            f"{out_dir} holds a preparation without a dev split; with --dev-fraction, --out-dir is "
            "the folder of the two splits (OUT/train, OUT/dev): use another --out-dir"
        )
    summaries = {}
    for name, subset in (("train", split.train), ("dev", split.dev)):
        what = dict(read.description, split=dict(name=name, **{k: split.info[k] for k in
                    ("dev_fraction", "seed", "by")}))  # fmt: skip
        summaries[name] = part(subset, what, os.path.join(out_dir, name), t0)
    write_json_atomic(os.path.join(out_dir, SPLIT_FILE), split.info)
    return {**summaries, "split": split.info}


def _prepare_part(items, description: dict, out_dir: str, t0: float, *, codec, tok, cfg,
                  workers: int, shard_size: int, allow_audio_only: bool, overwrite: bool,
                  progress: bool, roundtrip: dict, part: tuple[int, int] = (0, 1)) -> dict:  # fmt: skip
    """Plan, encode and finish one prepared dataset of ``items`` in ``out_dir``: the shards of
    ``part`` (i, N) (all with (0, 1)), then the join if every shard is finished."""
    plan = build_plan(
        items, description, codec, tokenizer_fingerprint(tok), shard_size, allow_audio_only
    )
    num_shards = len(plan["shard_inputs"])
    mine = owned(num_shards, part)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"output path {out_dir} exists and is not a directory")
    created = not os.path.isdir(out_dir)
    rid = run_id(plan)
    lock = PartLock(out_dir, part, rid)
    with Mutex(out_dir):
        lock.check_others()
        open_out_dir(out_dir, plan, overwrite, set(mine))
        lock.acquire()
        write_checks(out_dir, {"tokenizer_roundtrip": roundtrip})
    try:
        cfg = dataclasses.replace(
            cfg, header={"codec": codec_of(plan).to_dict(), "tokenizer": plan["tokenizer"]}
        )
        todo = [s for s in mine if not shard_done(out_dir, s, plan["shard_inputs"][s], plan)]
        # each shard's items are taken from the source when its task is handed out, not all
        # at once (a spilled source stays on disk: prepare/spill.py)
        tasks = (ShardTask(s, items[s * shard_size : (s + 1) * shard_size],
                           plan["shard_inputs"][s]) for s in todo)  # fmt: skip
        total = sum(min(shard_size, len(items) - s * shard_size) for s in todo)
        reused = len(mine) - len(todo)
        try:
            audio_s = run_shards(tasks, out_dir, cfg, workers, codec, tok, progress, total,
                                 len(todo))  # fmt: skip
        except BaseException:
            if (
                created
                and part[1] == 1
                and not any(
                    shard_done(out_dir, s, h, plan) for s, h in enumerate(plan["shard_inputs"])
                )
            ):
                lock.release()
                shutil.rmtree(out_dir, ignore_errors=True)  # made by this run, nothing finished
            raise
        elapsed = time.monotonic() - t0
        run_info = {"shards_reused": reused, "shards_written": len(todo),
                    "elapsed_seconds": round(elapsed, 3),
                    "audio_seconds_per_second": round(audio_s / max(elapsed, 1e-9), 2)}  # fmt: skip
        if part[1] > 1:
            write_record(out_dir, part, rid, dict(run_info, audio_seconds=round(audio_s, 3)))
        with Mutex(out_dir):  # the last part to finish joins (one at a time)
            missing = [s for s, h in enumerate(plan["shard_inputs"])
                       if not shard_done(out_dir, s, h, plan)]  # fmt: skip
            if missing:
                return dict(run_info, out_dir=out_dir, part=f"{part[0]}/{part[1]}",
                            complete=False, missing_shards=len(missing),
                            missing=missing_message(out_dir, missing, part[1]))  # fmt: skip
            if part[1] > 1:
                run_info = joined_run_info(out_dir, rid, part[1])
            lock.release()
            try:
                return _finish(out_dir, plan, run_info, {"tokenizer_roundtrip": roundtrip})
            finally:
                if part[1] == 1:
                    remove_state(out_dir)
    finally:
        lock.release()


def _finish(out_dir: str, plan: dict, run_info: dict, checks: dict) -> dict:
    summary = finalize(out_dir, plan, run_info, checks)
    if summary["num_items"] == 0:
        raise NoItemsError(
            f"all {summary['items_skipped']} items failed ({summary['skipped_by_reason']}); "
            f"see {os.path.join(out_dir, 'failures.jsonl')}"
        )
    return summary


def joined_run_info(out_dir: str, rid: str, n_parts: int | None = None) -> dict:
    """summary.json's run figures of a joined dataset: the parts' records summed (elapsed:
    the longest part; throughput: all parts' audio over it)."""
    recs = [r for r in read_records(out_dir, rid)
            if n_parts is None or r["part"].endswith(f"/{n_parts}")]  # fmt: skip
    elapsed = max([r["elapsed_seconds"] for r in recs], default=0.0)
    audio = sum(r.get("audio_seconds", 0.0) for r in recs)
    return {"shards_reused": sum(r["shards_reused"] for r in recs),
            "shards_written": sum(r["shards_written"] for r in recs),
            "elapsed_seconds": elapsed,
            "audio_seconds_per_second": round(audio / max(elapsed, 1e-9), 2),
            "parts": sorted(r["part"] for r in recs)}  # fmt: skip


def join_parts(out_dir: str) -> dict:
    """``torchtitan prepare --join OUT``: write the final files of a dataset prepared in parts
    once every shard is finished; raise :class:`PartError` naming the missing shards (and their
    parts) otherwise. Returns the summary. Safe to run while parts run, and again."""
    out_dir = os.path.abspath(out_dir)
    plan_file = os.path.join(out_dir, PLAN)
    if not os.path.isfile(plan_file):
        raise PartError(f"{out_dir} holds no {PLAN}: not a preparation (run the parts first)")
    plan = read_json(plan_file)
    rid = run_id(plan)
    with Mutex(out_dir):
        missing = [s for s, h in enumerate(plan["shard_inputs"])
                   if not shard_done(out_dir, s, h, plan)]  # fmt: skip
        recs = read_records(out_dir, rid)
        n = max((int(r["part"].split("/")[1]) for r in recs), default=None)
        if missing:
            raise PartError(missing_message(out_dir, missing, n))
        return _finish(out_dir, plan, joined_run_info(out_dir, rid, n), read_checks(out_dir))


def format_speakers(v: dict) -> str:
    """The summary's speakers line (``speakers`` of summary.json, ``format.speaker_summary``)."""
    if not v["labelled"]:
        return f"speakers: none named by the source (each of the {v['count']} items is its own)"
    own = v["unlabelled_items"]
    given = f"{v['labelled']} named" + (f" + {own} items without one, each its own" if own else "")
    return (
        f"speakers: {v['count']} ({given}); utterances per speaker: min {v['utterances_min']}, "
        f"median {v['utterances_median']:g}, max {v['utterances_max']}; "
        f"{v['single_utterance']} with a single utterance"
    )


def format_summary(s: dict) -> str:
    if s.get("complete") is False:  # a part that did not join
        return (
            f"prepared part {s['part']} of {s['out_dir']}: {s['shards_written']} shards written, "
            f"{s['shards_reused']} reused ({s['elapsed_seconds']:.1f}s); not joined yet: "
            f"{s['missing']}"
        )
    skipped = ", ".join(f"{k}: {v}" for k, v in s["skipped_by_reason"].items()) or "none"
    line = (
        f"prepared {s['out_dir']}: {s['num_items']} items written ({s['kinds']}), "
        f"{s['items_skipped']} skipped ({skipped}); {s['hours']:.3f} h of audio, "
        f"{s['audio_tokens_per_stream']} audio tokens per stream x {s['num_streams']} streams, "
        f"{s['total_text_tokens']} text tokens; {s['shards_written']} shards written, "
        f"{s['shards_reused']} reused ({s['elapsed_seconds']:.1f}s)"
    )
    return line + ("\n" + format_speakers(s["speakers"]) if "speakers" in s else "")


__all__ = ["BadItemError", "LossyTokenizerError", "NoItemsError", "join_parts", "prepare_dataset"]
