"""A tiny preference dataset (tts and asr pairs of varied lengths, scores, identical pairs)
prepared by the real `torchtitan prepare` path: the CLI's --preference source, the
workers, the tiny Encodec codec and the demo tokenizer of tests/data_fixtures.py."""

from __future__ import annotations

import json
import os
import shutil

import soundfile as sf

from tests.data_fixtures import SR, tone
from torchtitan_speechlm.commands.prepare import main

TTS_SECONDS = [(0.3, 0.9), (1.1, 0.5), (0.7, 0.7), (1.4, 0.4), (0.5, 1.2)]  # (chosen, rejected)
ASR_SECONDS = [0.4, 1.0, 0.6, 1.3]


def scores(good: float, bad: float) -> dict:
    return {"chosen": {"wer": good, "sim": 0.9}, "rejected": {"wer": bad, "sim": 0.8}}


def write_pairs(root: str, sentences: list[str]) -> tuple[str, list[dict]]:
    """``root/pairs.jsonl`` and its rows: 5 tts pairs, 4 asr pairs, a tts pair whose answers
    are two copies of one file (prepared, identical in tokens), then a pair of each task
    whose answers are the same (audio file, text: skipped by prepare)."""
    os.makedirs(os.path.join(root, "wavs"), exist_ok=True)

    def wav(name: str, i: int, seconds: float) -> str:
        sf.write(os.path.join(root, "wavs", name), tone(i, seconds, SR), SR)
        return f"wavs/{name}"

    rows = []
    for i, (c, r) in enumerate(TTS_SECONDS):
        rows.append({"id": f"t{i}", "task": "tts", "text": sentences[i], "speaker": f"s{i % 2}",
                     "chosen": {"audio": wav(f"t{i}c.wav", i, c)},
                     "rejected": {"audio": wav(f"t{i}r.wav", i + 3, r)},
                     "scores": scores(0.0, 0.1 * (i + 1))})  # fmt: skip
    for i, seconds in enumerate(ASR_SECONDS):
        rows.append({"id": f"a{i}", "task": "asr", "audio": wav(f"a{i}.wav", i + 5, seconds),
                     "chosen": {"text": sentences[10 + i]},
                     "rejected": {"text": sentences[20 + i]},
                     "scores": scores(0.1, 0.5)})  # fmt: skip
    shutil.copy(os.path.join(root, "wavs", "t1c.wav"), os.path.join(root, "wavs", "copy.wav"))
    rows.append({"id": "copy_tts", "task": "tts", "text": sentences[1],
                 "chosen": {"audio": "wavs/t1c.wav"}, "rejected": {"audio": "wavs/copy.wav"},
                 "scores": scores(0.2, 0.3)})  # fmt: skip
    rows.append({"id": "same_tts", "task": "tts", "text": sentences[30],
                 "chosen": {"audio": "wavs/t0c.wav"}, "rejected": {"audio": "./wavs/t0c.wav"},
                 "scores": scores(0.2, 0.2)})  # fmt: skip
    rows.append({"id": "same_asr", "task": "asr", "audio": "wavs/a0.wav",
                 "chosen": {"text": sentences[31]}, "rejected": {"text": sentences[31]},
                 "scores": scores(0.2, 0.2)})  # fmt: skip
    path = os.path.join(root, "pairs.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path, rows


def prepare_pairs(assets: dict, out: str) -> tuple[str, list[dict]]:
    """Write the pairs next to the assets and prepare them with the CLI; (dataset, rows)."""
    path, rows = write_pairs(os.path.join(assets["root"], "pairs"), assets["sentences"])
    argv = ["--preference", path, "--codec", assets["codec"], "--tokenizer", assets["tok"],
            "--out-dir", out, "--shard-size", "4", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    return out, rows
