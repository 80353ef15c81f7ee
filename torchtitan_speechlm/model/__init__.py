"""The SpeechLM model: vocabulary layout, interleave patterns, backbones and the loss head."""
