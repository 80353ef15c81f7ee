"""Speaker similarity with a local transformers x-vector model (``AutoModelForAudioXVector``).

For stronger speaker models than Resemblyzer's (e.g. a WavLM/UniSpeech-SAT/wav2vec2 x-vector
fine-tuned for verification) from a folder the user downloaded: ``path`` is read with
``local_files_only``, so a judge never reaches the hub.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from torchtitan_speechlm.judges.base import (
    JudgeError,
    SpeakerJudge,
    adapt_audio,
    register_judge,
    require,
)

PIP = "pip install transformers"


def load_local_config(path: str, judge: str):
    """The folder's transformers config, or a JudgeError saying why the folder is unusable."""
    transformers = require("transformers", judge, PIP)
    if not os.path.isdir(path):
        raise JudgeError(f"{judge}: model folder {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise JudgeError(f"{judge}: {path!r} has no config.json (not a transformers model folder)")
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise JudgeError(f"{judge}: cannot read the config in {path!r}: {e}") from e


@register_judge("transformers-sv")
class TransformersSVJudge(SpeakerJudge):
    """``embed`` -> the model's ``embeddings`` output (the x-vector) for one utterance."""

    name = "transformers-sv"

    def __init__(self, path: str, device: str = "cpu"):
        transformers = require("transformers", self.name, PIP)
        torch = require("torch", self.name, "pip install torch")
        from transformers.models.auto.modeling_auto import MODEL_FOR_AUDIO_XVECTOR_MAPPING_NAMES

        config = load_local_config(path, self.name)
        if config.model_type not in MODEL_FOR_AUDIO_XVECTOR_MAPPING_NAMES:
            raise JudgeError(
                f"{self.name}: {path!r} holds a {config.model_type!r} model, not a speaker "
                "x-vector model (AutoModelForAudioXVector supports: "
                f"{', '.join(sorted(MODEL_FOR_AUDIO_XVECTOR_MAPPING_NAMES))})"
            )
        try:
            self._features = transformers.AutoFeatureExtractor.from_pretrained(
                path, local_files_only=True
            )
            self._model = transformers.AutoModelForAudioXVector.from_pretrained(
                path, local_files_only=True
            )
        except (OSError, ValueError) as e:
            raise JudgeError(f"{self.name}: cannot load {path!r}: {e}") from e
        self._model.to(device).eval()
        self._torch = torch
        self.path, self.device = path, device
        self.sample_rate = int(self._features.sampling_rate)
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"transformers-sv ({self._model.config.model_type} from {self.path})"

    def embed(self, wav: np.ndarray, rate: int) -> np.ndarray:
        x = adapt_audio(wav, rate, self.sample_rate)
        inputs = self._features(x, sampling_rate=self.sample_rate, return_tensors="pt")
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        with self._lock, self._torch.inference_mode():
            out = self._model(**inputs)
        return out.embeddings[0].float().cpu().numpy()
