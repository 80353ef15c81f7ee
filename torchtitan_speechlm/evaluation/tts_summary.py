"""A TTS set's numbers from its item records (``tts_scores``): the judges' means (WER / CER,
SIM, DNSMOS), the floors (the ASR judge on the reference and on the original recordings), the
duration ratio and end-of-speech rate, and the model's own scores under ``self``.

Set-level WER / CER are means over items (Seed-TTS-eval's figure); ``wer_corpus`` pools edits
over all reference words. A failed item counts WER / CER 1.0. Kept apart from the per-item
scoring so that the results' shape is read in one place.
"""

from __future__ import annotations

import numpy as np

from torchtitan_speechlm.evaluation.judge_setup import Judges
from torchtitan_speechlm.evaluation.rates import mean_of, pooled_rates

REFERENCE_AUDIO = "resynthesised"  # the codec's decoding of the prepared reference codes
WITH_RECORDING = "recording+resynthesised"  # also the original recordings, for some items


def _dnsmos_means(recs: list[dict], key: str) -> dict:
    names = sorted({k for r in recs if r.get(key) for k in r[key]})
    return {k: mean_of(r[key].get(k) if r.get(key) else None for r in recs) for k in names}


def _word_loop_means(recs: list[dict]) -> dict:
    """The second ASR judge's (``--judge-word-loop``) mean WERs: of the generated speech, of
    the reference's resynthesis (its floor) and of the recordings found."""
    loops = [r.get("word_loop") or {} for r in recs]
    found = [w for r, w in zip(recs, loops, strict=True) if r.get("recording")]
    return {
        "wer": mean_of(w.get("wer") for w in loops),
        "floor_wer": mean_of(w.get("reference_wer") for w in loops),
        "recording_wer": mean_of(w.get("recording_wer") for w in found) if found else None,
    }


def summarise_tts(per_item: list[dict], judges: Judges, self_acc: dict) -> dict:
    """A TTS set's numbers from its item records (a failed item counts WER/CER 1.0)."""
    refs = [r["text"] for r in per_item]
    judged = judges.asr is not None
    corpus = pooled_rates(refs, [r["transcript"] for r in per_item]) if judged else {}
    floor = pooled_rates(refs, [r["reference_transcript"] for r in per_item]) if judged else {}
    self_corpus = pooled_rates(
        refs, [r["self_transcript"] if r["frames"] else None for r in per_item]
    )
    ratios = [r["duration_ratio"] for r in per_item if r["duration_ratio"] is not None]
    gen_q, ref_q = _dnsmos_means(per_item, "dnsmos"), _dnsmos_means(per_item, "reference_dnsmos")
    found = [r for r in per_item if r.get("recording")]
    by_rec = (
        pooled_rates([r["text"] for r in found], [r["recording_transcript"] for r in found])
        if judged and found
        else {}
    )
    return {
        "task": "tts",
        "items": len(per_item),
        "judges": judges.describe(),
        "reference_audio": WITH_RECORDING if found else REFERENCE_AUDIO,
        "recordings_found": len(found),
        "wer": mean_of(r["wer"] for r in per_item) if judged else None,
        "cer": mean_of(r["cer"] for r in per_item) if judged else None,
        "wer_corpus": corpus.get("wer"),
        "cer_corpus": corpus.get("cer"),
        "sim": mean_of(r["sim"] for r in per_item),
        "sim_recording": mean_of(r.get("sim_recording") for r in found),
        "dnsmos": gen_q.get("dnsmos_ovrl"),
        "dnsmos_items": sum(1 for r in per_item if r.get("dnsmos")),
        "dnsmos_all": gen_q,
        "reference_dnsmos": ref_q.get("dnsmos_ovrl"),
        "reference_dnsmos_all": ref_q,
        "duration_ratio": {
            "median": float(np.median(ratios)) if ratios else None,
            "mean": float(np.mean(ratios)) if ratios else None,
        },
        "eos_rate": mean_of(float(r["ended"]) for r in per_item),
        "floor": {
            "wer": mean_of(r["reference_wer"] for r in per_item) if judged else None,
            "cer": mean_of(r["reference_cer"] for r in per_item) if judged else None,
            "wer_corpus": floor.get("wer"),
            "cer_corpus": floor.get("cer"),
        },
        "floor_recording": {  # the judge on the original recordings, over the items found
            "wer": mean_of(r["recording_wer"] for r in found) if judged else None,
            "cer": mean_of(r["recording_cer"] for r in found) if judged else None,
            "wer_corpus": by_rec.get("wer"),
            "cer_corpus": by_rec.get("cer"),
        },
        "word_loop": _word_loop_means(per_item) if judges.word_loop is not None else None,
        "harmonicity": {  # evaluation/harmonicity.py: sharp harmonics ~0.9, smeared ~0.6
            what: mean_of(r["harmonicity"][what] for r in per_item)
            for what in ("generated", "reference", "recording")
        },
        "self": {
            "note": "the model's own ASR of its TTS and teacher-forced token accuracy: "
            "not independent judges",
            "asr_of_tts": {
                "wer": mean_of(r["self_wer"] for r in per_item),
                "cer": mean_of(r["self_cer"] for r in per_item),
                "wer_corpus": self_corpus["wer"],
                "cer_corpus": self_corpus["cer"],
            },
            **self_acc,
        },
        "failures": [{"id": r["id"], "failure": f} for r in per_item for f in r["failures"]],
        "per_item": per_item,
    }
