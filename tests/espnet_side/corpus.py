"""An ESPnet SpeechLM corpus on disk, as its preparation scripts leave it.

Written from espnet/espnet ``espnet2/speechlm/bin/prepare_dataset_json.py`` (commit
002e14eb78e8) and ``bin/prepare_length_stats.py`` (05bcf8e05e19): a lhotse recordings manifest
(``recordings.jsonl.gz``, read by the wheel's ``LhotseAudioReader``), a text file of ``ID TEXT``
lines (``TextReader``), the dataset JSON ``{"data_entry": [{name, path, reader}], "samples":
[sorted ids]}`` and, per ``task:name``, ``stats_{task}_{name}.jsonl`` lines ``{id: length}``
with the preprocessor's ``find_length``.
"""

from __future__ import annotations

import json
import os

import numpy as np


def write_corpus(items: list[tuple[str, str, str]], folder: str) -> str:
    """``items``: (id, wav path, text). Returns the dataset JSON's path."""
    from lhotse import Recording, RecordingSet

    os.makedirs(os.path.join(folder, "audio"), exist_ok=True)
    recs = [Recording.from_file(path, recording_id=i) for i, path, _ in items]
    RecordingSet.from_recordings(recs).to_file(os.path.join(folder, "audio", "recordings.jsonl.gz"))
    with open(os.path.join(folder, "text"), "w", encoding="utf-8") as f:
        for i, _, text in items:
            f.write(f"{i} {text}\n")
    entries = [
        {"name": "audio1", "path": os.path.abspath(os.path.join(folder, "audio")),
         "reader": "lhotse_audio"},
        {"name": "text1", "path": os.path.abspath(os.path.join(folder, "text")), "reader": "text"},
    ]  # fmt: skip
    path = os.path.join(folder, "dataset.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"data_entry": entries, "samples": sorted(i for i, _, _ in items)}, f, indent=2)
    return path


def write_length_stats(preprocessor, specs: list[str], stats_dir: str) -> None:
    """``specs``: unregistered specifiers ``task:name:data_json``; one stats file each."""
    from espnet2.speechlm.dataloader.dataset import SingleDataset

    os.makedirs(stats_dir, exist_ok=True)
    for spec in specs:
        task, name, data_json = spec.split(":")[:3]
        ds = SingleDataset(data_json)
        with open(os.path.join(stats_dir, f"stats_{task}_{name}.jsonl"), "w") as f:
            for i in ds.sample_ids:
                f.write(json.dumps({i: preprocessor.find_length((task, name, i), ds[i])}) + "\n")


def tone_items(folder: str, texts: list[str], seed: int = 0, sr: int = 16000) -> list:
    """(id, wav path, text) of synthetic tones of varied lengths (no espeak needed)."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "wavs"), exist_ok=True)
    items = []
    for i, text in enumerate(texts):
        dur = 0.25 + 0.03 * len(text.split()) + 0.01 * (i % 5)
        t = np.arange(int(sr * dur)) / sr
        wav = 0.3 * np.sin(2 * np.pi * (140 + 25 * (i % 6)) * t) + 0.02 * rng.standard_normal(
            len(t)
        )
        path = os.path.join(folder, "wavs", f"utt{i:03d}.wav")
        sf.write(path, wav.astype(np.float32), sr)
        items.append((f"utt{i:03d}", path, text))
    return items
