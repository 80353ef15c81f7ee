"""A uniform wrapper around the transformers neural audio codecs (Encodec, Mimi, DAC).

Each codec class has its own encode/decode signature and output layout; training only needs
"waveform -> int codes [frames, streams]" and back. :class:`Codec` hides the differences and
records the identity of the codec (``config_hash``) so prepared datasets can be checked for
compatibility before they are mixed or trained on.

Batched encoding pads every waveform with zeros to a whole number of frames, then to the
longest in the batch. For causal codecs (Encodec, Mimi) the padding only follows the real audio,
so a clip's codes do not depend on what it was batched with; DAC uses centred convolutions, so
its last few frames can change slightly with the amount of padding.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from torchtitan_speechlm.codecs.kmeans import MODEL_TYPE as KMEANS_MODEL_TYPE
from torchtitan_speechlm.codecs.kmeans import load_kmeans_codec

SUPPORTED_CODECS = ("encodec", "mimi", "dac")

# Keys that change with the tool that wrote config.json, not with the codec itself.
_VOLATILE_CONFIG_KEYS = (
    "transformers_version",
    "_name_or_path",
    "_commit_hash",
    "dtype",
    "torch_dtype",
)


class CodecError(ValueError):
    """The codec directory holds a model this wrapper cannot use; the message says why."""


def config_hash(config: dict, weights_dir: str | None = None) -> str:
    """sha256 (first 16 hex chars) of the canonical JSON of a model config dict and, given
    ``weights_dir``, of its weight files' bytes: two random-init codecs with the same config but
    other weights make different codes, and must not count as the same codec."""
    clean = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(clean, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    h = hashlib.sha256(blob.encode())
    if weights_dir is not None:
        for name in sorted(os.listdir(weights_dir)):
            if name.endswith((".safetensors", ".bin", ".pt")):
                with open(os.path.join(weights_dir, name), "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 22), b""):
                        h.update(chunk)
    return h.hexdigest()[:16]


@dataclass
class Codec:
    """A loaded codec plus the facts about it that a prepared dataset records."""

    name: str
    path: str
    model: torch.nn.Module = field(repr=False)
    device: str
    sample_rate: int
    frame_rate: float
    num_streams: int
    codebook_size: int
    config_hash: str
    samples_per_frame: int
    bandwidth: float | None = None  # Encodec only
    total_streams: int = 0  # codebooks the model has; num_streams may keep fewer

    @property
    def class_name(self) -> str:
        return type(self.model).__name__

    def encode(self, wavs: list[np.ndarray]) -> list[np.ndarray]:
        """Encode mono float waveforms (at ``sample_rate``) in one batch.

        Returns one int64 array ``[frames, num_streams]`` per input, where
        ``frames = ceil(samples / samples_per_frame)``.
        """
        if not wavs:
            return []
        spf = self.samples_per_frame
        frames = [math.ceil(len(w) / spf) for w in wavs]
        if any(w.ndim != 1 for w in wavs) or min(frames) == 0:
            raise ValueError("Codec.encode expects non-empty 1-D (mono) waveforms")
        batch = np.zeros((len(wavs), 1, max(frames) * spf), dtype=np.float32)
        for i, w in enumerate(wavs):
            batch[i, 0, : len(w)] = w
        x = torch.from_numpy(batch).to(self.device)
        kwargs = {
            "encodec": {"bandwidth": self.bandwidth},
            "mimi": {"num_quantizers": self.num_streams},
            "dac": {"n_quantizers": self.num_streams},
        }[self.name]
        with torch.inference_mode():
            codes = self.model.encode(x, return_dict=True, **kwargs).audio_codes
        if self.name == "encodec":
            codes = codes[0]  # [chunks=1, B, N, T] -> [B, N, T]
        codes = codes[:, : self.num_streams].transpose(1, 2).to("cpu", torch.int64).numpy()
        if codes.shape[1] < max(frames):
            raise RuntimeError(
                f"{self.path}: codec returned {codes.shape[1]} frames for {max(frames)} expected; "
                "samples_per_frame does not match the model"
            )
        return [np.ascontiguousarray(codes[i, :f]) for i, f in enumerate(frames)]

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """Decode int codes ``[frames, num_streams]`` to mono float32 audio of ``frames * samples_per_frame``."""
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != self.num_streams:
            raise ValueError(f"expected codes [frames, {self.num_streams}], got {codes.shape}")
        c = torch.as_tensor(codes, dtype=torch.long, device=self.device).T[None]  # [1, N, T]
        with torch.inference_mode():
            if self.name == "encodec":
                audio = self.model.decode(c[None], [None], return_dict=True).audio_values
            elif self.name == "mimi":
                audio = self.model.decode(c, return_dict=True).audio_values
            else:
                audio = self.model.decode(audio_codes=c, return_dict=True).audio_values
        n = codes.shape[0] * self.samples_per_frame
        audio = audio.reshape(-1)[:n].float().cpu().numpy()
        return np.pad(audio, (0, n - len(audio)))  # DAC's decoder can come up a few samples short


def _codec_classes() -> dict:
    from transformers import DacModel, EncodecModel, MimiModel

    return {"encodec": EncodecModel, "mimi": MimiModel, "dac": DacModel}


def load_codec(path: str, device: str = "cpu", num_streams: int | None = None):
    """Load an Encodec, Mimi or DAC model, or a k-means codec (:mod:`.kmeans_codec`), from a
    local directory (config.json + safetensors).

    Encodec is run at its highest configured bandwidth, i.e. with every codebook it has
    (``config.num_quantizers``); Mimi and DAC also use all their codebooks. ``num_streams=K``
    keeps only the first K codebooks (residual quantisers are coarse-to-fine, so this is a
    lower-bitrate version of the same codec, e.g. Moshi's 8 of Mimi's 32).
    """
    path = os.path.abspath(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(
            f"codec directory {path} not found or has no config.json: pass a local directory "
            "holding a transformers codec saved with save_pretrained (EncodecModel, MimiModel or "
            "DacModel), e.g. one downloaded beforehand with `hf download`"
        )
    with open(cfg_file) as f:
        raw_config = json.load(f)
    name = raw_config.get("model_type")
    if name == KMEANS_MODEL_TYPE:
        codec = load_kmeans_codec(path, raw_config, config_hash(raw_config, path), device)
        return _keep_streams(codec, num_streams, path)
    if name not in SUPPORTED_CODECS:
        raise CodecError(
            f"{path}: unsupported codec model_type {name!r}; supported: "
            f"{', '.join(SUPPORTED_CODECS + (KMEANS_MODEL_TYPE,))}"
        )
    model = _codec_classes()[name].from_pretrained(path, local_files_only=True)
    model = model.to(device).eval()
    cfg = model.config
    if getattr(cfg, "audio_channels", 1) != 1:
        raise CodecError(
            f"{path}: only mono codecs are supported (audio_channels={cfg.audio_channels})"
        )
    bandwidth = None
    if name == "encodec":
        if cfg.chunk_length_s is not None or cfg.normalize:
            raise CodecError(
                f"{path}: Encodec models with chunking or normalize=True (e.g. encodec_48khz) need "
                "per-chunk scales that integer codes cannot carry; use a 24 kHz-style Encodec"
            )
        bandwidth = max(cfg.target_bandwidths)
        total = model.quantizer.get_num_quantizers_for_bandwidth(bandwidth)
        samples_per_frame = cfg.hop_length
    elif name == "mimi":
        total = cfg.num_quantizers
        samples_per_frame = round(cfg.sampling_rate / cfg.frame_rate)
    else:
        total = cfg.n_codebooks
        samples_per_frame = cfg.hop_length
    codec = Codec(
        name=name,
        path=path,
        model=model,
        device=device,
        sample_rate=int(cfg.sampling_rate),
        frame_rate=cfg.sampling_rate / samples_per_frame,
        num_streams=int(total),
        codebook_size=int(cfg.codebook_size),
        config_hash=config_hash(raw_config, path),
        samples_per_frame=int(samples_per_frame),
        bandwidth=bandwidth,
    )
    return _keep_streams(codec, num_streams, path)


def _keep_streams(codec, num_streams: int | None, path: str):
    """Restrict a loaded codec to its first ``num_streams`` codebooks (``total_streams`` keeps
    the full count for the record)."""
    total = getattr(codec, "total_streams", 0) or codec.num_streams
    codec.total_streams = total
    if num_streams is None:
        return codec
    if not 1 <= num_streams <= total:
        raise CodecError(
            f"{path}: num_streams must be in 1..{total} (the codec's codebooks), got {num_streams}"
        )
    if codec.name == "kmeans":
        codec.centroids = codec.centroids[:num_streams]
    codec.num_streams = int(num_streams)
    return codec
