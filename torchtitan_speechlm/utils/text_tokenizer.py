"""Text tokenizer loading and fingerprinting.

A prepared dataset stores token ids, which are only meaningful with the tokenizer that made
them; the fingerprint recorded in its metadata lets training refuse a mismatched tokenizer.
"""

from __future__ import annotations

import os

from torchtitan_speechlm.utils.fileio import json_hash


def load_text_tokenizer(path: str):
    """Load a transformers tokenizer from a local directory (never from the Hub)."""
    from transformers import AutoTokenizer

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"tokenizer directory {path} not found: pass a local directory saved with "
            "save_pretrained (tokenizer.json + tokenizer_config.json), e.g. the backbone's folder"
        )
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def tokenizer_fingerprint(tok) -> dict:
    """Path, class, vocab size (``len(tok)``, added tokens included) and a hash of the sorted vocab."""
    return {
        "path": tok.name_or_path,
        "class": type(tok).__name__,
        "vocab_size": len(tok),
        "hash": json_hash(sorted(tok.get_vocab().items())),
    }
