"""The SpeechLM model: vocabulary layout, interleave patterns, backbones and the loss head."""

# the built-in backbone families register themselves
from torchtitan_speechlm.model import hf_audio_encoder, hf_backbone, native_backbone  # noqa: F401
