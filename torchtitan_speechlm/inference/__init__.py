"""After training: load a model from a checkpoint or an export (``loading``), decode with a KV
cache, sampling and masks (``sampling``, ``decode``), run tasks (``tasks``: TTS to a wav, ASR to
text, continuation), score them (``evaluate``) and the ``torchtitan generate`` / ``eval``
commands (``command``)."""
