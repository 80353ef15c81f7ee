"""ASR with a local transformers model through transformers' own ASR pipeline.

``pipeline("automatic-speech-recognition")`` already handles both families that matter here,
sequence-to-sequence (Whisper) and CTC (wav2vec2, HuBERT, ...), including their feature
extraction, decoding and long-form chunking, so this judge only loads the parts from a local
folder (``local_files_only``: nothing is downloaded) and checks that the folder is an ASR model.
"""

from __future__ import annotations

import threading

import numpy as np

from torchtitan_speechlm.judges.base import (
    ASRJudge,
    JudgeError,
    adapt_audio,
    register_judge,
    require,
)
from torchtitan_speechlm.judges.transformers_sv import PIP, load_local_config

CHUNK_SECONDS = 30  # Whisper's window; longer inputs go through the pipeline's chunking


@register_judge("transformers-asr")
class TransformersASRJudge(ASRJudge):
    """``transcribe`` -> the pipeline's text, stripped (normalise before scoring).

    Multilingual Whisper checkpoints are told to transcribe English (``language="en"``,
    ``task="transcribe"``): left to detect the language, they sometimes translate or answer in
    another language, which would count as word errors of the generated speech.
    """

    name = "transformers-asr"

    def __init__(self, path: str, device: str = "cpu"):
        transformers = require("transformers", self.name, PIP)
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CTC_MAPPING_NAMES,
            MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
        )

        config = load_local_config(path, self.name)
        kind = config.model_type
        if kind in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
            model_cls = transformers.AutoModelForSpeechSeq2Seq
        elif kind in MODEL_FOR_CTC_MAPPING_NAMES:
            model_cls = transformers.AutoModelForCTC
        else:
            raise JudgeError(
                f"{self.name}: {path!r} holds a {kind!r} model, not a speech recognition model "
                "(expected a speech-to-text or CTC model, e.g. whisper or wav2vec2)"
            )
        try:
            model = model_cls.from_pretrained(path, local_files_only=True)
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
            features = transformers.AutoFeatureExtractor.from_pretrained(
                path, local_files_only=True
            )
        except (OSError, ValueError, TypeError) as e:
            raise JudgeError(f"{self.name}: cannot load {kind!r} model from {path!r}: {e}") from e
        self._pipe = transformers.pipeline(
            "automatic-speech-recognition",
            model=model,
            tokenizer=tokenizer,
            feature_extractor=features,
            device=device,
        )
        self.generate_kwargs = _english_kwargs(model)
        self.path, self.model_type = path, kind
        self.sample_rate = int(features.sampling_rate)
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"transformers-asr ({self.model_type} from {self.path})"

    def transcribe(self, wav: np.ndarray, rate: int) -> str:
        x = adapt_audio(wav, rate, self.sample_rate)
        kwargs = {}
        if self.generate_kwargs:
            kwargs["generate_kwargs"] = dict(self.generate_kwargs)
        if x.size > CHUNK_SECONDS * self.sample_rate:
            kwargs["chunk_length_s"] = CHUNK_SECONDS
        with self._lock:
            out = self._pipe({"raw": x, "sampling_rate": self.sample_rate}, **kwargs)
        return str(out["text"]).strip()


def _english_kwargs(model) -> dict:
    """``language="en", task="transcribe"`` for a multilingual Whisper whose generation config
    knows English; nothing for English-only or CTC models (they reject a language)."""
    gen = getattr(model, "generation_config", None)
    if model.config.model_type != "whisper" or gen is None:
        return {}
    lang_to_id = getattr(gen, "lang_to_id", None) or {}
    if getattr(gen, "is_multilingual", False) and "<|en|>" in lang_to_id:
        return {"language": "en", "task": "transcribe"}
    return {}
