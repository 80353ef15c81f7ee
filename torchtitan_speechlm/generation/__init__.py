"""Decoding a trained model: load a checkpoint or an export (``loading``), sample with a KV cache
and masks (``sampling``, ``decode``), and the generation tasks (``tasks``: TTS to a wav, ASR to
text, continuation, spoken answers). Used by the commands and by training's samples."""
