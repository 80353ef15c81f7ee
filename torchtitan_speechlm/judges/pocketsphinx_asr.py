"""ASR with CMU PocketSphinx (PyPI ``pocketsphinx``), whose wheel ships an en-US acoustic
model, the CMU pronouncing dictionary and a trigram LM: a judge that is always available
offline and runs in a fraction of real time on a CPU.

Its open-vocabulary accuracy is poor (a 2015 GMM model), so for a known domain it is meant to be
restricted to the domain's vocabulary: ``vocabulary`` builds a free word loop (any of the
words, in any order and number), which tests whether the words of the sentence are audible
without telling the recogniser the sentence.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

import numpy as np

from torchtitan_speechlm.judges.base import (
    ASRJudge,
    JudgeError,
    adapt_audio,
    register_judge,
    require,
)
from torchtitan_speechlm.judges.text_scoring import normalise_text

PIP = "pip install pocketsphinx==5.1.1"
SEARCH = "judge"

# Decoder settings of the restricted (grammar) search that differ from pocketsphinx's, and the
# noise floor below, were chosen on espeak-ng speech of the first 12 demo sentences (a loop over
# their 74 words): WER 0.60 with pocketsphinx's defaults, 0.48 with these settings alone, 0.41
# with the noise alone, 0.13 with both (the settings: word insertion penalty 0.65 -> 0.01, no
# lattice best-path rescoring, which also makes decoding about 3x faster). The open-vocabulary
# search keeps pocketsphinx's own settings, tuned for its LM.
GRAMMAR_OPTIONS: dict[str, object] = {"wip": 1e-2, "bestpath": False}

# White noise (rms 1e-3 of full scale, -60 dBFS, fixed seed) added before decoding: synthetic
# and generated speech has digitally silent stretches, log energies far below anything in the
# acoustic model's training data.
DITHER = 1e-3


@register_judge("pocketsphinx")
class PocketsphinxJudge(ASRJudge):
    """``transcribe`` -> lower-case words, or ``""`` when nothing was recognised.

    Options: ``vocabulary`` (words: restrict to a free loop over them), ``grammar`` (path of a
    JSGF file), neither = open vocabulary with the shipped LM; ``pronunciations`` (word ->
    CMU phones, e.g. ``{"torchtitan": "T AO R CH T AY T AH N"}``) adds words the dictionary
    lacks; ``decoder_options`` overrides pocketsphinx Config keys (e.g. ``{"beam": 1e-60}``).
    One Decoder is reused for every call (building one loads the model: about 0.1-0.3 s).
    """

    name = "pocketsphinx"
    sample_rate = 16000  # the shipped en-us model is 16 kHz

    def __init__(
        self,
        vocabulary: Iterable[str] | None = None,
        grammar: str | None = None,
        pronunciations: dict[str, str] | None = None,
        decoder_options: dict[str, object] | None = None,
    ):
        ps = require("pocketsphinx", self.name, PIP)
        if vocabulary is not None and grammar is not None:
            raise JudgeError("pocketsphinx: give vocabulary or grammar, not both")
        if grammar is not None and not os.path.isfile(grammar):
            raise JudgeError(f"pocketsphinx: grammar file {grammar!r} does not exist")
        options: dict[str, object] = {}
        if vocabulary is not None or grammar is not None:
            # lm=None skips loading the 27 MB trigram LM that the grammar replaces.
            options = {**GRAMMAR_OPTIONS, "lm": None}
        options.update(decoder_options or {})
        try:
            self._decoder = ps.Decoder(samprate=self.sample_rate, loglevel="FATAL", **options)
        except (RuntimeError, KeyError, ValueError) as e:
            raise JudgeError(f"pocketsphinx: cannot build the decoder ({e})") from e
        for word, phones in (pronunciations or {}).items():
            self._decoder.add_word(word.lower(), phones.upper(), update=True)
        self.vocabulary: list[str] | None = None
        if vocabulary is not None:
            self.vocabulary = self._check_vocabulary(vocabulary)
            self._activate(lambda d: d.add_jsgf_string(SEARCH, word_loop(self.vocabulary)))
        elif grammar is not None:
            self._activate(lambda d: d.add_jsgf_file(SEARCH, grammar))
        self.grammar = grammar
        self._lock = threading.Lock()

    def _check_vocabulary(self, vocabulary: Iterable[str]) -> list[str]:
        words = sorted({w for entry in vocabulary for w in normalise_text(str(entry)).split()})
        if not words:
            raise JudgeError("pocketsphinx: the vocabulary is empty")
        missing = [w for w in words if self._decoder.lookup_word(w) is None]
        if missing:
            raise JudgeError(
                f"pocketsphinx: {len(missing)} vocabulary word(s) not in the CMU dictionary: "
                f"{', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}. Give their "
                "phones with pronunciations={word: 'CMU PHONES'}, or drop them from the vocabulary"
            )
        return words

    def _activate(self, add) -> None:
        try:
            add(self._decoder)
            self._decoder.activate_search(SEARCH)
        except RuntimeError as e:
            raise JudgeError(f"pocketsphinx: cannot use the grammar ({e})") from e

    def describe(self) -> str:
        if self.vocabulary is not None:
            return f"pocketsphinx en-us, free loop over {len(self.vocabulary)} words"
        if self.grammar is not None:
            return f"pocketsphinx en-us, JSGF grammar {self.grammar}"
        return "pocketsphinx en-us, open vocabulary (shipped trigram LM)"

    def transcribe(self, wav: np.ndarray, rate: int) -> str:
        x = adapt_audio(wav, rate, self.sample_rate)
        pcm = to_pcm16(x + DITHER * np.random.default_rng(0).standard_normal(x.size))
        with self._lock:
            self._decoder.start_utt()
            self._decoder.process_raw(pcm, full_utt=True)
            self._decoder.end_utt()
            hyp = self._decoder.hyp()
        return " ".join(hyp.hypstr.lower().split()) if hyp is not None else ""


def to_pcm16(x: np.ndarray) -> bytes:
    """float [-1, 1] -> little-endian int16 bytes, what ``Decoder.process_raw`` reads."""
    return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def word_loop(words: list[str]) -> str:
    """JSGF for "any of these words, any number of times, in any order" (including none)."""
    alternatives = " | ".join(words)
    return f"#JSGF V1.0;\ngrammar judge;\npublic <utterance> = ( {alternatives} )* ;\n"
