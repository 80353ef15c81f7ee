"""A tiny random-init Whisper saved with save_pretrained (2 encoder layers, 32 wide, 2 s
windows): the continuous audio input's tests load it through the real loading code."""

import torch

SR, WINDOW = 16000, 32000  # the tiny encoder reads 2 s windows (max_source_positions 100)


def whisper_config(**kw):
    from transformers import WhisperConfig

    base = dict(
        vocab_size=100,
        num_mel_bins=80,
        encoder_layers=2,
        encoder_attention_heads=2,
        decoder_layers=1,
        decoder_attention_heads=2,
        d_model=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=100,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return WhisperConfig(**{**base, **kw})


def save_tiny_whisper(path, seed=0):
    from transformers import WhisperModel

    torch.manual_seed(seed)
    WhisperModel(whisper_config()).save_pretrained(str(path))
    return str(path)
