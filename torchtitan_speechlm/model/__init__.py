"""The SpeechLM model: vocabulary layout, interleave patterns, backbones (``backbones/``), the
continuous audio input (``audio/``), the loss head, and the run record and export folder formats
a model is rebuilt from. The built-in backbone families and audio encoders register when a module
that looks one up is imported (``families.py``), not with the package."""
