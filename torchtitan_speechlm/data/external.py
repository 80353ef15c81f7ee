"""Data that comes from a Python object instead of prepared datasets (the Python API's ESPnet
iterator adapter, or yours).

torchtitan's Trainer builds the data loader and validator from the job config alone, and a
TOML cannot name a live Python object. So the object is attached to the job config
(``attach_external_data``) before the Trainer is built, and the three places that otherwise
read ``[speechlm_data]`` ask ``external_data(job_config)`` first: the run context (vocabulary
layout from the object's codec instead of the datasets' metadata), the training loader and the
validator. Everything else (model, loss, statistics, checkpoints) is unchanged.
"""

from __future__ import annotations

from typing import Any, Protocol

_ATTR = "_speechlm_external_data"


class ExternalData(Protocol):
    """What a data object attached to a job config provides."""

    codec: dict
    """``num_streams``, ``codebook_size`` and ``frame_rate`` of the audio tokens (as a
    prepared dataset's metadata.json ``codec`` entry)."""

    def valid_names(self) -> list[str]:
        """Names of the validation sets, logged as ``val/{name}/*``."""

    def train_loader(self, job_config, layout, dp_rank: int, dp_world_size: int) -> Any:
        """A torchtitan BaseDataLoader yielding ``(input_dict, labels)`` micro-batches."""

    def valid_dataset(self, name: str, job_config, layout) -> Any:
        """A fresh iterable of one validation set's micro-batches, with ``collate(unit)``
        giving an all-padding stand-in batch (see components/validate.py)."""


def attach_external_data(job_config, data: ExternalData) -> None:
    """Use ``data`` instead of ``[speechlm_data]`` for this job config (one process)."""
    object.__setattr__(job_config, _ATTR, data)


def external_data(job_config) -> ExternalData | None:
    return getattr(job_config, _ATTR, None)
