"""Best-of-N TTS: which of a text's N sampled renditions to keep, chosen by the model's own ASR.

A small speech LM that speaks a held-out sentence often says one word wrong (most often its last
noun) while it reads speech back almost perfectly (the demo: TTS WER 0.17, ASR WER 0.02). So
``DecodeConfig.best_of = N`` samples N renditions per text (seeds ``seed .. seed + N - 1``, as
``eval --samples`` numbers its samples), transcribes each with the same model and keeps the one
whose transcript is closest to the text: generation/tasks.py::tts_with_ends runs the decoding,
this module only ranks. The judges that score a model stay independent of it (docs/quality.md).
"""

from __future__ import annotations

from torchtitan_speechlm.judges.text_scoring import item_errors


def candidate_rows(rows: list, n: int) -> list:
    """Each of ``rows`` repeated ``n`` times in a row: row i's candidate k is ``i * n + k``."""
    return [r for r in rows for _ in range(n)]


def candidate_seeds(seeds: list[int], n: int) -> list[int]:
    """Candidate k of a row with seed s draws with seed s + k."""
    return [s + k for s in seeds for k in range(n)]


def rank_key(text: str, transcript: str | None, ended: bool, k: int) -> tuple:
    """The order of one candidate (lower is better): one the ``max_frames`` limit cut after
    every one the model ended itself, then WER and CER of the model's transcript against the
    text (``judges.text_scoring``'s normalisation; no speech: 1.0 each), then the earlier
    sample, so that ties keep the lowest seed."""
    if transcript is None:
        wer = cer = 1.0
    else:
        e = item_errors(text, transcript)
        wer, cer = float(e["wer"]), float(e["cer"])
    return (not ended, wer, cer, k)


def choose(texts: list[str], transcripts: list[str | None], ended: list[bool], n: int) -> list[int]:
    """Per text, the index (into the candidate rows) of the candidate to keep."""
    picks = []
    for i, text in enumerate(texts):
        rows = range(i * n, (i + 1) * n)
        picks.append(min(rows, key=lambda r: rank_key(text, transcripts[r], ended[r], r - i * n)))
    return picks
