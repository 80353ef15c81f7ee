"""An offline audio codec: residual k-means over log-mel frames, fitted on the corpus itself.

Neural codecs need downloaded weights; this one needs none, so a fresh offline machine can
prepare, train on and listen to speech tokens. It is deliberately simple:

* features: log-magnitude mel spectrogram (default 16 kHz, hop 320 = 50 frames/s, 80 mels),
  normalised per mel bin with the fitting corpus' mean/std;
* codes: N residual k-means codebooks of C centroids (codebook k quantises what codebooks
  0..k-1 left), fitted with k-means++ and a few Lloyd iterations on a frame subsample, with a
  seeded generator, so a fit is reproducible (same data, seed and machine => same centroids);
* decode: centroid sums -> log-mel -> linear magnitude through the pseudo-inverse of the mel
  filterbank (refined by non-negative least-squares updates) -> Griffin-Lim phase with
  ``torch.stft``/``istft`` (no torchaudio). Intelligible-ish, robotic: good enough to listen to
  what a model generates, not a substitute for Mimi/Encodec.

Saved like an HF model (``config.json`` with ``model_type: speechlm_kmeans`` plus
``model.safetensors``); registered for that model_type, so ``codecs.load_codec`` loads it.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch

from torchtitan_speechlm.codecs.base import config_hash, register_codec
from torchtitan_speechlm.utils.fileio import write_json_atomic

MODEL_TYPE = "speechlm_kmeans"
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class KMeansConfig:
    sample_rate: int = 16000
    hop_length: int = 320
    n_fft: int = 1024
    n_mels: int = 80
    num_codebooks: int = 4
    codebook_size: int = 256
    seed: int = 0
    griffin_lim_iters: int = 48


def mel_filterbank(sr: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Triangular HTK-mel filters ``[n_mels, n_fft // 2 + 1]`` from 0 Hz to Nyquist."""

    def mel(f):
        return 2595.0 * np.log10(1.0 + np.asarray(f) / 700.0)

    def hz(m):
        return 700.0 * (10.0 ** (np.asarray(m) / 2595.0) - 1.0)

    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    edges = hz(np.linspace(mel(0.0), mel(sr / 2), n_mels + 2))
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    up, down = (freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)
    return np.maximum(0.0, np.minimum(up, down)).astype(np.float32)


class LogMel:
    """``wav [samples] -> log-mel [ceil(samples / hop), n_mels]``: frame t is centred on sample
    ``t * hop`` (zero padding), so frame counts match the neural codecs' ``ceil`` convention."""

    FLOOR = 1e-4

    def __init__(self, cfg: KMeansConfig, device: str = "cpu"):
        self.cfg, self.device = cfg, device
        self.fb = torch.from_numpy(mel_filterbank(cfg.sample_rate, cfg.n_fft, cfg.n_mels)).to(
            device
        )
        self.window = torch.hann_window(cfg.n_fft, device=device)

    def stft(self, wav: torch.Tensor) -> torch.Tensor:
        return torch.stft(wav, self.cfg.n_fft, self.cfg.hop_length, window=self.window,
                          center=True, pad_mode="constant", return_complex=True)  # fmt: skip

    def __call__(self, wav) -> torch.Tensor:
        hop = self.cfg.hop_length
        x = torch.as_tensor(np.asarray(wav, dtype=np.float32), device=self.device)
        frames = math.ceil(x.numel() / hop)
        x = torch.nn.functional.pad(x, (0, frames * hop - x.numel()))
        mag = self.stft(x).abs()[:, :frames]  # [n_freq, F]
        return torch.log(torch.clamp(self.fb @ mag, min=self.FLOOR)).T  # [F, n_mels]


def _nearest(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Index of the nearest row of ``c`` for each row of ``x`` (squared Euclidean)."""
    return ((c * c).sum(1)[None] - 2.0 * x @ c.T).argmin(1)


def _kmeans(x: torch.Tensor, k: int, iters: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding (on a subsample of 32 k points) then Lloyd iterations on all of ``x``;
    a cluster that empties takes the worst-fit point."""
    sub = x[torch.randperm(x.shape[0], generator=gen)[: 32 * k]]
    centers = [sub[torch.randint(len(sub), (1,), generator=gen)].squeeze(0)]
    d2 = ((sub - centers[0]) ** 2).sum(1)
    for _ in range(1, k):
        centers.append(sub[torch.multinomial(d2 + 1e-12, 1, generator=gen)].squeeze(0))
        d2 = torch.minimum(d2, ((sub - centers[-1]) ** 2).sum(1))
    c = torch.stack(centers)
    for _ in range(iters):
        a = _nearest(x, c)
        sums = torch.zeros_like(c).index_add_(0, a, x)
        counts = torch.bincount(a, minlength=k)
        c = torch.where(counts[:, None] > 0, sums / counts.clamp(min=1)[:, None], c)
        empty = torch.nonzero(counts == 0).flatten()
        if len(empty):
            err = ((x - c[a]) ** 2).sum(1)
            c[empty] = x[err.topk(len(empty)).indices]
    return c


def fit_kmeans_codec(
    wavs: list[np.ndarray],
    out_dir: str,
    num_codebooks: int = 4,
    codebook_size: int = 256,
    seed: int = 0,
    iters: int = 20,
    max_frames: int = 60000,
    sample_rate: int = 16000,
    frame_rate: float = 50.0,
) -> str:
    """Fit on mono waveforms at ``sample_rate`` and save the codec to ``out_dir``; return it.

    At most ``max_frames`` frames (20 minutes at 50 frames/s) are used, drawn with ``seed``.
    ``frame_rate`` sets the hop (``sample_rate / frame_rate`` samples, an integer); the FFT is
    at least twice the hop so that Griffin-Lim's frames still overlap. A lower rate means
    shorter sequences for the LM (25 frames/s halves them) at some cost in detail.
    """
    from safetensors.torch import save_file

    hop = sample_rate / frame_rate
    if frame_rate <= 0 or hop != int(hop) or hop < 64:
        raise ValueError(
            f"k-means codec: frame rate {frame_rate} does not divide the sample rate "
            f"{sample_rate} into a whole hop of >= 64 samples (try 50 or 25)"
        )
    cfg = KMeansConfig(sample_rate=sample_rate, num_codebooks=num_codebooks,
                       codebook_size=codebook_size, seed=seed, hop_length=int(hop),
                       n_fft=max(KMeansConfig.n_fft, 2 * int(hop)))  # fmt: skip
    feat = LogMel(cfg)
    with torch.inference_mode():
        x = torch.cat([feat(w) for w in wavs if len(w)])
    if x.shape[0] < codebook_size:
        raise ValueError(
            f"k-means codec: {x.shape[0]} frames of audio cannot fit {codebook_size} centroids; "
            "give more audio or a smaller --codebook-size"
        )
    gen = torch.Generator().manual_seed(seed)
    if x.shape[0] > max_frames:
        x = x[torch.randperm(x.shape[0], generator=gen)[:max_frames]]
    mean, std = x.double().mean(0).float(), x.double().std(0).float().clamp(min=1e-3)
    r = (x - mean) / std
    books = []
    for _ in range(num_codebooks):
        c = _kmeans(r, codebook_size, iters, gen)
        books.append(c)
        r = r - c[_nearest(r, c)]
    tensors = {
        "centroids": torch.stack(books).contiguous(),  # [N, C, n_mels]
        "mel_mean": mean.contiguous(),
        "mel_std": std.contiguous(),
    }
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(tensors[name].numpy().tobytes())
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS))
    config = dict(asdict(cfg), model_type=MODEL_TYPE, fit_frames=int(x.shape[0]),
                  weights_sha256=digest.hexdigest()[:16])  # fmt: skip
    write_json_atomic(os.path.join(out_dir, "config.json"), config)  # last: its presence = complete
    return out_dir


class KMeansCodec:
    """A ``codecs.base.Codec`` (name, rates, streams, encode, decode)."""

    name = "kmeans"
    class_name = "KMeansCodec"
    bandwidth = None

    def __init__(self, path: str, config: dict, config_hash: str, device: str = "cpu",
                 num_streams: int | None = None):  # fmt: skip
        from safetensors.torch import load_file

        fields = KMeansConfig.__dataclass_fields__
        self.cfg = KMeansConfig(**{k: v for k, v in config.items() if k in fields})
        self.path, self.device, self.config_hash = path, device, config_hash
        w = load_file(os.path.join(path, WEIGHTS), device=device)
        self.total_streams = w["centroids"].shape[0]
        self.num_streams = int(num_streams or self.total_streams)
        self.centroids = w["centroids"][: self.num_streams]
        self.mean, self.std = w["mel_mean"], w["mel_std"]
        self.sample_rate = self.cfg.sample_rate
        self.samples_per_frame = self.cfg.hop_length
        self.frame_rate = self.sample_rate / self.samples_per_frame
        self.codebook_size = int(self.centroids.shape[1])
        self.features = LogMel(self.cfg, device)
        self._pinv = torch.linalg.pinv(self.features.fb)

    def keep_streams(self, n: int) -> None:
        self.num_streams = n
        self.centroids = self.centroids[:n]

    def encode(self, wavs: list[np.ndarray]) -> list[np.ndarray]:
        """Mono float waveforms at ``sample_rate`` -> int64 ``[ceil(samples / hop), num_streams]``."""
        out = []
        with torch.inference_mode():
            for w in wavs:
                if np.ndim(w) != 1 or len(w) == 0:
                    raise ValueError("KMeansCodec.encode expects non-empty 1-D (mono) waveforms")
                r = (self.features(w) - self.mean) / self.std
                codes = []
                for c in self.centroids:
                    a = _nearest(r, c)
                    codes.append(a)
                    r = r - c[a]
                out.append(torch.stack(codes, 1).to("cpu", torch.int64).numpy())
        return out

    def log_mel(self, codes: np.ndarray) -> torch.Tensor:
        """The quantised log-mel ``[F, n_mels]`` that ``codes`` stand for."""
        c = torch.as_tensor(np.asarray(codes), dtype=torch.long, device=self.device)
        if c.ndim != 2 or c.shape[1] != self.num_streams:
            raise ValueError(f"expected codes [frames, {self.num_streams}], got {tuple(c.shape)}")
        q = sum(self.centroids[k][c[:, k]] for k in range(self.num_streams))
        return q * self.std + self.mean

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """Codes ``[F, num_streams]`` -> mono float32 audio of ``F * samples_per_frame`` samples."""
        with torch.inference_mode():
            mel = torch.exp(self.log_mel(codes)).T  # [n_mels, F]
            fb = self.features.fb
            mag = (self._pinv @ mel).clamp(min=1e-6)
            for _ in range(10):  # non-negative least squares (multiplicative updates)
                mag = mag * (fb.T @ mel) / (fb.T @ (fb @ mag) + 1e-9)
            mag = torch.cat([mag, mag[:, -1:]], 1)  # F+1 frames <-> F * hop samples
            return griffin_lim(mag, self.features, mel.shape[1] * self.samples_per_frame,
                               self.cfg.griffin_lim_iters).cpu().numpy()  # fmt: skip


def griffin_lim(mag: torch.Tensor, feat: LogMel, length: int, iters: int,
                momentum: float = 0.99) -> torch.Tensor:  # fmt: skip
    """Fast Griffin-Lim (Perraudin et al. 2013) with a fixed-seed initial phase."""
    cfg = feat.cfg
    gen = torch.Generator().manual_seed(0)
    angles = torch.exp(2j * torch.pi * torch.rand(mag.shape, generator=gen)).to(mag.device)
    prev = torch.zeros_like(angles)

    def istft(spec):
        return torch.istft(spec, cfg.n_fft, cfg.hop_length, window=feat.window, center=True,
                           length=length)  # fmt: skip

    for _ in range(iters):
        rebuilt = feat.stft(istft(mag * angles))
        angles = rebuilt - prev * (momentum / (1 + momentum))
        angles = angles / (angles.abs() + 1e-16)
        prev = rebuilt
    return istft(mag * angles).float()


@register_codec(MODEL_TYPE)
def load_kmeans_codec(path: str, config: dict, device: str = "cpu") -> KMeansCodec:
    if not os.path.isfile(os.path.join(path, WEIGHTS)):
        raise FileNotFoundError(f"k-means codec {path}: {WEIGHTS} not found")
    return KMeansCodec(path, config, config_hash(config, path), device)


def log_mel_distance(reference: np.ndarray, test: np.ndarray, sample_rate: int = 16000) -> float:
    """Mean absolute log-mel difference in dB (80 mels, floor 80 dB below the reference peak).

    A codec-independent quality figure for round trips: 0 is identical; white noise of the
    same loudness as speech scores far higher than a faithful reconstruction.
    """
    feat = LogMel(KMeansConfig(sample_rate=sample_rate))
    n = min(len(reference), len(test))
    with torch.inference_mode():
        a, b = (
            feat(np.asarray(x[:n], dtype=np.float32)) * (20 / math.log(10))
            for x in (reference, test)
        )
    floor = a.max() - 80.0
    return float((a.clamp(min=floor) - b.clamp(min=floor)).abs().mean())
