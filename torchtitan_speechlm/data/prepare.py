"""``torchtitan prepare``: turn a JSONL manifest of (audio, transcript) into a prepared dataset.

Encoding audio with a neural codec is the expensive step of speech-LM training, so it is done
once, offline, and its output (codes + text tokens) is stored in the format of
:mod:`.prepared`. Output appears atomically: the dataset is written to ``<out>.tmp-<pid>`` and
renamed into place only when complete, so a crash or a bad input never leaves a dataset that
looks finished.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from .audio import BadAudioError, load_audio
from .codec import CodecError, load_codec
from .manifest import ManifestError, ManifestItem, read_jsonl_manifest
from .prepared import CorruptDatasetError, PreparedWriter
from .tokenizer import load_text_tokenizer, tokenizer_fingerprint


class BadItemError(ValueError):
    """A manifest item cannot be prepared; the message names the manifest line, id and file."""


def _item_error(manifest: str, item: ManifestItem, reason: str) -> BadItemError:
    return BadItemError(f"{manifest}:{item.line}: item {item.id!r} (audio {item.audio}): {reason}")


class _Progress:
    """A throttled 'items done / total, audio s/s, ETA' line on stderr."""

    def __init__(self, total: int, enabled: bool, every_s: float = 2.0):
        self.total, self.enabled, self.every_s = total, enabled, every_s
        self.start = self.last = time.monotonic()

    def update(self, done: int, audio_seconds: float) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.every_s and done < self.total):
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        eta = (self.total - done) * elapsed / max(done, 1)
        print(
            f"prepare: {done}/{self.total} items, {audio_seconds / elapsed:.1f} audio s/s, "
            f"elapsed {elapsed:.0f}s, ETA {eta:.0f}s",
            file=sys.stderr,
            flush=True,
        )


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"output path {out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(
            f"output directory {out_dir} is not empty; pass overwrite=True (--overwrite) to replace it"
        )


def _check_items(manifest: str, items: list[ManifestItem]) -> None:
    """Fail before any encoding on problems visible without decoding audio."""
    if not items:
        raise ManifestError(f"{manifest}: no items")
    for item in items:
        if not item.text.strip():
            raise _item_error(manifest, item, "empty text")
        if not os.path.isfile(item.audio):
            raise _item_error(manifest, item, "audio file not found")


def prepare_dataset(
    manifest: str,
    codec_path: str,
    tokenizer_path: str,
    out_dir: str,
    batch_size: int = 8,
    device: str = "cpu",
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Encode every manifest item and write a prepared dataset to ``out_dir``; return a summary.

    Any unusable item (missing/unreadable/empty audio, empty text) aborts the whole run with a
    :class:`BadItemError` naming it, and nothing is left on disk.
    """
    manifest = os.path.abspath(manifest)
    out_dir = os.path.abspath(out_dir)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    _check_out_dir(out_dir, overwrite)
    items = read_jsonl_manifest(manifest)
    _check_items(manifest, items)
    codec = load_codec(codec_path, device=device)
    tok = load_text_tokenizer(tokenizer_path)
    codec_meta = {
        "name": codec.name,
        "path": codec.path,
        "class": codec.class_name,
        "sample_rate": codec.sample_rate,
        "frame_rate": codec.frame_rate,
        "num_streams": codec.num_streams,
        "codebook_size": codec.codebook_size,
        "config_hash": codec.config_hash,
    }

    def load_batch(batch: list[ManifestItem]):
        wavs = []
        for item in batch:
            try:
                wavs.append(load_audio(item.audio, codec.sample_rate))
            except BadAudioError as e:
                raise _item_error(manifest, item, e.reason) from e
        return wavs

    tmp_dir = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    t0 = time.monotonic()
    writer = None
    try:
        writer = PreparedWriter(tmp_dir, codec_meta, tokenizer_fingerprint(tok))
        batches = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
        bar = _Progress(len(items), progress)
        # Decode/resample the next batch on a thread while the codec encodes this one.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(load_batch, batches[0])
            for b, batch in enumerate(batches):
                wavs = pending.result()
                if b + 1 < len(batches):
                    pending = pool.submit(load_batch, batches[b + 1])
                codes = codec.encode(wavs)
                ids = tok([it.text for it in batch], add_special_tokens=False)["input_ids"]
                for item, wav, c, t in zip(batch, wavs, codes, ids, strict=True):
                    if not t:
                        raise _item_error(manifest, item, "text tokenizes to nothing")
                    writer.add(item.id, item.text, t, c, len(wav) / codec.sample_rate)
                bar.update(writer.num_items, writer.total_audio_seconds)
        meta = writer.finish()
        if os.path.isdir(out_dir):  # empty, or overwrite=True: swap the old one out
            old = f"{out_dir}.old-{os.getpid()}"
            os.replace(out_dir, old)
            try:
                os.replace(tmp_dir, out_dir)
            except BaseException:
                os.replace(old, out_dir)  # put the previous dataset back
                raise
            shutil.rmtree(old)
        else:
            os.replace(tmp_dir, out_dir)
    except BaseException:
        if writer is not None:
            writer.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return {
        "out_dir": out_dir,
        "num_items": meta["num_items"],
        "total_audio_seconds": meta["total_audio_seconds"],
        "hours": meta["total_audio_seconds"] / 3600,
        "total_frames": meta["total_frames"],
        "total_text_tokens": meta["total_text_tokens"],
        "elapsed_seconds": round(time.monotonic() - t0, 3),
    }


def main(argv: list[str] | None = None) -> int:
    """CLI entry point for ``torchtitan prepare``; returns the exit status."""
    p = argparse.ArgumentParser(
        prog="torchtitan prepare",
        description="Encode a JSONL manifest of audio + text into a prepared dataset (docs/data.md).",
    )
    p.add_argument("--manifest", required=True, help="JSONL with id, audio, text per line")
    p.add_argument("--codec", required=True, help="local codec directory (Encodec, Mimi or DAC)")
    p.add_argument("--tokenizer", required=True, help="local text tokenizer directory")
    p.add_argument("--out", required=True, help="output directory for the prepared dataset")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu", help="torch device for the codec, e.g. cuda")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        s = prepare_dataset(
            args.manifest, args.codec, args.tokenizer, args.out, batch_size=args.batch_size,
            device=args.device, progress=not args.no_progress, overwrite=args.overwrite,
        )  # fmt: skip
    except (OSError, CodecError, ManifestError, BadItemError, CorruptDatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"prepared {s['out_dir']}: {s['num_items']} items, {s['hours']:.3f} h of audio, "
        f"{s['total_frames']} frames, {s['total_text_tokens']} text tokens "
        f"({s['elapsed_seconds']:.1f}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
