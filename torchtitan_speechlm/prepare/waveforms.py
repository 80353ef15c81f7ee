"""Add waveforms to a prepared dataset, for a continuous audio encoder (docs/audio-encoder.md).

Each shard gets ``audio_wave.npy`` (its items' audio, mono int16 at ``sample_rate``, one flat
array: memory-mapped and sliced at training time, no decoding; benchmarks/bench_wave_store.py
measured it against FLAC and stored log-mel) and ``waves.jsonl`` (per item, in items.jsonl
order: id, offset, samples). ``metadata.json`` records ``waveform``: the rate, the dtype, each
shard's file sizes and sha256 (checked when the dataset is opened), and the longest item.
The audio is read again from the manifest the dataset was prepared from (JSONL lines with
``id`` and ``audio``, paths relative to the manifest), so the codes and the waveform of an item
are the same recording.

    python -m torchtitan_speechlm.prepare.waveforms PREPARED MANIFEST [--sample-rate 16000]

or, in one command with the preparation: ``torchtitan prepare --manifest M.jsonl ...
--waveforms 16000``.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from torchtitan_speechlm.data.format import (
    AUDIO_WAVE,
    ITEMS,
    METADATA,
    SHARDS_DIR,
    WAVE_DTYPE,
    WAVE_INDEX,
    file_digest,
    read_json,
    to_int16,
)
from torchtitan_speechlm.utils.audio import load_audio
from torchtitan_speechlm.utils.fileio import write_json_atomic, write_text_atomic


class WaveformError(ValueError):
    """An item of the dataset has no audio in the manifest; the message names it."""


def read_manifest(manifest: str) -> dict[str, str]:
    """``id -> audio path`` of a JSONL manifest (paths relative to its folder): a speech
    line's ``audio``, or a dialogue's one audio turn (the input of task ``dialogue_wave``).
    Lines without exactly one audio path (text-only, dialogues with none or several audio
    turns) are left out."""
    base, out = os.path.dirname(os.path.abspath(manifest)), {}
    with open(manifest, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                turns = r.get("turns") if isinstance(r.get("turns"), list) else []
                audio = [t["audio"] for t in turns if isinstance(t, dict) and "audio" in t]
                if isinstance(r.get("audio"), str):
                    audio = [r["audio"]]
                if len(audio) == 1 and isinstance(audio[0], str) and "id" in r:
                    out[str(r["id"])] = os.path.join(base, audio[0])
    return out


def write_shard_waves(sdir: str, paths: dict[str, str], sample_rate: int) -> tuple[dict, int]:
    """A shard's two files (each written to a temporary name, then renamed); returns their
    fingerprint and the shard's longest item in samples."""
    with open(os.path.join(sdir, ITEMS), encoding="utf-8") as f:
        ids = [str(json.loads(line)["id"]) for line in f if line.strip()]
    missing = [i for i in ids if i not in paths]
    if missing:
        raise WaveformError(
            f"{sdir}: items {missing[:4]} ({len(missing)}) have no audio path in the manifest "
            "(text-only lines and dialogues without exactly one audio turn have no waveform; a "
            "continuous encoder takes speech items and one-audio-turn dialogues): add the "
            "waveforms from the manifest the dataset was prepared from"
        )
    waves = [to_int16(load_audio(paths[i], sample_rate)) for i in ids]
    lengths = [len(w) for w in waves]
    offsets = np.cumsum([0, *lengths])[:-1]
    tmp = os.path.join(sdir, AUDIO_WAVE + ".tmp.npy")
    np.save(tmp, np.concatenate(waves) if waves else np.zeros(0, WAVE_DTYPE))
    os.replace(tmp, os.path.join(sdir, AUDIO_WAVE))
    lines = [json.dumps({"id": i, "offset": int(o), "samples": n}) + "\n"
             for i, o, n in zip(ids, offsets, lengths, strict=True)]  # fmt: skip
    write_text_atomic(os.path.join(sdir, WAVE_INDEX), "".join(lines))
    files = {
        name: {
            "bytes": os.path.getsize(os.path.join(sdir, name)),
            "sha256": file_digest(os.path.join(sdir, name)),
        }
        for name in (AUDIO_WAVE, WAVE_INDEX)
    }
    return files, max(lengths, default=0)


def add_waveforms(prepared: str, manifest: str, sample_rate: int = 16000) -> dict:
    """Write every shard's waveforms and record them in metadata.json (returned)."""
    meta_path = os.path.join(prepared, METADATA)
    meta = read_json(meta_path)
    paths = read_manifest(manifest)
    files, longest = {}, 0
    for entry in meta.get("shards", []):
        sdir = os.path.join(prepared, SHARDS_DIR, str(entry["name"]))
        files[entry["name"]], n = write_shard_waves(sdir, paths, sample_rate)
        longest = max(longest, n)
    meta["waveform"] = {
        "sample_rate": sample_rate,
        "dtype": "int16",
        "max_samples": longest,
        "files": files,
    }
    write_json_atomic(meta_path, meta)
    return meta


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("prepared", help="a dataset written by `torchtitan prepare`")
    p.add_argument("manifest", help="the JSONL manifest it was prepared from")
    p.add_argument("--sample-rate", type=int, default=16000, help="the audio encoder's rate")
    return p


def describe(prepared: str, meta: dict) -> str:
    """One line on the waveforms ``add_waveforms`` wrote."""
    w = meta["waveform"]
    return (f"{prepared}: waveforms of {meta.get('num_items')} items at {w['sample_rate']} Hz, "
            f"longest {w['max_samples'] / w['sample_rate']:.2f} s")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    print(describe(a.prepared, add_waveforms(a.prepared, a.manifest, a.sample_rate)))


if __name__ == "__main__":
    main()
