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
    return AutoTokenizer.from_pretrained(path, local_files_only=True, **_config_kwargs(path))


def _config_kwargs(path: str) -> dict:
    """``config=`` for AutoTokenizer when ``path`` is an exported SpeechLM folder.

    AutoTokenizer reads the folder's config.json to learn its model type. An export's says
    ``"model_type": "speechlm"`` (model/pretrained.py), which transformers does not know: its
    AutoConfig refuses it and it falls back to reading the file as a plain ``PretrainedConfig``,
    which logs "You are using a model of type `speechlm` to instantiate a model of type ``"
    on every load. The tokenizer of an export is chosen by its tokenizer_config.json
    (``tokenizer_class``), never by the model type, so handing AutoTokenizer that same plain
    config (what it falls back to) reads the same tokenizer without the mismatch."""
    import json

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return {}
    if model_type != "speechlm":  # model/pretrained.py's EXPORT_MODEL_TYPE
        return {}
    from transformers import PretrainedConfig

    return {"config": PretrainedConfig()}


def tokenizer_fingerprint(tok) -> dict:
    """Path, class, vocab size (``len(tok)``, added tokens included) and a hash of the sorted vocab."""
    return {
        "path": tok.name_or_path,
        "class": type(tok).__name__,
        "vocab_size": len(tok),
        "hash": json_hash(sorted(tok.get_vocab().items())),
    }
