"""transformers' neural audio codecs (Encodec, Mimi, DAC) as adapters of one Codec interface.

Each codec class has its own encode/decode signature and output layout; the rest of the package
only needs "waveform -> int codes [frames, streams]" and back. ``TransformersCodec`` holds what
they share; each subclass says how its model is loaded, encoded and decoded.

Batched encoding pads every waveform with zeros to a whole number of frames, then to the
longest in the batch. For causal codecs (Encodec, Mimi) the padding only follows the real audio,
so a clip's codes do not depend on what it was batched with; DAC uses centred convolutions, so
its last few frames can change slightly with the amount of padding.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from torchtitan_speechlm.codecs.base import CodecError, config_hash, register_codec
from torchtitan_speechlm.codecs.streaming import ChunkedStreamDecoder, default_stream_decoder


class TransformersCodec:
    """A loaded transformers codec plus the facts about it that a prepared dataset records."""

    name = ""  # config.json model_type
    model_class = ""  # transformers class name
    causal_decoder = True  # a clip's samples do not depend on the frames after it
    pad_exact_from = 16  # frames from which padding a clip leaves its samples as they are alone
    stream_lookahead_frames = 0  # frames a streaming push holds back (a non-causal decoder's)

    def __init__(self, path: str, config: dict, device: str = "cpu"):
        import transformers

        cls = getattr(transformers, self.model_class)
        self.model = cls.from_pretrained(path, local_files_only=True).to(device).eval()
        cfg = self.model.config
        if getattr(cfg, "audio_channels", 1) != 1:
            raise CodecError(
                f"{path}: only mono codecs are supported (audio_channels={cfg.audio_channels})"
            )
        self.path, self.device = path, device
        self.sample_rate = int(cfg.sampling_rate)
        self.codebook_size = int(cfg.codebook_size)
        self.samples_per_frame = int(self.frame_samples(cfg))
        self.frame_rate = cfg.sampling_rate / self.samples_per_frame
        self.total_streams = self.num_streams = int(self.codebooks(cfg))
        self.config_hash = config_hash(config, path)

    @property
    def class_name(self) -> str:
        return type(self.model).__name__

    # ---- per model -------------------------------------------------------------------------
    def frame_samples(self, cfg) -> int:
        return cfg.hop_length

    def codebooks(self, cfg) -> int:
        raise NotImplementedError

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 1, samples] -> codes [B, >= num_streams, frames]."""
        raise NotImplementedError

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [1, N, frames] -> audio."""
        raise NotImplementedError

    # ---- the Codec interface ---------------------------------------------------------------
    def keep_streams(self, n: int) -> None:
        self.num_streams = n

    def encode(self, wavs: list[np.ndarray]) -> list[np.ndarray]:
        if not wavs:
            return []
        spf = self.samples_per_frame
        frames = [math.ceil(len(w) / spf) for w in wavs]
        if any(w.ndim != 1 for w in wavs) or min(frames) == 0:
            raise ValueError("Codec.encode expects non-empty 1-D (mono) waveforms")
        batch = np.zeros((len(wavs), 1, max(frames) * spf), dtype=np.float32)
        for i, w in enumerate(wavs):
            batch[i, 0, : len(w)] = w
        with torch.inference_mode():
            codes = self._encode(torch.from_numpy(batch).to(self.device))
        codes = codes[:, : self.num_streams].transpose(1, 2).to("cpu", torch.int64).numpy()
        if codes.shape[1] < max(frames):
            raise RuntimeError(
                f"{self.path}: codec returned {codes.shape[1]} frames for {max(frames)} expected; "
                "samples_per_frame does not match the model"
            )
        return [np.ascontiguousarray(codes[i, :f]) for i, f in enumerate(frames)]

    def decode(self, codes: np.ndarray) -> np.ndarray:
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != self.num_streams:
            raise ValueError(f"expected codes [frames, {self.num_streams}], got {codes.shape}")
        c = torch.as_tensor(codes, dtype=torch.long, device=self.device).T[None]  # [1, N, T]
        with torch.inference_mode():
            audio = self._decode(c)
        n = codes.shape[0] * self.samples_per_frame
        audio = audio.reshape(-1)[:n].float().cpu().numpy()
        return np.pad(audio, (0, n - len(audio)))  # DAC's decoder can come up a few samples short

    def decode_batch(self, codes: list[np.ndarray]) -> list[np.ndarray]:
        """One model call for the clips padded (with code 0) to the longest, each output cut to
        its ``frames * samples_per_frame``. A causal decoder (Encodec, Mimi) gives each clip the
        samples it gives alone, except a clip shorter than ``pad_exact_from`` frames (Encodec's
        first convolution reflect-pads a short input differently); those, and every clip of a
        non-causal decoder (DAC: padding would reach a clip's last samples), are batched only
        with clips of their own length."""
        arrays = [np.asarray(c) for c in codes]
        for c in arrays:
            if c.ndim != 2 or c.shape[1] != self.num_streams:
                raise ValueError(f"expected codes [frames, {self.num_streams}], got {c.shape}")
        out = [np.zeros(0, np.float32) for _ in arrays]
        todo = [i for i, c in enumerate(arrays) if len(c)]
        short = self.pad_exact_from if self.causal_decoder else math.inf
        padded = [i for i in todo if len(arrays[i]) >= short]
        alike = [i for i in todo if len(arrays[i]) < short]
        groups = [padded] + [[i for i in alike if len(arrays[i]) == n]
                             for n in sorted({len(arrays[i]) for i in alike})]  # fmt: skip
        spf = self.samples_per_frame
        for group in filter(None, groups):
            longest = max(len(arrays[i]) for i in group)
            batch = np.zeros((len(group), self.num_streams, longest), np.int64)
            for j, i in enumerate(group):
                batch[j, :, : len(arrays[i])] = arrays[i].T
            with torch.inference_mode():
                audio = self._decode(torch.from_numpy(batch).to(self.device))
            audio = audio.reshape(len(group), -1).float().cpu().numpy()
            for j, i in enumerate(group):
                n = len(arrays[i]) * spf
                out[i] = np.pad(audio[j, :n], (0, max(0, n - audio.shape[1])))
        return out

    def stream_decoder(self, context_frames: int | None = None,
                       lookahead_frames: int | None = None) -> ChunkedStreamDecoder:  # fmt: skip
        """Chunked decode with overlap (``codecs/streaming.py``): transformers' codecs carry no
        decoder state between calls (Mimi's has a cache for its transformer, not for its
        convolutions), so each push re-decodes ``stream_context_frames`` frames before the new
        ones; ``stream_lookahead_frames`` are held back for a non-causal decoder."""
        return default_stream_decoder(self, context_frames, lookahead_frames)


class Encodec(TransformersCodec):
    """Run at the lowest configured bandwidth that gives the codebooks kept: all of them (its
    highest bandwidth) by default; with ``keep_streams(K)``, the smallest of
    ``config.target_bandwidths`` giving at least K codebooks (e.g. 6 kbps = 8 codebooks for
    ``encodec_24khz`` with K = 8), so the quantiser stops there instead of computing 32
    codebooks to keep 8. Residual quantisers go coarse to fine, so the first K codes are the
    same at every bandwidth giving K or more; the extra codebooks of a bandwidth that gives
    more than K are dropped (``bandwidth_note`` says so)."""

    name, model_class = "encodec", "EncodecModel"

    def __init__(self, path: str, config: dict, device: str = "cpu"):
        if config.get("chunk_length_s") is not None or config.get("normalize"):
            raise CodecError(
                f"{path}: Encodec models with chunking or normalize=True (e.g. encodec_48khz) need "
                "per-chunk scales that integer codes cannot carry; use a 24 kHz-style Encodec"
            )
        super().__init__(path, config, device)

    def codebooks(self, cfg) -> int:
        self.bandwidth = max(cfg.target_bandwidths)
        self.bandwidth_note = ""
        return self.model.quantizer.get_num_quantizers_for_bandwidth(self.bandwidth)

    def keep_streams(self, n: int) -> None:
        q = self.model.quantizer
        options = sorted(
            (q.get_num_quantizers_for_bandwidth(b), b) for b in self.model.config.target_bandwidths
        )
        count, self.bandwidth = next((c, b) for c, b in options if c >= n)
        self.num_streams = n
        self.bandwidth_note = (
            f"encodec: encoding at {self.bandwidth:g} kbps ({count} codebooks)"
            + ("" if count == n else f", keeping the first {n}: no target bandwidth gives {n}")
        )

    def _encode(self, x):
        out = self.model.encode(x, return_dict=True, bandwidth=self.bandwidth)
        return out.audio_codes[0]  # [chunks=1, B, N, T] -> [B, N, T]

    def _decode(self, codes):
        return self.model.decode(codes[None], [None], return_dict=True).audio_values


class Mimi(TransformersCodec):
    name, model_class = "mimi", "MimiModel"

    def frame_samples(self, cfg) -> int:
        return round(cfg.sampling_rate / cfg.frame_rate)

    def codebooks(self, cfg) -> int:
        return cfg.num_quantizers

    def _encode(self, x):
        return self.model.encode(x, return_dict=True, num_quantizers=self.num_streams).audio_codes

    def _decode(self, codes):
        return self.model.decode(codes, return_dict=True).audio_values


class DAC(TransformersCodec):
    name, model_class = "dac", "DacModel"
    causal_decoder = False  # centred convolutions: each sample also hears frames after it
    # the decoder's reach into later frames: kernel 7 at the latent rate, then dilated units
    stream_lookahead_frames = 4

    def codebooks(self, cfg) -> int:
        return cfg.n_codebooks

    def _encode(self, x):
        return self.model.encode(x, return_dict=True, n_quantizers=self.num_streams).audio_codes

    def _decode(self, codes):
        return self.model.decode(audio_codes=codes, return_dict=True).audio_values


for _cls in (Encodec, Mimi, DAC):
    register_codec(_cls.name, _cls)
