"""ESPnet's model object as ESPnet passes it to its trainer (``job_template.build_model()``).

ESPnet's ``ParallelHFModel`` is a subclass of the backbone's transformers class whose
``model.embed_tokens`` and ``lm_head`` were rebuilt for ESPnet's whole vocabulary (the
pretrained text rows copied to the text interval), with a ``stream_emb``, the ios in
``multimodal_io_dict`` (the codec inside the discrete audio io), a linear ``adaptor`` per
continuous io, and ``vocab_intervals``. Here it gives

- the backbone: the transformers class it subclasses, its config, and its weights with only the
  text rows of the embedding and head, saved as a model folder (what ``model.hf_assets_path``
  reads; our embedding and head are built for our vocabulary from it, as from any backbone);
- the vocabulary (``vocab_intervals``) and the ios: the data factories are wrapped in
  ``EspnetData`` with them, so the discrete audio io's ``encode_batch`` tokenises in the step.

What cannot be mapped is named: a continuous io's ``adaptor`` (ESPnet's projection of its Qwen
audio encoder) has no counterpart in our ``[audio_encoder]``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan_speechlm.config import ConfigError

ESPNET_ONLY_PREFIXES = ("stream_emb.", "multimodal_io_dict.", "adaptor.")
TEXT_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def is_espnet_model(obj: Any) -> bool:
    """An ESPnet SpeechLM model object (``vocab_intervals`` and ``multimodal_io_dict``)."""
    return isinstance(getattr(obj, "vocab_intervals", None), Mapping) and isinstance(
        getattr(obj, "multimodal_io_dict", None), torch.nn.Module
    )


def transformers_class(model: torch.nn.Module) -> type:
    """The transformers causal-LM class an ESPnet model subclasses."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.") and hasattr(cls, "from_pretrained"):
            return cls
    raise ConfigError(
        f"model: an ESPnet model ({type(model).__name__}) that subclasses no transformers "
        "class; pass the backbone folder (model_hf_tag) instead"
    )


def backbone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The backbone's weights: everything but ESPnet's own modules, the embedding and head cut
    back to their text rows."""
    lo, hi = (int(x) for x in model.vocab_intervals["text"][0])
    out = {}
    for name, value in model.state_dict().items():
        if name.startswith(ESPNET_ONLY_PREFIXES):
            continue
        out[name] = value[lo:hi].contiguous() if name in TEXT_ROWS else value
    return out


def save_espnet_backbone(model: torch.nn.Module, target: str) -> None:
    """Save the text LM inside an ESPnet model as a transformers folder at ``target``."""
    if "text" not in model.vocab_intervals:
        raise ConfigError(
            "model: the ESPnet model's vocabulary has no 'text' interval, so it carries no "
            "text LM rows to start from; pass the backbone folder instead"
        )
    cls = transformers_class(model)
    config = type(model.config).from_dict(model.config.to_dict())
    with torch.device("meta"):
        plain = cls(config)
    plain.save_pretrained(target, state_dict=backbone_state(model))


def espnet_model_parts(model: Any) -> tuple[dict, dict]:
    """``(vocab_intervals, ios)`` of an ESPnet model object, checked."""
    ios = dict(model.multimodal_io_dict.items())
    adaptors = list(getattr(model, "adaptor", None) or {})
    if adaptors:
        raise ConfigError(
            f"model: the ESPnet model has continuous ios {adaptors} with linear adaptors onto "
            "its audio encoder; our [audio_encoder] has its own adaptor and reads waveforms, "
            "not ESPnet's mel features: build the job with `audio_input: discrete_audio` (the "
            "audio tokenised in the step) or train that task with PreparedData"
        )
    return {k: list(v) for k, v in model.vocab_intervals.items()}, ios


def tokenizer_files_of(ios: Mapping[str, Any]) -> str:
    """The text io's tokenizer folder (``HuggingFaceTextIO.tokenizer_name``), if on disk."""
    name = str(getattr(ios.get("text"), "tokenizer_name", "") or "")
    return name if name and os.path.isdir(name) else ""
