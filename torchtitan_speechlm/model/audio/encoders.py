"""Audio encoders: the speech towers that turn waveforms into continuous features for the LM.

A family says how a local folder's encoder config is read, how the tower and its feature
extraction (log-mel, computed in torch on the model's device) are built and run, how many
encoder frames a waveform of ``n`` samples yields, and where its pretrained tensors are. The
folder's ``config.json`` ``model_type`` picks the family, as for codecs; ``register_audio_encoder``
adds one (docs/audio-encoder.md). The tower must expose its blocks as ``.layers`` (FSDP units
and activation checkpointing act on them) and be buildable on the meta device.

``whisper`` (``hf_audio_encoder.py``): the encoder of a transformers Whisper folder; the same
class serves any tower with Whisper's front end (30 s log-mel windows, two convolutions).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from torchtitan_speechlm.utils.registry import Registry


class AudioEncoderError(ValueError):
    """The folder holds no audio encoder this package can use, or its feature extraction does not
    fit the encoder; the message names the folder and the fix."""


class AudioEncoder:
    """Base class of an audio-encoder family; subclass it and ``register_audio_encoder``."""

    name = ""
    masks_padding = False  # run() honours a frame mask (else padding is zeroed, see AudioTower)

    # ---- config ----------------------------------------------------------------------------
    def read_config(self, path: str) -> dict:
        """The encoder's config (JSON-able, with a ``feature_extractor`` entry: sampling_rate,
        n_fft, hop_length, feature_size, n_samples) from a local folder."""
        raise NotImplementedError

    def hidden_size(self, config: dict) -> int:
        raise NotImplementedError

    def sample_rate(self, config: dict) -> int:
        return int(config["feature_extractor"]["sampling_rate"])

    def window_samples(self, config: dict) -> int:
        """The longest waveform one encoder call takes (Whisper: 30 s)."""
        return int(config["feature_extractor"]["n_samples"])

    def encoder_frames(self, config: dict, samples: torch.Tensor) -> torch.Tensor:
        """Encoder output frames computed from real audio, for waveforms of ``samples``."""
        raise NotImplementedError

    # ---- modules ---------------------------------------------------------------------------
    def build(self, config: dict) -> nn.Module:
        """The tower (``.layers`` = its blocks), on the current default device."""
        raise NotImplementedError

    def features(self, config: dict) -> nn.Module:
        """Waveforms [A, window] (float, zero past each item's end) -> the tower's input."""
        raise NotImplementedError

    def run(self, module: nn.Module, feats: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """Encoder states [A, F, D] of features ``feats``; ``frames`` [A] = real frames each."""
        raise NotImplementedError

    # ---- weights ---------------------------------------------------------------------------
    def initial_state(self, config: dict, path: str, seed: int) -> dict[str, torch.Tensor]:
        """Full tensors of the tower's parameters, by their names in ``build``'s module: the
        folder's pretrained ones, or (a folder without weights) the family's own init drawn
        from ``seed`` on CPU (the same on every rank)."""
        raise NotImplementedError


AUDIO_ENCODERS: Registry[AudioEncoder] = Registry("audio encoder model_type")


def register_audio_encoder(model_type: str, family: AudioEncoder) -> AudioEncoder:
    """Register ``family`` for folders whose config.json has this ``model_type``."""
    family.name = model_type
    return AUDIO_ENCODERS.register(model_type, family)


def get_audio_encoder(model_type: str, key: str = "audio_encoder.path") -> AudioEncoder:
    return AUDIO_ENCODERS.get(model_type, key)


def load_audio_encoder_config(path: str) -> tuple[str, dict]:
    """(model_type, config) of the audio encoder in folder ``path``; AudioEncoderError when the
    folder is missing or holds a model without a registered audio encoder."""
    p = Path(path).expanduser()
    if not path or not (p / "config.json").is_file():
        raise AudioEncoderError(
            f"audio_encoder.path = {path!r}: no config.json there. Point it at a local "
            "transformers folder with an audio encoder (e.g. a Whisper checkpoint written by "
            "`save_pretrained`)."
        )
    model_type = json.loads((p / "config.json").read_text()).get("model_type", "")
    if model_type not in AUDIO_ENCODERS:
        raise AudioEncoderError(
            f"audio_encoder.path = {path!r} holds a {model_type!r} model, which has no audio "
            f"encoder this package can use (registered: {', '.join(AUDIO_ENCODERS.names())}); "
            "point it at a speech-encoder folder, or register the family "
            "(docs/audio-encoder.md)"
        )
    config = get_audio_encoder(model_type).read_config(str(p))
    return model_type, json.loads(json.dumps(config))  # as run records and exports store it
