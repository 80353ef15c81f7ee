"""Tiny random-init transformers codecs (Encodec, Mimi, DAC) for the tests and benchmarks:
16 kHz, 50 frames/s, 4 codebooks of 64 entries, calibrated so that they give varied codes.
Saved with ``save_pretrained``, loaded back through the real codec loading code."""

from __future__ import annotations

import torch


def _codec_config(kind: str):
    """Tiny configs: 16 kHz, 320 samples/frame (50 frames/s), 4 codebooks of 64 entries."""
    from transformers import DacConfig, EncodecConfig, MimiConfig

    if kind == "encodec":
        # 50 frames/s * log2(64) bits = 300 bit/s per codebook, so 1.2 kbps = 4 codebooks.
        return EncodecConfig(
            sampling_rate=16000, target_bandwidths=[0.6, 1.2], upsampling_ratios=[8, 5, 4, 2],
            hidden_size=32, num_filters=8, num_lstm_layers=1, codebook_size=64,
        )  # fmt: skip
    if kind == "mimi":
        # frame = prod(upsampling_ratios) * 2 (Mimi's downsample layer) = 320 samples.
        return MimiConfig(
            sampling_rate=16000, upsampling_ratios=[8, 5, 4], hidden_size=32, num_filters=8,
            codebook_size=64, codebook_dim=16, num_quantizers=4, num_semantic_quantizers=1,
            vector_quantization_hidden_dimension=16, upsample_groups=32, num_hidden_layers=1,
            intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        )  # fmt: skip
    if kind == "dac":
        return DacConfig(
            sampling_rate=16000, downsampling_ratios=[2, 4, 5, 8], encoder_hidden_size=8,
            decoder_hidden_size=64, n_codebooks=4, codebook_size=64, codebook_dim=8,
        )  # fmt: skip
    raise ValueError(f"unknown codec kind {kind!r}; expected encodec, mimi or dac")


def _calibration_audio(sample_rate: int, seconds: float = 2.0) -> torch.Tensor:
    """Noise and tones at several levels: something for the codebooks to spread over."""
    n = int(sample_rate * seconds)
    t = torch.arange(n) / sample_rate
    clips = [0.3 * torch.randn(n), 0.03 * torch.randn(n)]
    clips += [0.5 * torch.sin(2 * torch.pi * f * t) for f in (110.0, 440.0, 1800.0)]
    return torch.stack(clips)[:, None]


@torch.no_grad()
def _init_rvq(layers, latents: torch.Tensor, set_embed) -> None:
    """Fill each residual codebook with Gaussian vectors matching its input's mean and std.

    Encodec and Mimi initialise their Euclidean codebooks to zeros, so an untrained model maps
    every frame to code 0. Codebooks drawn from a Gaussian fitted to the (residual) latents of
    calibration audio make a random-init codec produce varied, input-dependent codes, which is
    what tests of the data path need; independent draws also avoid near-duplicate entries whose
    nearest-neighbour ties would flip with float rounding.
    """
    residual = latents
    for layer in layers:
        flat = residual.transpose(1, 2).reshape(-1, residual.shape[1])
        n = layer.codebook.codebook_size
        set_embed(layer.codebook, flat.mean(0) + flat.std(0) * torch.randn(n, flat.shape[1]))
        residual = residual - layer.decode(layer.encode(residual))


def _calibrate(model, kind: str) -> None:
    x = _calibration_audio(model.config.sampling_rate)
    if kind == "encodec":

        def set_embed(cb, v):
            cb.embed.copy_(v)
            cb.embed_avg.copy_(v)

        _init_rvq(model.quantizer.layers, model.encoder(x), set_embed)
    elif kind == "mimi":

        def set_embed(cb, v):
            cb.embed_sum.copy_(v * cb.cluster_usage[:, None])
            cb._embed = None

        latents = model.encoder(x).latents
        q = model.quantizer
        for rvq in (q.semantic_residual_vector_quantizer, q.acoustic_residual_vector_quantizer):
            z = rvq.input_proj(latents) if rvq.input_proj is not None else latents
            _init_rvq(rvq.layers, z, set_embed)
    # DAC's codebooks are nn.Embedding with a normal init: already varied.


def build_codec(out_dir: str, kind: str = "encodec", seed: int = 0) -> str:
    """Save a tiny random-init Encodec/Mimi/DAC (16 kHz, 50 frames/s, 4 x 64 codes) to ``out_dir``."""
    from transformers import DacModel, EncodecModel, MimiModel

    cls = {"encodec": EncodecModel, "mimi": MimiModel, "dac": DacModel}
    config = _codec_config(kind)
    torch.manual_seed(seed)
    model = cls[kind](config).eval()
    _calibrate(model, kind)
    model.save_pretrained(out_dir)
    return out_dir
