"""The SpeechLM model: vocabulary layout, interleave patterns, backbones and the loss head."""

# the built-in backbone family registers itself
from torchtitan_speechlm.model import hf_backbone  # noqa: F401
