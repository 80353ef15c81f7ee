"""Shared builders for the data-preparation tests: tiny tokenizer/codec, tone corpora, and
helpers to compare prepared datasets item by item."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import soundfile as sf

from tests.tiny_codecs import build_codec
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.demo import assets as demo_assets

SR = 16000
needs_espeak = shutil.which("espeak-ng") is not None


def sine(freq: float, seconds: float, sr: int, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def tone(i: int, seconds: float, sr: int, seed: int = 0) -> np.ndarray:
    """A distinct, slightly noisy tone per index (codes differ between items)."""
    rng = np.random.default_rng(seed + i)
    n = int(seconds * sr)
    return sine(200 + 150 * (i % 9), seconds, sr) + 0.05 * rng.standard_normal(n).astype(np.float32)


def build_assets(root) -> dict:
    """Tiny tokenizer + encodec codec + a 6-item manifest of 22.05 kHz tone wavs."""
    root = str(root)
    sentences = demo_assets.load_sentences()
    tok = demo_assets.build_tokenizer(os.path.join(root, "tok"), sentences, vocab_size=300)
    codec = build_codec(os.path.join(root, "codec"), "encodec", seed=0)
    corpus = os.path.join(root, "corpus")
    rows = write_tone_corpus(corpus, [0.5, 1.3, 0.27, 2.0, 0.9, 1.0], sentences)
    return {"root": root, "tok": tok, "codec": codec, "sentences": sentences, "rows": rows,
            "manifest": os.path.join(corpus, "manifest.jsonl")}  # fmt: skip


def write_tone_corpus(corpus: str, durations: list[float], sentences: list[str], sr: int = 22050):
    os.makedirs(os.path.join(corpus, "wavs"), exist_ok=True)
    rows = []
    for i, seconds in enumerate(durations):
        sf.write(os.path.join(corpus, "wavs", f"a{i}.wav"), tone(i, seconds, sr), sr)
        rows.append({"id": f"a{i}", "audio": f"wavs/a{i}.wav", "text": sentences[i]})
    write_manifest(os.path.join(corpus, "manifest.jsonl"), rows)
    return rows


def write_manifest(path, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def assert_same_dataset(a: str, b: str) -> None:
    """Item-for-item equality of two prepared datasets (ids, kinds, text, tokens, codes, turns)."""
    da, db = PreparedDataset(a), PreparedDataset(b)
    assert len(da) == len(db) and da.ids == db.ids and list(da.kinds) == list(db.kinds)
    np.testing.assert_array_equal(da.text_lengths, db.text_lengths)
    np.testing.assert_array_equal(da.audio_lengths, db.audio_lengths)
    for i in range(len(da)):
        x, y = da[i], db[i]
        assert (x.id, x.text, x.seconds) == (y.id, y.text, y.seconds)
        np.testing.assert_array_equal(x.text_tokens, y.text_tokens)
        np.testing.assert_array_equal(x.audio_codes, y.audio_codes)
        assert (x.turns is None) == (y.turns is None)
        for s, t in zip(x.turns or [], y.turns or [], strict=True):
            assert (s.role, s.modality, s.text) == (t.role, t.modality, t.text)
            np.testing.assert_array_equal(s.tokens, t.tokens)
