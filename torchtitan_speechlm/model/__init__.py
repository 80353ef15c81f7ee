"""The SpeechLM model: vocabulary layout, interleave patterns, backbones (``backbones/``), the
continuous audio input (``audio/``), the loss head, and the run record and export folder formats
a model is rebuilt from."""

# the built-in backbone families and audio encoders register themselves
from torchtitan_speechlm.model.audio import hf_encoder  # noqa: F401
from torchtitan_speechlm.model.backbones import hf, native, qwen3  # noqa: F401
