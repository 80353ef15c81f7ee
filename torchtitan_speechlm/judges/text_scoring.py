"""The text side of ASR scoring: English normalisation, corpus WER/CER and one utterance's
word alignment (jiwer). Shared by the ASR judges, ``torchtitan eval`` and its report page."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

# Apostrophe look-alikes (typographic quotes, modifier letters, prime, grave, acute).
_APOSTROPHES = dict.fromkeys(map(ord, "\u2018\u2019\u201b\u02bc\u02b9\u2032\u0060\u00b4"), "'")
_STRAY_APOSTROPHE = re.compile(r"(?<!\w)'|'(?!\w)")


def normalise_text(text: str) -> str:
    """English text -> the form WER/CER compare, so that only word errors count.

    In order: Unicode NFKC (full-width forms, ligatures, superscript digits); lower case;
    typographic apostrophes -> ``'``; hyphens and dashes (Unicode category Pd) -> spaces; every
    other punctuation or symbol character (categories P* and S*) deleted, except ``'``;
    apostrophes kept only inside a word (``don't`` stays, ``'quoted'`` and ``dogs'`` lose
    theirs); whitespace runs collapsed to one space, ends stripped. Digits are kept as digits
    (no number spelling), so "2" and "two" differ.
    """
    text = unicodedata.normalize("NFKC", text).lower().translate(_APOSTROPHES)
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        if cat == "Pd":
            out.append(" ")
        elif ch == "'" or cat[0] not in "PS":
            out.append(ch)
    text = _STRAY_APOSTROPHE.sub("", "".join(out))
    return " ".join(text.split())


def error_rates(refs: Sequence[str], hyps: Sequence[str]) -> dict[str, float]:
    """Corpus WER and CER (jiwer) of hypotheses against references, both normalised first.

    Rates are total edits over total reference words/characters (spaces count as characters),
    not a mean of per-item rates, so long utterances weigh more. An empty hypothesis is all
    deletions (WER 1.0 for that item), never an error.
    """
    import jiwer

    refs = [normalise_text(r) for r in refs]
    hyps = [normalise_text(h) for h in hyps]
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    if not refs:
        raise ValueError("error_rates needs at least one reference")
    words = jiwer.process_words(refs, hyps)
    chars = jiwer.process_characters(refs, hyps)
    return {
        "wer": float(words.wer),
        "cer": float(chars.cer),
        "substitutions": int(words.substitutions),
        "deletions": int(words.deletions),
        "insertions": int(words.insertions),
        "ref_words": int(words.hits + words.substitutions + words.deletions),
        "items": len(refs),
    }


def item_errors(ref: str, hyp: str) -> dict:
    """One utterance: ``wer``, ``cer``, the normalised ``ref``/``hyp`` and the word alignment.

    ``ops`` is jiwer's alignment as ``(op, ref_words, hyp_words)`` chunks, op one of
    ``equal``, ``substitute``, ``delete`` (``hyp_words`` empty) or ``insert`` (``ref_words``
    empty), in order: enough to render the transcript with its errors marked.
    """
    import jiwer

    ref, hyp = normalise_text(ref), normalise_text(hyp)
    words = jiwer.process_words(ref, hyp)
    r, h = words.references[0], words.hypotheses[0]
    ops = [
        (c.type, r[c.ref_start_idx : c.ref_end_idx], h[c.hyp_start_idx : c.hyp_end_idx])
        for c in words.alignments[0]
    ]
    return {
        "wer": float(words.wer),
        "cer": float(jiwer.process_characters(ref, hyp).cer),
        "ref": ref,
        "hyp": hyp,
        "ops": ops,
    }
