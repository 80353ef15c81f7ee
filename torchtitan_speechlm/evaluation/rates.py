"""A set's WER / CER as ``torchtitan eval`` reports them, for every kind of set (ASR, dialogue,
TTS): one item's rates, where a failure (no hypothesis) counts 1.0; rates pooled over the set,
where a failure is an empty hypothesis; and means that skip the missing values.

Both go through ``judges.text_scoring`` (``normalise_text`` first), the one place WER and CER
are computed, so that every number of a report compares the same normalised texts.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from torchtitan_speechlm.judges import error_rates, item_errors


def item_rates(ref: str, hyp: str | None) -> tuple[float, float]:
    """(WER, CER) of one item; a failure (``hyp`` None) counts 1.0."""
    if hyp is None:
        return 1.0, 1.0
    e = item_errors(ref, hyp)
    return float(e["wer"]), float(e["cer"])


def pooled_rates(refs: list[str], hyps: list[str | None]) -> dict:
    """Edits pooled over all reference words; a failure is an empty hypothesis (all deleted)."""
    rates = error_rates(refs, [h or "" for h in hyps])
    return {"wer": float(rates["wer"]), "cer": float(rates["cer"])}


def mean_of(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None; None if there is none."""
    kept = [v for v in values if v is not None]
    return float(np.mean(kept)) if kept else None
