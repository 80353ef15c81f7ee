"""The per-shard work of ``torchtitan prepare``: load audio, tokenize, encode, write one shard.

Runs in the main process (``--workers 1``) or in worker processes that each load their own
codec and tokenizer (:func:`init_worker`). A shard is written to ``shards/.tmp-NNNNN-<pid>`` and
renamed to ``shards/NNNNN`` when complete, so an interrupted run leaves only finished shards
(and stale temp dirs that the next run deletes). Bad items are recorded and skipped — or, with
``strict``, abort the run with :class:`BadItemError` — and an item is written only once all of
its parts (every turn of a dialogue) succeeded, so nothing half-made reaches the dataset.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.data.format import PREFERENCE, SHARDS_DIR, Turn, shard_name
from torchtitan_speechlm.prepare.items import AudioRef, ManifestItem
from torchtitan_speechlm.prepare.shard_writer import ShardWriter
from torchtitan_speechlm.prepare.sources.hf import HFAudioReader
from torchtitan_speechlm.prepare.sources.lhotse import load_cut_audio
from torchtitan_speechlm.prepare.sources.preference import identical_answers
from torchtitan_speechlm.utils.audio import BadAudioError, load_audio
from torchtitan_speechlm.utils.parent_watch import exit_when_gone
from torchtitan_speechlm.utils.text_tokenizer import load_text_tokenizer

FAILURES = "failures.jsonl"


class BadItemError(ValueError):
    """An input item cannot be prepared; the message names the source line, id and audio."""


class _Skip(Exception):
    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


@dataclass
class WorkerConfig:
    codec_path: str
    tokenizer_path: str
    device: str = "cpu"
    num_streams: int | None = None
    hf: tuple | None = None  # (path, audio_column, split) of an HF dataset source
    allow_audio_only: bool = False
    strict: bool = False
    batch_size: int = 8
    header: dict = field(default_factory=dict)  # codec/tokenizer identity for shard.json
    imports: tuple[str, ...] = ()  # extension modules (codecs, sources) each worker imports


@dataclass
class ShardTask:
    index: int
    items: list[ManifestItem]
    inputs_hash: str


_state: dict = {}


def import_modules(names) -> None:
    """Import extension modules (they register codecs or sources when imported)."""
    import importlib

    for name in names:
        importlib.import_module(name)


def init_worker(cfg: WorkerConfig, progress_queue=None, threads: int | None = None,
                device_queue=None, owner: int | None = None) -> None:  # fmt: skip
    """Load this process' codec, tokenizer and (for HF sources) audio reader; with a
    ``device_queue`` (one device per worker), on the device taken from it. ``owner``: the pid of
    the prepare process, whose end ends this worker (utils/parent_watch.py says why)."""
    import dataclasses

    import torch

    if owner is not None:
        exit_when_gone(owner)
    if device_queue is not None:
        cfg = dataclasses.replace(cfg, device=device_queue.get())
    import_modules(cfg.imports)
    if threads:
        torch.set_num_threads(threads)
    _state.clear()
    _state.update(cfg=cfg, queue=progress_queue, callback=None,
                  codec=load_codec(cfg.codec_path, cfg.device, cfg.num_streams),
                  tok=load_text_tokenizer(cfg.tokenizer_path),
                  hf=HFAudioReader(*cfg.hf) if cfg.hf else None)  # fmt: skip


def use_in_process(cfg: WorkerConfig, codec, tok, callback) -> None:
    """Run shards in this process with an already loaded codec/tokenizer."""
    _state.clear()
    _state.update(cfg=cfg, queue=None, callback=callback, codec=codec, tok=tok,
                  hf=HFAudioReader(*cfg.hf) if cfg.hf else None)  # fmt: skip


def _report(items: int, seconds: float) -> None:
    if _state.get("queue") is not None:
        _state["queue"].put((items, seconds))
    elif _state.get("callback") is not None:
        _state["callback"](items, seconds)


def load_ref(ref: AudioRef, sample_rate: int, hf_reader=None) -> np.ndarray:
    """Audio of a reference (file, segment, HF row or lhotse cut) at ``sample_rate``, mono."""
    if ref.row is not None:
        return hf_reader.load(ref.row, sample_rate)
    if ref.lhotse is not None:
        return load_cut_audio(ref, sample_rate)
    return load_audio(ref.path, sample_rate, start=ref.start, end=ref.end, channel=ref.channel)


def _tokens(text: str, what: str) -> list[int]:
    if not text.strip():
        raise _Skip("empty_text", f"empty {what}")
    try:
        ids = _state["tok"](text, add_special_tokens=False)["input_ids"]
    except Exception as e:  # tokenizers raise assorted errors on odd input
        detail = f"{what} cannot be tokenized ({type(e).__name__}: {e})"
        raise _Skip("untokenizable_text", detail) from e
    if not ids:
        raise _Skip("untokenizable_text", f"{what} tokenizes to nothing")
    return ids


def _audio(ref: AudioRef) -> np.ndarray:
    try:
        return load_ref(ref, _state["codec"].sample_rate, _state["hf"])
    except BadAudioError as e:
        raise _Skip(e.code, e.reason) from e


def _load_item(item: ManifestItem) -> dict:
    """Everything but the codes: {"tokens", "wavs" (to encode), "turns"}; raises _Skip."""
    cfg = _state["cfg"]
    if item.kind == PREFERENCE:
        same = identical_answers(item)
        if same:
            raise _Skip("identical_pair", same)
    if item.turns is not None:
        turns, wavs = [], []
        for k, t in enumerate(item.turns):
            if t.audio is not None:
                wavs.append(_audio(t.audio))
                turns.append((t.role, "audio", len(wavs) - 1, ""))
            else:
                turns.append((t.role, "text", _tokens(t.text, f"text of turn {k}"), t.text))
        return {"tokens": [], "wavs": wavs, "turns": turns}
    wavs = [_audio(item.ref)] if item.ref is not None else []
    if item.kind == "audio":
        if not cfg.allow_audio_only:
            raise _Skip(
                "empty_text", "empty text (pass --allow-audio-only to keep audio-only items)"
            )
        return {"tokens": [], "wavs": wavs, "turns": None}
    return {"tokens": _tokens(item.text, "text"), "wavs": wavs, "turns": None}


def _encode_all(loaded: list[dict]) -> None:
    """Encode every waveform of a window in length-sorted batches (less padding); in place."""
    codec, bs = _state["codec"], _state["cfg"].batch_size
    flat = [(i, j, w) for i, d in enumerate(loaded) for j, w in enumerate(d["wavs"])]
    flat.sort(key=lambda x: len(x[2]))
    for d in loaded:
        d["codes"] = [None] * len(d["wavs"])
    for b in range(0, len(flat), bs):
        batch = flat[b : b + bs]
        for (i, j, _), c in zip(batch, codec.encode([w for _, _, w in batch]), strict=True):
            loaded[i]["codes"][j] = c


def _write(writer: ShardWriter, item: ManifestItem, d: dict) -> float:
    codec = _state["codec"]
    seconds = sum(len(w) for w in d["wavs"]) / codec.sample_rate
    if d["turns"] is not None:
        turns = [Turn(role, mod, np.asarray(d["codes"][x] if mod == "audio" else x), text)
                 for role, mod, x, text in d["turns"]]  # fmt: skip
        writer.add(item.id, item.kind, "", [], None, seconds, item.where, turns, item.speaker,
                   item.extra)  # fmt: skip
    else:
        codes = d["codes"][0] if d["codes"] else np.zeros((0, codec.num_streams), np.int64)
        writer.add(item.id, item.kind, item.text, d["tokens"], codes, seconds, item.where,
                   speaker=item.speaker, extra=item.extra)  # fmt: skip
    return seconds


def run_shard(task: ShardTask, out_dir: str) -> dict:
    """Prepare one shard into ``out_dir/shards/NNNNN``; return its shard.json dict."""
    cfg, codec = _state["cfg"], _state["codec"]
    name = shard_name(task.index)
    final = os.path.join(out_dir, SHARDS_DIR, name)
    tmp = os.path.join(out_dir, SHARDS_DIR, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    writer = ShardWriter(tmp, codec.num_streams, codec.codebook_size)
    failures: list[dict] = []
    window = max(cfg.batch_size * 8, 1)
    windows = [task.items[w0 : w0 + window] for w0 in range(0, len(task.items), window)]
    # the next window's audio is read and resampled by a thread while this one is encoded
    pool = ThreadPoolExecutor(1, thread_name_prefix="prepare-load")
    try:
        ahead = pool.submit(_load_window, windows[0]) if windows else None
        for k, win in enumerate(windows):
            results = ahead.result()
            ahead = pool.submit(_load_window, windows[k + 1]) if k + 1 < len(windows) else None
            items, loaded = [], []
            for item, d, e in results:
                if e is None:
                    loaded.append(d)
                    items.append(item)
                else:
                    ref = item.ref.describe() if item.ref is not None else "none"
                    if cfg.strict:
                        raise BadItemError(
                            f"{item.where}: item {item.id!r} (audio {ref}): {e.detail}"
                        ) from e
                    failures.append({"id": item.id, "source": item.where, "reason": e.code,
                                     "detail": e.detail, "audio": ref, "shard": name})  # fmt: skip
            _encode_all(loaded)
            seconds = sum(_write(writer, it, d) for it, d in zip(items, loaded, strict=True))
            _report(len(win), seconds)
        pool.shutdown()
        with open(os.path.join(tmp, FAILURES), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in failures)
        reasons: dict[str, int] = {}
        for r in failures:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
        header = dict(cfg.header, shard=name, inputs_hash=task.inputs_hash,
                      num_failed=len(failures), failed_by_reason=reasons)  # fmt: skip
        meta = writer.finish(header)
        if os.path.isdir(final):  # a stale shard of an abandoned plan
            shutil.rmtree(final)
        os.replace(tmp, final)
        return meta
    except BaseException:
        pool.shutdown(cancel_futures=True)
        writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_window(items: list[ManifestItem]) -> list[tuple]:
    """(item, loaded or None, _Skip or None) of each item (on the loading thread)."""
    out = []
    for item in items:
        try:
            out.append((item, _load_item(item), None))
        except _Skip as e:
            out.append((item, None, e))
    return out
