"""What every audio codec offers the rest of the package, and the registry of codec loaders.

A codec turns mono waveforms into integer codes ``[frames, num_streams]`` and back. Prepared
datasets record its identity (``name``, ``config_hash``, rates, streams) so that datasets made
with different codecs are never mixed. A codec folder holds a ``config.json`` whose
``model_type`` picks the loader: ``register_codec(model_type, loader)`` adds one
(docs/extending.md). Besides ``decode``, every loaded codec has ``decode_batch`` and
``stream_decoder`` (its own, or the defaults of ``codecs/streaming.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from torchtitan_speechlm.codecs.streaming import StreamDecoder
from torchtitan_speechlm.utils.fileio import json_hash
from torchtitan_speechlm.utils.registry import Registry

# Keys that change with the tool that wrote config.json, not with the codec itself.
_VOLATILE_CONFIG_KEYS = (
    "transformers_version",
    "_name_or_path",
    "_commit_hash",
    "dtype",
    "torch_dtype",
)


class CodecError(ValueError):
    """The codec directory holds a model this package cannot use; the message says why."""


@runtime_checkable
class Codec(Protocol):
    """The interface of a loaded codec (what prepare, generation and the tests use)."""

    name: str  # recorded in metadata.json (codec.name)
    path: str
    class_name: str
    sample_rate: int
    frame_rate: float
    samples_per_frame: int
    num_streams: int  # codebooks kept (``--num-streams``)
    total_streams: int  # codebooks the model has
    codebook_size: int
    config_hash: str  # identity: config and weights

    def encode(self, wavs: list[np.ndarray]) -> list[np.ndarray]:
        """Mono float32 waveforms at ``sample_rate`` -> int64 codes
        ``[ceil(samples / samples_per_frame), num_streams]`` each."""

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """int codes ``[frames, num_streams]`` -> mono float32 audio of
        ``frames * samples_per_frame`` samples."""

    def keep_streams(self, n: int) -> None:
        """Use only the first ``n`` codebooks from now on (coarse-to-fine residual codes)."""

    # Optional in a codec class: load_codec gives a codec without them the defaults of
    # codecs/streaming.py (a loop over decode; a chunked decode with overlap).
    def decode_batch(self, codes: list[np.ndarray]) -> list[np.ndarray]:
        """Several ``[frames_i, num_streams]`` code arrays -> their audio, each equal (to float
        tolerance) to ``decode`` of it alone."""

    def stream_decoder(self) -> StreamDecoder:
        """A fresh decoder for one stream: ``push(codes [f, num_streams])`` -> the samples final
        so far, ``flush()`` -> the rest; ``frames * samples_per_frame`` samples in all."""


# model_type in config.json -> loader(path, config dict, device) -> Codec
CodecLoader = Callable[[str, dict, str], Codec]
CODECS: Registry[CodecLoader] = Registry("codec model_type")


def register_codec(model_type: str, loader: CodecLoader | None = None):
    """Register a codec loader for folders whose config.json has this ``model_type``
    (usable as a decorator)."""
    return CODECS.register(model_type, loader)


def config_hash(config: dict, weights_dir: str | None = None) -> str:
    """sha256 (first 16 hex chars) of the canonical JSON of a model config dict and, given
    ``weights_dir``, of its weight files' bytes: two random-init codecs with the same config but
    other weights make different codes, and must not count as the same codec."""
    clean = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    files = []
    if weights_dir is not None:
        files = [
            os.path.join(weights_dir, n)
            for n in sorted(os.listdir(weights_dir))
            if n.endswith((".safetensors", ".bin", ".pt"))
        ]
    return json_hash(clean, files=files)
