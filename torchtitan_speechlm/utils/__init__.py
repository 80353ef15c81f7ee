"""Helpers that know nothing of training: the registry helper, atomic file writes, audio IO, text
tokenizers, checkpoint folder names, collective-error recognition, and ``compat``: every
workaround of a torch/torchtitan limitation, each with its diff under ``patches/``. Imports no
other folder of the package."""
