"""Speaker similarity with Resemblyzer's GE2E voice encoder (PyPI ``resemblyzer``).

A 3-layer LSTM d-vector model (256-d, L2-normalised) whose weights ship inside the wheel
(``resemblyzer/pretrained.pt``): small, CPU-fast and offline, which suits a judge run over every
generated utterance. Scores are the cosine of two embeddings (``SpeakerJudge.similarity``).

Installing: resemblyzer declares ``webrtcvad``, which PyPI has only as C source (a compiler and
Python headers needed); ``webrtcvad-wheels`` provides the same module prebuilt, so the eval extra
installs that and resemblyzer itself goes in with ``--no-deps`` (see the Makefile).
"""

from __future__ import annotations

import threading
import warnings

import numpy as np

from torchtitan_speechlm.judges.base import (
    JudgeError,
    SpeakerJudge,
    adapt_audio,
    register_judge,
    require,
)

PIP = "pip install webrtcvad-wheels librosa && pip install --no-deps resemblyzer==0.1.4"


@register_judge("resemblyzer")
class ResemblyzerJudge(SpeakerJudge):
    """``embed`` -> the utterance's 256-d d-vector (mean of 1.6 s partials, re-normalised).

    Resemblyzer's own preprocessing runs first (volume normalisation to -30 dBFS, webrtcvad
    trimming of long silences), so leading/trailing silence of generated audio does not count.
    """

    name = "resemblyzer"
    sample_rate = 16000  # resemblyzer.hparams.sampling_rate

    def __init__(self, device: str = "cpu"):
        require("webrtcvad", self.name, PIP)
        require("librosa", self.name, PIP)
        with warnings.catch_warnings():
            # resemblyzer imports binary_dilation from scipy.ndimage.morphology (deprecated).
            warnings.simplefilter("ignore", DeprecationWarning)
            self._lib = require("resemblyzer", self.name, PIP)
        self.device = device
        self._encoder = self._lib.VoiceEncoder(device, verbose=False)
        self._lock = threading.Lock()
        # One call now: librosa's first spectrogram imports numba and compiles (seconds), and a
        # broken install should fail when the judge is built, not on the first utterance.
        self.embed(_warmup_tone(self.sample_rate), self.sample_rate)

    def describe(self) -> str:
        return "resemblyzer 0.1.4 (GE2E d-vector, 256-d)"

    def embed(self, wav: np.ndarray, rate: int) -> np.ndarray:
        x = adapt_audio(wav, rate, self.sample_rate)
        # Already at 16 kHz: source_sr=None skips resemblyzer's own (librosa) resampling.
        x = self._lib.preprocess_wav(x, source_sr=None)
        if x.size == 0:
            raise JudgeError("resemblyzer: no speech found (the VAD trimmed the whole clip)")
        with self._lock:
            return np.asarray(self._encoder.embed_utterance(x), dtype=np.float32)


def _warmup_tone(rate: int, seconds: float = 2.0) -> np.ndarray:
    """A voiced-looking signal (harmonics of 120 Hz) that the VAD keeps."""
    t = np.arange(int(rate * seconds)) / rate
    return sum(np.sin(2 * np.pi * 120 * k * t) / k for k in range(1, 20)).astype(np.float32) * 0.1
