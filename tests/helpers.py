"""Test helpers: build a SpeechLM from a tiny saved HF backbone through the real loading code."""

from __future__ import annotations

import torch

from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.hf_backbone import load_hf_config
from torchtitan_speechlm.model.model import SpeechLM
from torchtitan_speechlm.model.vocab import VocabLayout


def save_tiny_backbone(path, family="qwen3", vocab_size=96, tie=False, seed=0, **overrides):
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    common.update(overrides)
    cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    model = cls[1](cls[0](**common))
    model.save_pretrained(path)
    return model


def build_speechlm(backbone_dir, num_streams=3, codebook_size=16, tie=None, **kw) -> SpeechLM:
    hf = load_hf_config(str(backbone_dir))
    layout = VocabLayout(text_size=hf.vocab_size, num_streams=num_streams,
                         codebook_size=codebook_size)
    args = SpeechLMModelArgs(
        backbone=str(backbone_dir), hf_config=hf.to_dict(), vocab=layout.to_dict(),
        tie_embeddings=hf.tie_word_embeddings if tie is None else tie, **kw,
    )
    with torch.device("meta"):
        model = SpeechLM(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def text_only_inputs(layout: VocabLayout, text_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] text ids -> [B, T, N] frames: text in stream 0, each other stream's pad."""
    b, t = text_ids.shape
    frames = torch.empty(b, t, layout.num_streams, dtype=torch.long)
    frames[..., 0] = layout.text_offset + text_ids
    for k in range(1, layout.num_streams):
        frames[..., k] = layout.stream_pad(k)
    return frames
