"""Data that comes from a Python object instead of prepared datasets (the Python API's ESPnet
iterator adapter, or yours).

A TOML cannot name a live Python object, so the object is handed to the trainer
(``trainer.SpeechLMTrainer(job_config, external=data)``, and to the launcher's checks), which
resolves the run with it: the vocabulary layout comes from the object's codec instead of the
datasets' metadata, and the training loader and the validation sets from the object.
Everything else (model, loss, statistics, checkpoints) is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torchtitan_speechlm.model.codec_identity import CodecIdentity


class ExternalData(Protocol):
    """What a data object given to the trainer provides."""

    codec: CodecIdentity
    """What made the audio tokens (model/codec_identity.py): at least their ``num_streams``,
    ``codebook_size``, ``frame_rate`` and a ``config_hash``, as a prepared dataset records its
    codec."""

    def valid_names(self) -> list[str]:
        """Names of the validation sets, logged as ``val/{name}/*``."""

    def train_loader(
        self,
        job_config,
        layout,
        dp_rank: int,
        dp_world_size: int,
        *,
        accumulation: int,
        continuous_frames: Callable | None,
    ) -> Any:
        """A torchtitan BaseDataLoader yielding ``(input_dict, labels)`` micro-batches
        (``accumulation`` of them per optimizer step on each rank; ``continuous_frames``: LM
        frames of n waveform samples under the run's audio encoder, None without one)."""

    def valid_dataset(self, name: str, layout, *, continuous_frames: Callable | None) -> Any:
        """A fresh iterable of one validation set's micro-batches, with ``collate(unit)``
        giving an all-padding stand-in batch (see components/validate.py)."""


# Optional, looked up with getattr (an object without them works as before):
#   resolve(job_config) -> None
#       check the run against the data (raise ConfigError) before ``codec`` is read;
#   tokenizer: dict
#       its text tokenizer (utils/text_tokenizer.py's tokenizer_fingerprint), recorded with the
#       run so that eval and generate decode its text;
#   step_tokenizer(layout, pattern) -> components.step_codec.SegmentTokenizer | None
#       what tokenises the waveform segments its micro-batches carry (``step_audio*`` keys,
#       components/step_codec.py) in the training step.
