"""A stand-in for ESPnet SpeechLM's DataIteratorFactory: the same interface
(``build_iter(global_step, length)`` -> a DataLoader of this rank's batches; ``build_iter()``
for validation) and batches in ESPnet's format and vocabulary (specials [0, 256), then text,
then one interval per audio stream; pad 0; delay-interleaved codes; loss masks with BOS 0)."""

from __future__ import annotations

import json

import numpy as np
import torch

NUM_STREAMS, CODEBOOK = 3, 16
BOS, EOS, USER, ASSISTANT, TEXT, AUDIO = 1, 2, 5, 6, 7, 8


def vocab_intervals(text_size: int) -> dict:
    start = 256 + text_size
    streams = [(start + k * CODEBOOK, start + (k + 1) * CODEBOOK) for k in range(NUM_STREAMS)]
    return {"special_token": [(0, 256)], "text": [(256, 256 + text_size)], "codec": streams}


def espnet_tts_sample(rng, intervals: dict, n_text: int = 5, frames: int = 6):
    """One TTS sample as ESPnet's preprocessor lays it out: [T, N] ids and loss mask."""
    n = NUM_STREAMS
    text_lo, _ = intervals["text"][0]
    rows, mask = [], []

    def special(tok, w):
        rows.append([tok] + [0] * (n - 1))
        mask.append([w] + [0.0] * (n - 1))

    special(BOS, 0.0)
    special(USER, 0.0)
    special(TEXT, 0.0)
    for t in rng.integers(0, 40, n_text):
        rows.append([text_lo + int(t)] + [0] * (n - 1))
        mask.append([0.0] * n)
    special(EOS, 0.0)
    special(ASSISTANT, 1.0)
    special(AUDIO, 1.0)
    codes = rng.integers(0, CODEBOOK, (frames, n))
    delayed = np.zeros((frames + n - 1, n), dtype=np.int64)
    for k, (lo, _) in enumerate(intervals["codec"]):
        delayed[k : k + frames, k] = lo + codes[:, k]
    rows += delayed.tolist()
    mask += [[1.0 / n] * n] * len(delayed)
    special(EOS, 1.0)
    return np.array(rows, dtype=np.int64), np.array(mask, dtype=np.float32)


class FakeFactory:
    def __init__(self, intervals, rank=0, world=1, n_batches=4, seed=0, log=None, rows=2):
        rng = np.random.default_rng(seed * 100 + rank)
        self.batches = []
        for b in range(n_batches):
            samples = [espnet_tts_sample(rng, intervals) for _ in range(rows)]
            t = max(len(s) for s, _ in samples)
            seqs = np.zeros((rows, t, NUM_STREAMS), dtype=np.int64)
            masks = np.zeros((rows, t, NUM_STREAMS), dtype=np.float32)
            for r, (s, m) in enumerate(samples):
                seqs[r, : len(s)], masks[r, : len(m)] = s, m
            keys = [("tts", "fake", f"r{rank}b{b}s{r}") for r in range(rows)]
            self.batches.append({"key": keys, "seqs": seqs, "loss_masks": masks})
        self.log = log

    def build_iter(self, global_step: int = 0, length: int | None = None):
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps({"global_step": global_step, "length": length}) + "\n")
        n = len(self.batches)
        length = n if length is None else length
        subset = [self.batches[(global_step + i) % n] for i in range(length)]
        return torch.utils.data.DataLoader(subset, batch_size=None)
