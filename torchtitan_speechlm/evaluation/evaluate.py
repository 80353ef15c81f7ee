"""Scoring a model on prepared data with its own tasks (no downloaded models): the quick,
self-referential scores the demo and training samples use; ``torchtitan eval`` scores with
independent judges (``judged``) and keeps these under ``self``.

- ``asr``: greedy transcripts of each utterance, word and character error rates (jiwer);
- ``tts``: codec-token accuracy under teacher forcing (the training template, per stream and
  overall, over the frames that carry loss), and the word error rate of the model's own ASR of
  its greedy TTS output ("ASR of TTS").
"""

from __future__ import annotations

import numpy as np
import torch

from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import Loaded


def error_rates(refs: list[str], hyps: list[str]) -> dict:
    import jiwer

    return {"wer": float(jiwer.wer(refs, hyps)), "cer": float(jiwer.cer(refs, hyps))}


def evaluate_asr(loaded: Loaded, items: list, cfg: DecodeConfig, batch: int = 8) -> dict:
    refs, hyps = [], []
    for s in range(0, len(items), batch):
        chunk = items[s : s + batch]
        hyps += tasks.transcribe_items(loaded, chunk, cfg)
        refs += [it.text for it in chunk]
    out = error_rates(refs, hyps)
    out.update(
        items=len(items),
        examples=[{"ref": r, "hyp": h} for r, h in zip(refs, hyps, strict=True)][:5],
    )
    return out


@torch.no_grad()
def token_accuracy(loaded: Loaded, items: list) -> dict:
    """Codec-token accuracy under teacher forcing with the training template: overall and per
    stream, over audio targets only (stream 0's text/special targets are left out)."""
    model, builder, n = loaded.model, loaded.builder, loaded.layout.num_streams
    correct, count = np.zeros(n), np.zeros(n)
    for it in items:
        ex = builder.build("tts", it)
        frames = torch.from_numpy(ex.frames)[None]
        weights = torch.from_numpy(ex.weights)[None, 1:]
        weights[..., 0] *= torch.from_numpy(ex.frames[1:, 0] >= loaded.layout.stream_offset(0))
        out = model(frames[:, :-1], targets=frames[:, 1:], loss_weights=weights)
        # audio targets only: stream 0's text/special targets are left out
        correct += out.stats["acc_stream"].numpy()
        count += out.stats["count_stream"].numpy()
    return {
        "token_accuracy": float(correct.sum() / max(count.sum(), 1)),
        "token_accuracy_per_stream": (correct / np.maximum(count, 1)).tolist(),
    }


@torch.no_grad()
def evaluate_tts(loaded: Loaded, items: list, cfg: DecodeConfig, batch: int = 8) -> dict:
    refs, hyps = [], []
    for s in range(0, len(items), batch):
        chunk = items[s : s + batch]
        codes = tasks.tts(loaded, [it.text for it in chunk], cfg)
        hyps += tasks.asr(loaded, codes, cfg)
        refs += [it.text for it in chunk]
    return {
        **token_accuracy(loaded, items),
        "asr_of_tts": error_rates(refs, hyps),
        "items": len(items),
    }
