"""Whisper-style audio encoders of local transformers folders: ``whisper`` (WhisperModel /
WhisperForConditionalGeneration folders: their encoder) and ``qwen2_audio`` (Qwen2-Audio's audio
tower: Whisper's encoder plus a stride-2 average pool).

Both read 30 s windows of Whisper's log-mel features. ``LogMel`` computes them in torch on the
model's device, equal to transformers' ``WhisperFeatureExtractor`` (tests/unit/model/test_audio_encoder.py):
the waveform zero-padded to the window, a centred 400-point Hann STFT every 160 samples, Slaney
mel filters, log10, clamped to 8 below the window's maximum, scaled by (x + 4) / 4. The feature
settings come from the folder's ``preprocessor_config.json`` when it has one (checked against the
encoder: mel bins, window), else from the encoder's config.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_speechlm.model.audio.encoders import (
    AudioEncoder,
    AudioEncoderError,
    register_audio_encoder,
)
from torchtitan_speechlm.model.backbones.hf import SafetensorsReader

CONV_STRIDE = 2  # Whisper's two convolutions: stride 1, then 2
PREPROCESSOR = "preprocessor_config.json"


def mel_filters(fe: dict) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] Slaney mel filters, transformers' own (WhisperFeatureExtractor)."""
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(
        num_frequency_bins=1 + fe["n_fft"] // 2,
        num_mel_filters=fe["feature_size"],
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=fe["sampling_rate"],
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(bank).float().T.contiguous()


class LogMel(nn.Module):
    """Waveforms [A, S <= window] -> Whisper log-mel [A, n_mels, window // hop] (fp32)."""

    def __init__(self, fe: dict):
        super().__init__()
        self.n_fft, self.hop, self.n_samples = fe["n_fft"], fe["hop_length"], fe["n_samples"]
        self.fe = dict(fe)
        self.register_buffer("window", torch.empty(self.n_fft), persistent=False)
        self.register_buffer(
            "mel", torch.empty(fe["feature_size"], 1 + self.n_fft // 2), persistent=False
        )
        self.reset_buffers(self.window.device)

    def reset_buffers(self, device: torch.device) -> None:
        """Buffers are in no checkpoint: recomputed after meta init (and on load)."""
        self.window = torch.hann_window(self.n_fft, device=device)
        self.mel = mel_filters(self.fe).to(device)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        wave = F.pad(wave.float(), (0, self.n_samples - wave.shape[-1]))
        stft = torch.stft(wave, self.n_fft, self.hop, window=self.window, return_complex=True)
        power = stft[..., :-1].abs() ** 2
        log = (self.mel @ power).clamp(min=1e-10).log10()
        log = torch.maximum(log, log.amax(dim=(1, 2), keepdim=True) - 8.0)
        return (log + 4.0) / 4.0


class WhisperEncoderFamily(AudioEncoder):
    """The encoder of a transformers Whisper folder (``WhisperEncoder``)."""

    prefixes = ("encoder.", "model.encoder.")  # WhisperModel, WhisperForConditionalGeneration

    def encoder_dict(self, path: str) -> dict:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, local_files_only=True).to_dict()

    def read_config(self, path: str) -> dict:
        config = self.encoder_dict(path)
        window = int(config["max_source_positions"]) * CONV_STRIDE
        fe = {
            "sampling_rate": 16000,
            "n_fft": 400,
            "hop_length": 160,
            "feature_size": int(config["num_mel_bins"]),
        }
        if (Path(path) / PREPROCESSOR).is_file():
            from transformers import WhisperFeatureExtractor

            ext = WhisperFeatureExtractor.from_pretrained(path, local_files_only=True)
            fe = {k: int(getattr(ext, k)) for k in fe}
            fe["n_samples"] = int(ext.n_samples)
        else:
            fe["n_samples"] = window * fe["hop_length"]
        where = f"audio_encoder.path = {path!r}: {PREPROCESSOR} "
        if fe["feature_size"] != int(config["num_mel_bins"]):
            raise AudioEncoderError(
                f"{where}makes {fe['feature_size']} mel bins, the encoder reads "
                f"{config['num_mel_bins']}; use the feature extractor saved with this encoder"
            )
        if fe["n_samples"] // fe["hop_length"] != window:
            raise AudioEncoderError(
                f"{where}makes windows of {fe['n_samples'] // fe['hop_length']} mel frames "
                f"({fe['n_samples']} samples at {fe['sampling_rate']} Hz), the encoder reads "
                f"{window} (max_source_positions {config['max_source_positions']}); use the "
                "feature extractor saved with this encoder"
            )
        return {**config, "feature_extractor": fe}

    def hf_config(self, config: dict):
        from transformers import AutoConfig

        d = {k: v for k, v in config.items() if k != "feature_extractor"}
        hf = AutoConfig.for_model(d.pop("model_type"), **d)
        hf._attn_implementation = "sdpa"
        return hf

    def hidden_size(self, config: dict) -> int:
        return int(config["d_model"])

    def encoder_frames(self, config: dict, samples: torch.Tensor) -> torch.Tensor:
        hop = config["feature_extractor"]["hop_length"]
        mel = (samples + hop - 1).div(hop, rounding_mode="floor")
        return (mel - 1).div(CONV_STRIDE, rounding_mode="floor") + 1

    def build(self, config: dict) -> nn.Module:
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        return WhisperEncoder(self.hf_config(config))

    def features(self, config: dict) -> nn.Module:
        return LogMel(config["feature_extractor"])

    def run(self, module: nn.Module, feats: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        return module(input_features=feats.to(module.conv1.weight.dtype)).last_hidden_state

    def initial_state(self, config: dict, path: str, seed: int) -> dict[str, torch.Tensor]:
        reader = SafetensorsReader(path) if path else None
        if not reader:
            with torch.random.fork_rng(devices=[]), torch.device("cpu"):
                torch.manual_seed(seed)
                return {k: v.detach() for k, v in self.build(config).state_dict().items()}
        out = {}
        for key in reader.keys():
            for prefix in self.prefixes:
                if key.startswith(prefix):
                    out[key[len(prefix) :]] = reader.get(key).float()
        if not out:
            raise AudioEncoderError(
                f"audio_encoder.path = {path!r}: its safetensors hold no encoder tensors (none "
                f"starts with {' or '.join(self.prefixes)})"
            )
        return out


class Qwen2AudioEncoderFamily(WhisperEncoderFamily):
    """Qwen2-Audio's audio tower (``Qwen2AudioEncoder``: Whisper's encoder, then a stride-2
    average pool), from a Qwen2-Audio folder."""

    prefixes = ("audio_tower.", "model.audio_tower.")

    def encoder_dict(self, path: str) -> dict:
        return super().encoder_dict(path)["audio_config"]

    def encoder_frames(self, config: dict, samples: torch.Tensor) -> torch.Tensor:
        enc = super().encoder_frames(config, samples)
        return ((enc - 2).div(2, rounding_mode="floor") + 1).clamp(min=0)

    def build(self, config: dict) -> nn.Module:
        from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

        return Qwen2AudioEncoder(self.hf_config(config))


register_audio_encoder("whisper", WhisperEncoderFamily())
register_audio_encoder("qwen2_audio", Qwen2AudioEncoderFamily())
