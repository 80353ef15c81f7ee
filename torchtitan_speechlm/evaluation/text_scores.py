"""The sets where the model writes text: ASR (its transcript of each item's reference audio)
and dialogue (its answer to each dialogue's last turn), scored against the reference text.

No judge takes part: the text is the model's and is compared with the data's, after
``normalise_text`` (``rates``). ``score_asr`` and ``score_answers`` are ``torchtitan eval``'s
sets; ``evaluate_asr`` is the short form the benchmarks and tests read (pooled WER / CER and
a few examples) of the same scoring.
"""

from __future__ import annotations

from torchtitan_speechlm.evaluation.phase_clock import PhaseClock
from torchtitan_speechlm.evaluation.rates import item_rates, mean_of, pooled_rates
from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.generation.requests import batches_by_length
from torchtitan_speechlm.utils.progress import Progress


def score_asr(
    loaded: Loaded,
    items: list,
    cfg: DecodeConfig,
    batch: int = 8,
    progress: Progress | None = None,
) -> dict:
    """The model's transcripts of each item's reference codes, WER / CER after
    ``normalise_text`` (per item, their mean, and pooled); ``progress`` gets a line after each
    batch (items done, seconds per phase)."""
    refs = [it.text for it in items]
    return _score_text("asr", items, refs, tasks.transcribe_items, loaded, cfg, batch, progress)


def score_answers(
    loaded: Loaded,
    items: list,
    cfg: DecodeConfig,
    batch: int = 8,
    progress: Progress | None = None,
) -> dict:
    """Dialogue sets (spoken question answering and other audio-conditioned text tasks): the
    model's answer to each dialogue (its last turn, assistant text, generated from the turns
    before it) against the reference answer: WER / CER as ``score_asr``, and the share of
    answers exactly right after normalisation (``exact``)."""
    refs = [tasks.reference_answer(it) for it in items]
    out = _score_text("dialogue", items, refs, tasks.answer_items, loaded, cfg, batch, progress)
    out["exact"] = mean_of(float(r["wer"] == 0.0) for r in out["per_item"])
    return out


def evaluate_asr(loaded: Loaded, items: list, cfg: DecodeConfig, batch: int = 8) -> dict:
    """``score_asr`` in short: the pooled ``wer`` / ``cer`` (total edits over total reference
    words or characters, after ``normalise_text``), ``items`` and the first five ``examples``
    (``{ref, hyp}``)."""
    scored = score_asr(loaded, items, cfg, batch)
    return {
        "wer": scored["wer_corpus"],
        "cer": scored["cer_corpus"],
        "items": len(items),
        "examples": [{"ref": r["text"], "hyp": r["transcript"]} for r in scored["per_item"][:5]],
    }


def _score_text(task: str, items, refs, generate, loaded, cfg, batch, progress) -> dict:
    """Text the model generates per item (``generate(loaded, items, cfg)``) scored against
    ``refs``: per item, the mean, and pooled."""
    found: dict[int, str] = {}
    clock = PhaseClock(progress)
    for part in batches_by_length([_input_length(it) for it in items], batch):
        clock.working_on(len(found), len(part), len(items))
        with clock("generate"):
            found.update(zip(part, generate(loaded, [items[i] for i in part], cfg), strict=True))
        if progress is not None:
            progress.say(clock.line(len(found), len(items)))
    hyps = [found[i] for i in range(len(items))]
    per_item = []
    for it, ref, hyp in zip(items, refs, hyps, strict=True):
        wer, cer = item_rates(ref, hyp)
        per_item.append(
            {"id": it.id, "text": ref, "transcript": hyp, "wer": wer, "cer": cer, "failures": []}
        )
    corpus = pooled_rates(refs, hyps)
    return {
        "task": task,
        "items": len(items),
        "wer": mean_of(r["wer"] for r in per_item),
        "cer": mean_of(r["cer"] for r in per_item),
        "wer_corpus": corpus["wer"],
        "cer_corpus": corpus["cer"],
        "failures": [],
        "per_item": per_item,
    }


def _input_length(item) -> int:
    """An item's prompt size, for batching items of like length: its waveform or codes, or
    its dialogue turns."""
    wave = getattr(item, "wave", None)
    if wave is not None:
        return len(wave)
    codes = getattr(item, "audio_codes", None)
    if codes is not None and len(codes):
        return len(codes)
    return sum(len(getattr(t, "tokens", ())) for t in getattr(item, "turns", None) or ())
