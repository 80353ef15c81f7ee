"""DNSMOS (Microsoft's non-intrusive speech quality predictor) through PyPI ``speechmos``.

DNSMOS needs no reference recording, which is what generated speech lacks; its ONNX models
ship inside the ``speechmos`` wheel, so nothing is downloaded. It predicts the ITU-T P.835
ratings (signal, background, overall) and a P.808 overall rating, each on a 1-5 scale.
"""

from __future__ import annotations

import numpy as np

from torchtitan_speechlm.judges.base import (
    JudgeError,
    QualityJudge,
    adapt_audio,
    register_judge,
    require,
)

PIP = "pip install speechmos==0.0.1.1 onnxruntime librosa requests"


@register_judge("dnsmos")
class DNSMOSJudge(QualityJudge):
    """``score`` -> ``dnsmos_ovrl``, ``dnsmos_sig``, ``dnsmos_bak``, ``dnsmos_p808``.

    ``personalized=True`` uses the personalised DNSMOS model (interfering talkers count as
    noise). speechmos scores 9.01 s windows with a 1 s hop, repeating shorter clips to fill one,
    so a clip costs about one model call per second of audio beyond the first nine.
    """

    name = "dnsmos"
    sample_rate = 16000  # speechmos.dnsmos.SR: the models are 16 kHz only

    def __init__(self, personalized: bool = False):
        require("onnxruntime", self.name, PIP)
        require("librosa", self.name, PIP)
        self._dnsmos = require("speechmos.dnsmos", self.name, PIP)
        self.personalized = bool(personalized)
        # speechmos builds its ONNX sessions on the first call; 9.5 s of quiet noise is one
        # model window, so a broken install fails here, when the judge is built.
        noise = np.random.default_rng(0).standard_normal(int(9.5 * self.sample_rate)) * 1e-3
        self.score(noise.astype(np.float32), self.sample_rate)

    def describe(self) -> str:
        return f"dnsmos (speechmos 0.0.1.1{', personalized' if self.personalized else ''})"

    def score(self, wav: np.ndarray, rate: int) -> dict[str, float]:
        # speechmos rejects samples outside [-1, 1]; clipping is what writing the waveform to a
        # 16-bit file would do, so the score is that of the audio a listener would get.
        x = np.clip(adapt_audio(wav, rate, self.sample_rate), -1.0, 1.0)
        model_type = "dnsmos_personalized" if self.personalized else "dnsmos"
        try:
            out = self._dnsmos.run(x, self.sample_rate, model_type=model_type)
        except ValueError as e:
            raise JudgeError(f"dnsmos: {e}") from e
        return {
            "dnsmos_" + key.removesuffix("_mos"): float(value)
            for key, value in out.items()
            if key != "filename"
        }
