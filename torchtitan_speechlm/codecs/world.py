"""The light codec: WORLD's parametric vocoder (F0, spectral envelope, aperiodicity), 3 streams.

For users who need tiny and fast: no neural network at all, a decode about a hundred times
faster than real time on one CPU core. WORLD (``pyworld-prebuilt``, a prebuilt wheel of
pyworld) analyses a clip every ``frame_ms`` milliseconds into its F0 (``dio`` refined by
``stonemask``), its spectral envelope (``cheaptrick``, coded to ``envelope_dims`` mel-cepstral
coefficients) and its band aperiodicity (``d4c``); the three are one stream each:

* stream 0: log-F0 quantised uniformly between ``f0_floor`` and ``f0_ceil`` into
  ``codebook_size - 1`` steps, 0 for an unvoiced frame;
* stream 1: the normalised coded envelope, one k-means codebook;
* stream 2: the coded band aperiodicity, one k-means codebook;

both codebooks fitted on the corpus by ``torchtitan prepare --fit-world-codec DIR`` with the
exact arithmetic of ``codecs/residual_kmeans.py``. Decoding synthesises with WORLD from the
centroids. All streams share ``codebook_size`` (the vocabulary layout has one size; a stream
with fewer distinct values uses fewer of its codes).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import numpy as np

from torchtitan_speechlm.codecs import residual_kmeans
from torchtitan_speechlm.codecs.base import CodecError, config_hash, register_codec
from torchtitan_speechlm.codecs.fitted_folder import save_fitted

MODEL_TYPE = "speechlm_world"
WEIGHTS = "model.safetensors"
INSTALL = "pip install pyworld-prebuilt==0.3.6.post1"


def pyworld():
    try:
        import pyworld as pw
    except ImportError:
        raise CodecError(
            f"the WORLD codec needs pyworld: {INSTALL} (`make deps` installs it)"
        ) from None
    return pw


@dataclass(frozen=True)
class WorldConfig:
    sample_rate: int = 16000
    frame_ms: float = 40.0
    envelope_dims: int = 60
    f0_floor: float = 60.0
    f0_ceil: float = 500.0
    codebook_size: int = 1024
    seed: int = 0

    @property
    def samples_per_frame(self) -> int:
        return int(round(self.sample_rate * self.frame_ms / 1000))


def analyse(cfg: WorldConfig, wav: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(f0 [F], coded envelope [F, dims], coded aperiodicity [F, bands]) of ``wav`` padded to
    ``F = ceil(samples / samples_per_frame)`` whole frames."""
    pw = pyworld()
    spf = cfg.samples_per_frame
    frames = max(1, math.ceil(len(wav) / spf))
    x = np.zeros(frames * spf, dtype=np.float64)
    x[: len(wav)] = wav
    f0, t = pw.dio(x, cfg.sample_rate, f0_floor=cfg.f0_floor, f0_ceil=cfg.f0_ceil,
                   frame_period=cfg.frame_ms)  # fmt: skip
    f0 = pw.stonemask(x, f0, t, cfg.sample_rate)
    sp = pw.cheaptrick(x, f0, t, cfg.sample_rate)
    ap = pw.d4c(x, f0, t, cfg.sample_rate)
    env = pw.code_spectral_envelope(sp, cfg.sample_rate, cfg.envelope_dims)
    bands = pw.code_aperiodicity(ap, cfg.sample_rate)
    return f0[:frames], env[:frames], bands[:frames]


def f0_codes(cfg: WorldConfig, f0: np.ndarray) -> np.ndarray:
    lo, hi, steps = math.log(cfg.f0_floor), math.log(cfg.f0_ceil), cfg.codebook_size - 1
    voiced = f0 > 0
    q = np.rint((np.log(np.clip(f0, cfg.f0_floor, cfg.f0_ceil)) - lo) / (hi - lo) * (steps - 1))
    return np.where(voiced, q.astype(np.int64) + 1, 0)


def f0_values(cfg: WorldConfig, codes: np.ndarray) -> np.ndarray:
    lo, hi, steps = math.log(cfg.f0_floor), math.log(cfg.f0_ceil), cfg.codebook_size - 1
    f0 = np.exp(lo + (np.asarray(codes) - 1) / (steps - 1) * (hi - lo))
    return np.where(np.asarray(codes) > 0, f0, 0.0)


def fit_world_codec(wavs: list[np.ndarray], out_dir: str, codebook_size: int = 1024,
                    seed: int = 0, iters: int = 20, max_frames: int = 100_000) -> str:  # fmt: skip
    """Fit the envelope and aperiodicity codebooks on mono waveforms at 16 kHz; save the codec
    to ``out_dir`` and return it."""
    cfg = WorldConfig(codebook_size=codebook_size, seed=seed)
    parts = [analyse(cfg, w) for w in wavs if len(w)]
    env = np.concatenate([p[1] for p in parts])
    bands = np.concatenate([p[2] for p in parts])
    if env.shape[0] < codebook_size:
        raise CodecError(
            f"WORLD codec: {env.shape[0]} frames of audio ({env.shape[0] * cfg.frame_ms / 1000:.0f}"
            f" s) cannot fit {codebook_size} centroids; give more audio or a smaller "
            "--codebook-size"
        )
    pick = residual_kmeans.draw_rows(env.shape[0], max_frames, seed)
    if pick is not None:
        env, bands = env[pick], bands[pick]
    arrays = {}
    for name, x in (("envelope", env), ("aperiodicity", bands)):
        books, mean, std = residual_kmeans.fit_standardised(x, 1, codebook_size, seed, iters)
        arrays.update({f"{name}_books": books, f"{name}_mean": mean, f"{name}_std": std})
    config = dict(asdict(cfg), model_type=MODEL_TYPE, fit_frames=int(env.shape[0]))
    return save_fitted(out_dir, WEIGHTS, arrays, config)


class WorldCodec:
    """A ``codecs.base.Codec`` over WORLD (3 streams: F0, envelope, aperiodicity)."""

    name = "world"
    class_name = "WorldCodec"
    bandwidth = None
    total_streams = 3
    stream_context_frames = 2  # WORLD synthesises frame by frame with a short overlap
    stream_lookahead_frames = 1

    def __init__(self, path: str, config: dict, identity: str, device: str = "cpu",
                 num_streams: int | None = None):  # fmt: skip
        from safetensors.torch import load_file

        fields = WorldConfig.__dataclass_fields__
        self.cfg = WorldConfig(**{k: v for k, v in config.items() if k in fields})
        self.path, self.device, self.config_hash = path, device, identity
        self.w = {k: v.numpy() for k, v in load_file(os.path.join(path, WEIGHTS)).items()}
        self.num_streams = 3
        self.codebook_size = self.cfg.codebook_size
        self.sample_rate = self.cfg.sample_rate
        self.samples_per_frame = self.cfg.samples_per_frame
        self.frame_rate = self.sample_rate / self.samples_per_frame
        pyworld()  # a one-line error now, not at the first encode

    def keep_streams(self, n: int) -> None:
        if n != 3:
            raise CodecError("the WORLD codec's three streams are F0, envelope, aperiodicity: all")

    def encode(self, wavs: list[np.ndarray]) -> list[np.ndarray]:
        """Mono float waveforms at 16 kHz -> int64 ``[ceil(samples / 640), 3]``."""
        out = []
        for wav in wavs:
            if np.ndim(wav) != 1 or len(wav) == 0:
                raise ValueError("WorldCodec.encode expects non-empty 1-D (mono) waveforms")
            f0, env, bands = analyse(self.cfg, np.asarray(wav, dtype=np.float64))
            codes = [f0_codes(self.cfg, f0)]
            for name, x in (("envelope", env), ("aperiodicity", bands)):
                x = (x - self.w[f"{name}_mean"]) / self.w[f"{name}_std"]
                codes.append(residual_kmeans.encode(x, self.w[f"{name}_books"])[:, 0])
            out.append(np.stack(codes, 1).astype(np.int64))
        return out

    def parameters_of(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(f0 [F], coded envelope [F, dims], coded aperiodicity [F, bands]) of ``codes``."""
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != 3:
            raise ValueError(f"expected codes [frames, 3], got {codes.shape}")
        out = [f0_values(self.cfg, codes[:, 0])]
        for k, name in ((1, "envelope"), (2, "aperiodicity")):
            x = residual_kmeans.dequantise(codes[:, k : k + 1], self.w[f"{name}_books"])
            out.append(x * self.w[f"{name}_std"] + self.w[f"{name}_mean"])
        return out[0], out[1], out[2]

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """Codes ``[F, 3]`` -> mono float32 audio of ``F * 640`` samples."""
        pw = pyworld()
        n = len(codes) * self.samples_per_frame
        if not len(codes):
            return np.zeros(0, np.float32)
        f0, env, bands = self.parameters_of(codes)
        fft = pw.get_cheaptrick_fft_size(self.sample_rate)
        sp = pw.decode_spectral_envelope(np.ascontiguousarray(env), self.sample_rate, fft)
        ap = pw.decode_aperiodicity(np.ascontiguousarray(bands), self.sample_rate, fft)
        wav = pw.synthesize(np.ascontiguousarray(f0), sp, ap, self.sample_rate, self.cfg.frame_ms)
        return np.pad(wav[:n], (0, max(0, n - len(wav)))).astype(np.float32)


@register_codec(MODEL_TYPE)
def load_world_codec(path: str, config: dict, device: str = "cpu") -> WorldCodec:
    if not os.path.isfile(os.path.join(path, WEIGHTS)):
        raise FileNotFoundError(f"WORLD codec {path}: {WEIGHTS} not found")
    return WorldCodec(path, config, config_hash(config, path), device)
