"""Shared fixtures: tiny random-init HF assets saved with save_pretrained (nothing downloaded)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torchtitan_speechlm  # noqa: E402,F401  (CPU device selection before torchtitan imports)
