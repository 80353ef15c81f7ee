"""An offline audio codec: residual k-means over log-mel frames, fitted on the corpus itself.

Neural codecs need downloaded weights; this one needs none, so a fresh offline machine can
prepare, train on and listen to speech tokens. It is deliberately simple:

* features: log-magnitude mel spectrogram (default 16 kHz, hop 320 = 50 frames/s, 80 mels),
  normalised per mel bin with the fitting corpus' mean/std;
* codes: N residual k-means codebooks of C centroids (codebook k quantises what codebooks
  0..k-1 left), fitted with k-means++ and a few Lloyd iterations on a frame subsample, with a
  seeded generator. A fit (``fit = "exact"`` in config.json, ``codecs/residual_kmeans.py``)
  computes the features in float64 and makes every decision on exact integer arithmetic, so the
  same data and seed give the same codebooks on any x86 CPU (AVX2 or AVX-512, any number of
  threads), and encoding gives the same codes; folders fitted before (float32, reproducible on
  one machine only) load and encode as they were made;
* decode: centroid sums -> log-mel -> linear magnitude through the pseudo-inverse of the mel
  filterbank (refined by non-negative least-squares updates) -> fast Griffin-Lim phase
  (``griffin_lim_iters``, ``griffin_lim_momentum``: decode-time attributes), batched over clips
  with its own frame-major STFT (no torchaudio), or streamed frame by frame
  (``KMeansStreamDecoder``). Intelligible-ish, robotic: good enough to listen to what a model
  generates, not a substitute for Mimi/Encodec.

Saved like an HF model (``config.json`` with ``model_type: speechlm_kmeans`` plus
``model.safetensors``); registered for that model_type, so ``codecs.load_codec`` loads it.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch

from torchtitan_speechlm.codecs import residual_kmeans
from torchtitan_speechlm.codecs.base import config_hash, register_codec
from torchtitan_speechlm.codecs.fitted_folder import save_fitted
from torchtitan_speechlm.codecs.streaming import ChunkedStreamDecoder

MODEL_TYPE = "speechlm_kmeans"
WEIGHTS = "model.safetensors"

# Decode-time Griffin-Lim settings, ``KMeansCodec.griffin_lim_iters`` / ``griffin_lim_momentum``
# (attributes: they are not in config.json, so they do not change the codec's config_hash).
# Chosen with benchmarks/bench_codec_decode.py (docs/generation.md, "Audio decode").
GRIFFIN_LIM_ITERS = 32
GRIFFIN_LIM_MOMENTUM = 0.99
# decode_batch groups clips into batches of at most this many spectrogram bins on a CPU (about
# 1 MB of complex64 per spectrogram): larger batches leave the cache and cost more per clip.
CPU_BATCH_BINS = 1 << 16


@dataclass(frozen=True)
class KMeansConfig:
    sample_rate: int = 16000
    hop_length: int = 320
    n_fft: int = 1024
    n_mels: int = 80
    num_codebooks: int = 4
    codebook_size: int = 256
    seed: int = 0
    # Written to config.json by every fit, so it stays in config_hash; decode does not read it
    # (``KMeansCodec.griffin_lim_iters`` is a decode-time setting, default GRIFFIN_LIM_ITERS).
    griffin_lim_iters: int = 48
    fit: str = "float32"  # "exact": codecs/residual_kmeans.py (new fits); "float32": earlier ones


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

    def __init__(self, cfg: KMeansConfig, device: str = "cpu", dtype=torch.float32):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        fb = torch.from_numpy(mel_filterbank(cfg.sample_rate, cfg.n_fft, cfg.n_mels))
        self.fb = fb.to(device=device, dtype=dtype)
        self.window = torch.hann_window(cfg.n_fft, device=device, dtype=dtype)

    def stft(self, wav: torch.Tensor) -> torch.Tensor:
        return torch.stft(wav, self.cfg.n_fft, self.cfg.hop_length, window=self.window,
                          center=True, pad_mode="constant", return_complex=True)  # fmt: skip

    def __call__(self, wav) -> torch.Tensor:
        hop = self.cfg.hop_length
        x = torch.as_tensor(np.asarray(wav), device=self.device).to(self.dtype)
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
    hop = sample_rate / frame_rate
    if frame_rate <= 0 or hop != int(hop) or hop < 64:
        raise ValueError(
            f"k-means codec: frame rate {frame_rate} does not divide the sample rate "
            f"{sample_rate} into a whole hop of >= 64 samples (try 50 or 25)"
        )
    cfg = KMeansConfig(sample_rate=sample_rate, num_codebooks=num_codebooks,
                       codebook_size=codebook_size, seed=seed, hop_length=int(hop),
                       n_fft=max(KMeansConfig.n_fft, 2 * int(hop)), fit="exact")  # fmt: skip
    feat = LogMel(cfg, dtype=torch.float64)
    with torch.inference_mode():
        x = torch.cat([feat(w) for w in wavs if len(w)]).numpy()
    if x.shape[0] < codebook_size:
        raise ValueError(
            f"k-means codec: {x.shape[0]} frames of audio cannot fit {codebook_size} centroids; "
            "give more audio or a smaller --codebook-size"
        )
    pick = residual_kmeans.draw_rows(x.shape[0], max_frames, seed)
    x = x if pick is None else x[pick]
    books, mean, std = residual_kmeans.fit_standardised(
        x, num_codebooks, codebook_size, seed, iters
    )
    arrays = {"books": books, "mel_mean": mean, "mel_std": std}  # books: [N, C, n_mels] grid units
    config = dict(asdict(cfg), model_type=MODEL_TYPE, fit_frames=int(x.shape[0]))
    return save_fitted(out_dir, WEIGHTS, arrays, config)


class KMeansCodec:
    """A ``codecs.base.Codec`` (name, rates, streams, encode, decode, decode_batch,
    stream_decoder)."""

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
        self.exact = self.cfg.fit == "exact"
        if self.exact:  # grid books (codecs/residual_kmeans.py); float32 copies to decode with
            self.books = w["books"].cpu().numpy()
            self.mean64, self.std64 = w["mel_mean"].cpu().numpy(), w["mel_std"].cpu().numpy()
            w = {"centroids": (w["books"].double() * residual_kmeans.GRID).float(),
                 "mel_mean": w["mel_mean"].float(), "mel_std": w["mel_std"].float()}  # fmt: skip
        self.total_streams = w["centroids"].shape[0]
        self.num_streams = int(num_streams or self.total_streams)
        self.centroids = w["centroids"][: self.num_streams].to(device)
        self.mean, self.std = w["mel_mean"].to(device), w["mel_std"].to(device)
        self.sample_rate = self.cfg.sample_rate
        self.samples_per_frame = self.cfg.hop_length
        self.frame_rate = self.sample_rate / self.samples_per_frame
        self.codebook_size = int(self.centroids.shape[1])
        self.features = LogMel(self.cfg, device)
        self._pinv = torch.linalg.pinv(self.features.fb)
        self.geometry = STFTFrames(self.cfg.n_fft, self.cfg.hop_length, self.features.window)
        self._phase_table = torch.zeros(0, self.geometry.n_freq, dtype=torch.complex64)
        # decode-time settings: not part of the codec's identity (config_hash)
        self.griffin_lim_iters = GRIFFIN_LIM_ITERS
        self.griffin_lim_momentum = GRIFFIN_LIM_MOMENTUM
        self.batch_bins = None if str(device).startswith("cuda") else CPU_BATCH_BINS

    def keep_streams(self, n: int) -> None:
        self.num_streams = n
        self.centroids = self.centroids[:n]

    def encode(self, wavs: list[np.ndarray]) -> list[np.ndarray]:
        """Mono float waveforms at ``sample_rate`` -> int64 ``[ceil(samples / hop), num_streams]``."""
        if self.exact:
            return self._encode_exact(wavs)
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

    def _encode_exact(self, wavs: list[np.ndarray]) -> list[np.ndarray]:
        """The same codes on any machine: float64 features, exact nearest centroids."""
        feat, books = LogMel(self.cfg, "cpu", torch.float64), self.books[: self.num_streams]
        out = []
        with torch.inference_mode():
            for w in wavs:
                if np.ndim(w) != 1 or len(w) == 0:
                    raise ValueError("KMeansCodec.encode expects non-empty 1-D (mono) waveforms")
                x = (feat(w).numpy() - self.mean64) / self.std64
                out.append(residual_kmeans.encode(x, books))
        return out

    def log_mel(self, codes: np.ndarray) -> torch.Tensor:
        """The quantised log-mel ``[F, n_mels]`` that ``codes`` stand for."""
        c = torch.as_tensor(np.asarray(codes), dtype=torch.long, device=self.device)
        if c.ndim != 2 or c.shape[1] != self.num_streams:
            raise ValueError(f"expected codes [frames, {self.num_streams}], got {tuple(c.shape)}")
        q = sum(self.centroids[k][c[:, k]] for k in range(self.num_streams))
        return q * self.std + self.mean

    def magnitude(self, codes: np.ndarray) -> torch.Tensor:
        """Linear STFT magnitudes ``[F, n_fft // 2 + 1]`` of ``codes``: mel magnitudes through the
        filterbank's pseudo-inverse, refined by 10 non-negative least-squares (multiplicative)
        updates. Each frame on its own (up to the rounding of the matrix products)."""
        mel = torch.exp(self.log_mel(codes))  # [F, n_mels]
        fb = self.features.fb  # [n_mels, n_freq]
        mag = (mel @ self._pinv.T).clamp(min=1e-6)
        target = mel @ fb
        for _ in range(10):
            mag = mag * target / ((mag @ fb.T) @ fb + 1e-9)
        return mag

    def initial_angles(self, start: int, stop: int) -> torch.Tensor:
        """Griffin-Lim's initial phases of frames ``[start, stop)``: unit complex ``[stop - start,
        n_freq]``, a fixed-seed table indexed by frame, so a clip starts from the same phases
        whether decoded alone, in a batch or streamed."""
        if stop > len(self._phase_table):
            rows = 1 << max(10, (stop - 1).bit_length())  # grows by doubling; prefixes stay
            u = np.random.default_rng(0).random((rows, self.geometry.n_freq), dtype=np.float32)
            self._phase_table = torch.polar(torch.ones(()), torch.from_numpy(2 * np.pi * u))
        return self._phase_table[start:stop].to(self.device)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """Codes ``[F, num_streams]`` -> mono float32 audio of ``F * samples_per_frame`` samples."""
        return self.decode_batch([codes])[0]

    def decode_batch(self, codes: list[np.ndarray]) -> list[np.ndarray]:
        """Several clips through batched Griffin-Lim: padded to the longest of a group, padded
        frames and samples masked out, so each output equals ``decode`` of it alone to float
        tolerance. Clips are grouped longest first into batches of at most ``batch_bins``
        spectrogram bins (on a CPU a bigger batch leaves the cache and gets slower per clip;
        ``None``: one batch)."""
        frames = [int(np.shape(c)[0]) for c in codes]
        out = [np.zeros(0, np.float32) for _ in codes]
        for c in codes:
            if np.ndim(c) != 2 or np.shape(c)[1] != self.num_streams:
                raise ValueError(f"expected codes [frames, {self.num_streams}], got {np.shape(c)}")
        order = sorted((i for i, f in enumerate(frames) if f > 0), key=lambda i: -frames[i])
        budget = self.batch_bins
        while order:
            size = 1
            if budget is None:
                size = len(order)
            else:  # the first (longest) clip sets the padded length
                per_clip = (frames[order[0]] + 1) * self.geometry.n_freq
                size = max(1, min(len(order), budget // per_clip))
            group, order = order[:size], order[size:]
            for i, wav in zip(
                group, self._griffin_lim_batch([codes[i] for i in group]), strict=True
            ):
                out[i] = wav
        return out

    def _griffin_lim_batch(self, codes: list[np.ndarray]) -> list[np.ndarray]:
        geo, hop, half = self.geometry, self.samples_per_frame, self.geometry.n_fft // 2
        frames = [len(c) for c in codes]
        with torch.inference_mode():
            # per clip: a matrix product's rounding can depend on the other rows, and fast
            # Griffin-Lim's momentum would grow such a difference over the iterations
            mags = torch.cat([self.magnitude(c) for c in codes])
            t = max(frames) + 1  # F + 1 STFT frames <-> F * hop samples (the last one repeated)
            mag = mags.new_zeros(len(codes), t, geo.n_freq)
            frame_ok = torch.zeros(len(codes), t, dtype=torch.bool, device=self.device)
            keep = torch.zeros(len(codes), (t - 1) * hop + geo.n_fft, dtype=torch.bool,
                               device=self.device)  # fmt: skip
            at = 0
            for j, f in enumerate(frames):
                mag[j, :f] = mags[at : at + f]
                mag[j, f] = mags[at + f - 1]
                frame_ok[j, : f + 1] = True
                keep[j, half : half + f * hop] = True  # samples [0, F * hop) of the clip
                at += f
            inv_env = geo.inverse_envelope(frame_ok, keep)
            angles = self.initial_angles(0, t)[None].expand(len(codes), -1, -1)
            wav, _ = griffin_lim(geo, mag, angles, inv_env, self.griffin_lim_iters,
                                 self.griffin_lim_momentum)  # fmt: skip
            wav = wav.float().cpu().numpy()
        return [np.ascontiguousarray(wav[j, half : half + f * hop]) for j, f in enumerate(frames)]

    def stream_decoder(self, lookahead_frames: int | None = None, min_block: int = 1):
        """A ``KMeansStreamDecoder`` (push codes, get the audio that is final so far) with this
        codec's Griffin-Lim settings at the time of the call."""
        return KMeansStreamDecoder(self, lookahead_frames, min_block)


class STFTFrames:
    """The codec's STFT (Hann window of ``n_fft`` samples every ``hop``), frame-major and
    batched, without centring: frame ``k`` of a signal starts at its sample ``k * hop``. Callers
    place the signal so that frame ``t`` is centred on sample ``t * hop`` of the clip."""

    def __init__(self, n_fft: int, hop: int, window: torch.Tensor):
        self.n_fft, self.hop, self.window = n_fft, hop, window
        self.n_freq = n_fft // 2 + 1
        self.overlap = math.ceil(n_fft / hop)  # hops one window spans

    def analyse(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` -> spectra ``[B, (S - n_fft) // hop + 1, n_freq]``."""
        return torch.fft.rfft(x.unfold(-1, self.n_fft, self.hop) * self.window)

    def overlap_add(self, frames: torch.Tensor) -> torch.Tensor:
        """``[B, T, n_fft]`` -> ``[B, (T - 1) * hop + n_fft]``, frame k added at ``k * hop``."""
        b, t, n = frames.shape
        r, hop = self.overlap, self.hop
        out = frames.new_zeros(b, t + r - 1, hop)
        for k in range(r):  # the k-th hop of every frame lands k hops after its start
            width = min(hop, n - k * hop)
            out[:, k : k + t, :width] += frames[:, :, k * hop : k * hop + width]
        return out.view(b, -1)[:, : (t - 1) * hop + n]

    def synthesise(self, spec: torch.Tensor) -> torch.Tensor:
        """Spectra ``[B, T, n_freq]`` -> the overlap-add of their windowed frames (not yet
        divided by the window envelope: see ``inverse_envelope``)."""
        return self.overlap_add(torch.fft.irfft(spec, self.n_fft) * self.window)

    def inverse_envelope(self, frame_ok: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``1 / sum of squared windows`` of the frames ``frame_ok [B, T]`` where ``keep [B, S]``,
        0 elsewhere: the least-squares signal of a set of frames (as ``torch.istft``), with the
        samples outside ``keep`` (before the clip, after its end) forced to 0."""
        w2 = (self.window**2).expand(*frame_ok.shape, self.n_fft)
        env = self.overlap_add(w2 * frame_ok[..., None].to(w2.dtype))
        ok = keep & (env > 1e-11)
        return torch.where(ok, 1.0 / env.clamp(min=1e-11), torch.zeros((), dtype=env.dtype))


def griffin_lim(geo: STFTFrames, mag: torch.Tensor, angles: torch.Tensor,
                inv_env: torch.Tensor, iters: int, momentum: float = 0.99,
                fixed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Griffin-Lim on frame-major magnitudes ``mag [B, T, n_freq]`` from unit phases ``angles``;
    ``momentum`` > 0 is the fast variant (Perraudin et al. 2013, torchaudio's form), 0 the
    classic one. The first ``fixed`` frames keep their phases (a stream's frames already
    played). Returns the signal ``[B, (T - 1) * hop + n_fft]`` (sample 0 = the left edge of
    frame 0's window) and the final phases."""
    c = momentum / (1.0 + momentum)
    start = fixed * geo.hop
    spec = mag * angles
    held, free_mag = spec[:, :fixed], mag[:, fixed:].to(angles.dtype)
    free, prev = angles[:, fixed:], None
    for _ in range(iters):
        rebuilt = geo.analyse((geo.synthesise(spec) * inv_env)[:, start:])
        new = torch.add(rebuilt, prev, alpha=-c) if (c and prev is not None) else rebuilt
        inv_abs = (new * new.conj()).real.add(1e-32).rsqrt_()  # 1 / |new|, 0 -> 0 below
        free = new * inv_abs.to(new.dtype)  # unit phases
        spec = free * free_mag
        if fixed:
            spec = torch.cat([held, spec], 1)
        prev = rebuilt
    angles = torch.cat([angles[:, :fixed], free], 1) if fixed else free
    return geo.synthesise(spec) * inv_env, angles


class KMeansStreamDecoder(ChunkedStreamDecoder):
    """Streaming Griffin-Lim in the manner of RTISI-LA (Zhu et al. 2007): each push runs
    ``griffin_lim_iters`` iterations on the frames that came since the last push plus
    ``lookahead_frames`` after them, with the frames before them (committed: their phases are
    final) fixed; the new frames are committed after it. A sample is returned once every frame
    overlapping it is committed (``n_fft // 2`` samples held back), so the stream is exactly the
    overlap-add of its committed frames, one signal as in a whole-clip decode, with no seams to
    cross-fade. Its phases are estimated causally, so its samples differ from ``decode``'s;
    its magnitudes agree (docs/generation.md)."""

    def __init__(self, codec: KMeansCodec, lookahead_frames: int | None = None,
                 min_block: int = 1):  # fmt: skip
        geo = codec.geometry
        hop, n = geo.hop, geo.n_fft
        look = math.ceil((n // 2 - 1) / hop) if lookahead_frames is None else lookahead_frames
        # context: the committed frames whose windows reach the first new frame's
        super().__init__(hop, codec.num_streams, context_frames=max(1, geo.overlap - 1),
                         lookahead_frames=int(look), crossfade=0, min_block=min_block,
                         holdback=n // 2)  # fmt: skip
        self.codec, self.geometry = codec, geo
        self.iters, self.momentum = codec.griffin_lim_iters, codec.griffin_lim_momentum
        self.mag = torch.zeros(0, geo.n_freq, device=codec.device)
        self.angles = torch.zeros(0, geo.n_freq, dtype=torch.complex64, device=codec.device)

    def _append(self, codes: np.ndarray) -> None:
        if len(codes):
            with torch.inference_mode():
                self.mag = torch.cat([self.mag, self.codec.magnitude(codes)])

    def _decode_window(self, start: int, block_end: int, final: bool) -> np.ndarray:
        geo, hop, half = self.geometry, self.geometry.hop, self.geometry.n_fft // 2
        with torch.inference_mode():
            mag = torch.cat([self.mag, self.mag[-1:]]) if final else self.mag
            known, have = len(mag), len(self.angles)
            angles = torch.cat([self.angles[start:], self.codec.initial_angles(have, known)])
            t = known - start
            first = start * hop - half  # the clip's sample at the window signal's sample 0
            pos = torch.arange((t - 1) * hop + geo.n_fft, device=mag.device) + first
            keep = pos >= 0
            if final:
                keep &= pos < self.frames * hop
            frame_ok = torch.ones(1, t, dtype=torch.bool, device=mag.device)
            inv_env = geo.inverse_envelope(frame_ok, keep[None])
            wav, angles = griffin_lim(geo, mag[None, start:], angles[None], inv_env, self.iters,
                                      self.momentum, fixed=self.block_end - start)  # fmt: skip
            self.angles = torch.cat([self.angles[:start], angles[0]])
            return wav[0, half : half + (block_end - start) * hop].float().cpu().numpy()


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
