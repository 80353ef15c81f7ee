"""Interleave patterns: how an audio segment of F frames x N codebooks becomes model frames.

A pattern is one class (see docs/extending.md): how many model frames a segment takes, how to
interleave codes into frames (and back), and which vocabulary each stream predicts.

- ``parallel``: frame t carries codebook n of audio frame t in stream n (F model frames).
- ``delay``: stream n is shifted right by n frames (F + N - 1 model frames, the holes filled with
  the stream's pad). Codebook n of an audio frame is then predicted after codebooks 0..n-1 of the
  same frame were seen (MusicGen / Parler / Moshi style).
- ``flatten``: every codebook serialised frame by frame into stream 0 (F x N model frames, the
  other streams always their pad), as single-stream models such as Orpheus and Llasa do. Each
  codebook keeps its own ids, so stream 0 predicts over the whole vocabulary.

Patterns apply to one audio segment at a time, so padding never crosses a segment (or, in packed
rows, a sample) boundary. They work on any array (codes, loss weights), given a per-stream fill.
"""

from __future__ import annotations

import numpy as np

from torchtitan_speechlm.utils.registry import Registry


class Pattern:
    """Base class of an interleave pattern; register a subclass with ``register_pattern``."""

    name = ""

    def num_frames(self, audio_frames, segments, num_streams: int):
        """Model frames of ``segments`` audio segments holding ``audio_frames`` in total (ints
        or numpy arrays: lengths are budgeted from the index without reading any codes)."""
        raise NotImplementedError

    def interleave(self, codes: np.ndarray, pads: np.ndarray) -> np.ndarray:
        """``codes`` [F, N] -> model frames [num_frames(F, 1, N), N]; ``pads`` [N] fills holes."""
        raise NotImplementedError

    def deinterleave(self, frames: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`interleave`: model frames -> codes [F, N]."""
        raise NotImplementedError

    def prediction_range(self, layout, k: int) -> tuple[int, int]:
        """[start, end) of the vocabulary ids stream ``k`` predicts (the head's logits slice)."""
        return layout.stream_range(k)


PATTERNS: Registry[Pattern] = Registry("interleave pattern")


def register_pattern(cls: type[Pattern]) -> type[Pattern]:
    """Class decorator: ``@register_pattern class MyPattern(Pattern): name = "mine" ...``."""
    PATTERNS.register(cls.name, cls())
    return cls


def get_pattern(name: str, key: str = "speechlm.pattern") -> Pattern:
    return PATTERNS.get(name, key)


@register_pattern
class Parallel(Pattern):
    name = "parallel"

    def num_frames(self, audio_frames, segments, num_streams):
        return audio_frames

    def interleave(self, codes, pads):
        return codes.copy()

    def deinterleave(self, frames):
        return frames.copy()


@register_pattern
class Delay(Pattern):
    name = "delay"

    def num_frames(self, audio_frames, segments, num_streams):
        return audio_frames + (num_streams - 1) * segments

    def interleave(self, codes, pads):
        n_frames, n_streams = codes.shape
        out = np.broadcast_to(
            np.asarray(pads, dtype=codes.dtype), (n_frames + n_streams - 1, n_streams)
        ).copy()
        for k in range(n_streams):
            out[k : k + n_frames, k] = codes[:, k]
        return out

    def deinterleave(self, frames):
        n_streams = frames.shape[1]
        n_frames = frames.shape[0] - (n_streams - 1)
        if n_frames <= 0:
            return frames[:0].copy()
        return np.stack([frames[k : k + n_frames, k] for k in range(n_streams)], axis=1)


@register_pattern
class Flatten(Pattern):
    name = "flatten"

    def num_frames(self, audio_frames, segments, num_streams):
        return audio_frames * num_streams

    def interleave(self, codes, pads):
        n_frames, n_streams = codes.shape
        out = np.broadcast_to(
            np.asarray(pads, dtype=codes.dtype), (n_frames * n_streams, n_streams)
        ).copy()
        out[:, 0] = codes.reshape(-1)  # frame-major: f0c0 f0c1 ... f0cN-1 f1c0 ...
        return out

    def deinterleave(self, frames):
        n_streams = frames.shape[1]
        whole = frames.shape[0] // n_streams * n_streams
        return frames[:whole, 0].reshape(-1, n_streams).copy()

    def prediction_range(self, layout, k):
        # stream 0 carries every codebook (each with its own ids); the others only their pad
        return (0, layout.size) if k == 0 else layout.stream_range(k)


def interleave(codes: np.ndarray, pads: np.ndarray, pattern: str) -> np.ndarray:
    """codes [F, N] (vocabulary ids) -> model frames; pads [N] are the streams' pads."""
    return get_pattern(pattern).interleave(codes, pads)


def deinterleave(frames: np.ndarray, pattern: str) -> np.ndarray:
    """Inverse of :func:`interleave`: model frames -> codes [F, N]."""
    return get_pattern(pattern).deinterleave(frames)
