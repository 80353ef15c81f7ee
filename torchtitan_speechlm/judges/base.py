"""The judge interface: models that score generated speech and are *not* the model being scored.

A judge is one class registered under a name (``register_judge``), built from keyword options
(``build_judge(name, **options)``) and fed mono float32 waveforms with their sample rate; every
judge resamples and downmixes what it receives itself (``adapt_audio``), so callers never need
to know the rate a judge wants. Three kinds, one method each:

- ``ASRJudge.transcribe(wav, rate) -> str``: intelligibility (WER/CER after ``normalise_text``);
- ``SpeakerJudge.embed(wav, rate) -> np.ndarray``: speaker similarity (cosine of embeddings);
- ``QualityJudge.score(wav, rate) -> dict[str, float]``: quality predictors (e.g. DNSMOS).

Judges load from local folders or from weights their own wheel ships: nothing is downloaded.
A missing optional package is a ``JudgeError`` naming the ``pip install`` line.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np

from torchtitan_speechlm.utils.audio import resample
from torchtitan_speechlm.utils.registry import Registry

EVAL_EXTRA = "pip install 'torchtitan-speechlm[eval]'"


class JudgeError(ValueError):
    """A judge cannot be built or cannot take an input; the message says why and the fix."""


class Judge:
    kind: str = ""  # "asr", "speaker" or "quality"
    name: str = ""
    sample_rate: int = 16000  # the rate the judge's model wants; inputs are resampled to it

    def describe(self) -> str:
        """One line for tables and reports (which model, which options)."""
        return self.name


class ASRJudge(Judge):
    kind = "asr"

    def transcribe(self, wav: np.ndarray, rate: int) -> str:
        raise NotImplementedError


class SpeakerJudge(Judge):
    kind = "speaker"

    def embed(self, wav: np.ndarray, rate: int) -> np.ndarray:
        raise NotImplementedError

    def similarity(self, a: np.ndarray, b: np.ndarray) -> float:
        """Cosine similarity of two embeddings."""
        a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
        return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


class QualityJudge(Judge):
    kind = "quality"

    def score(self, wav: np.ndarray, rate: int) -> dict[str, float]:
        raise NotImplementedError


JUDGES: Registry[type[Judge]] = Registry("judge")


def register_judge(name: str, cls: type[Judge] | None = None, *, replace: bool = False):
    """Register a Judge subclass under ``name`` (usable as a decorator)."""
    return JUDGES.register(name, cls, replace=replace)


def require(module: str, judge: str, pip: str) -> ModuleType:
    """Import an optional package a judge needs, or a JudgeError with the install line.

    Judges import their heavy packages here, inside their constructors, so that importing
    ``torchtitan_speechlm.judges`` (and registering every judge) costs nothing and needs none.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise JudgeError(
            f"judge {judge!r} needs the Python package {module!r} ({e}): {EVAL_EXTRA} (or {pip})"
        ) from e


def adapt_audio(wav: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """Any waveform a caller has -> the float32 mono ``[samples]`` array at ``target_rate``.

    Generated audio reaches judges as ``[T]``, ``[T, C]`` (soundfile's layout) or ``[C, T]``
    (torch's), at the codec's rate; the channel axis is taken to be the shorter one and
    averaged. Integer PCM is scaled to [-1, 1]. Resampling is ``audio.resample`` (polyphase),
    the same filter dataset preparation uses. Empty or non-finite audio is a JudgeError: a judge
    would otherwise return a confident score for nothing.
    """
    a = np.asarray(wav)
    if np.issubdtype(a.dtype, np.integer):
        a = a.astype(np.float32) / float(-np.iinfo(a.dtype).min)
    a = a.astype(np.float32, copy=False)
    if a.ndim not in (1, 2):
        raise JudgeError(f"audio of shape {a.shape}: expected [T], [T, C] or [C, T]")
    if a.size == 0:
        raise JudgeError(f"empty audio (shape {a.shape})")
    if a.ndim == 2:
        a = a.mean(axis=int(np.argmin(a.shape)))
    if not np.isfinite(a).all():
        raise JudgeError("audio contains NaN or Inf samples")
    if int(rate) <= 0 or int(target_rate) <= 0:
        raise JudgeError(f"bad sample rate {rate} -> {target_rate}")
    out = resample(a, int(rate), int(target_rate))
    if out.size == 0:
        raise JudgeError(f"audio of {a.size} samples at {rate} Hz is empty at {target_rate} Hz")
    return np.ascontiguousarray(out, dtype=np.float32)
