"""The codecs ``torchtitan prepare`` fits on the corpus itself (``--fit-kmeans-codec``,
``--fit-mel-codec``, ``--fit-world-codec``): each kind's fitter, the sample rate it reads,
its default codebook size and the config keys that say a folder already holds the fit asked for.

All three quantise with ``codecs/residual_kmeans.py``, so a fit gives the same codec on any
x86 CPU; each needs enough audio for its codebooks (one vector per codec frame), and refuses
less with the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.codecs.kmeans import MODEL_TYPE as KMEANS_TYPE
from torchtitan_speechlm.codecs.kmeans import KMeansConfig, fit_kmeans_codec
from torchtitan_speechlm.codecs.mel_vocoder import MODEL_TYPE as MEL_TYPE
from torchtitan_speechlm.codecs.mel_vocoder import MelCodecConfig, fit_mel_codec
from torchtitan_speechlm.codecs.world import MODEL_TYPE as WORLD_TYPE
from torchtitan_speechlm.codecs.world import WorldConfig, fit_world_codec


@dataclass(frozen=True)
class FitSettings:
    """What a fit is asked for (prepare's flags)."""

    codebooks: int = 4
    codebook_size: int | None = None  # None: the kind's default
    seed: int = 0
    kmeans_frame_rate: float = 50.0  # the k-means codec's frames per second
    mel_stack: int = 4  # the mel codec's mel frames per codec frame


@dataclass(frozen=True)
class Fitter:
    kind: str  # the flag's word: --fit-{kind}-codec
    label: str  # how messages name it
    model_type: str
    sample_rate: int  # the audio it is fitted on and encodes
    default_size: int
    fit: Callable[[list[np.ndarray], str, FitSettings, int], str]  # (wavs, out, settings, size)
    want: Callable[[FitSettings, int], dict]  # config.json entries of this fit
    frame_rate: Callable[[FitSettings], float]

    def size(self, s: FitSettings) -> int:
        return s.codebook_size or self.default_size


def _kmeans_hop(s: FitSettings) -> int:
    return int(KMeansConfig.sample_rate / s.kmeans_frame_rate)


FITTERS: dict[str, Fitter] = {
    "kmeans": Fitter(
        "kmeans", "k-means", KMEANS_TYPE, KMeansConfig.sample_rate, 256,
        lambda wavs, out, s, size: fit_kmeans_codec(
            wavs, out, s.codebooks, size, s.seed, sample_rate=KMeansConfig.sample_rate,
            frame_rate=s.kmeans_frame_rate),
        lambda s, size: {"num_codebooks": s.codebooks, "codebook_size": size, "seed": s.seed,
                         "hop_length": _kmeans_hop(s)},
        lambda s: s.kmeans_frame_rate,
    ),
    "mel": Fitter(
        "mel", "mel", MEL_TYPE, MelCodecConfig.sample_rate, 1024,
        lambda wavs, out, s, size: fit_mel_codec(wavs, out, s.codebooks, size, s.seed,
                                                 stack=s.mel_stack),
        lambda s, size: {"num_codebooks": s.codebooks, "codebook_size": size, "seed": s.seed,
                         "stack": s.mel_stack},
        lambda s: MelCodecConfig.sample_rate / (MelCodecConfig.hop_size * s.mel_stack),
    ),
    "world": Fitter(
        "world", "WORLD", WORLD_TYPE, WorldConfig.sample_rate, 1024,
        lambda wavs, out, s, size: fit_world_codec(wavs, out, size, s.seed),
        lambda s, size: {"codebook_size": size, "seed": s.seed},
        lambda s: 1000.0 / WorldConfig.frame_ms,
    ),
}  # fmt: skip
