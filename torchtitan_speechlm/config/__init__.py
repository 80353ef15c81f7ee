"""The config schema: ``job.custom_config_module = "torchtitan_speechlm.config"`` in a TOML makes
torchtitan's ConfigManager merge this module's ``JobConfig`` (the SpeechLM sections,
``job_config.py``) into its own; ``toml_check.py`` checks a TOML's keys and types first."""

from torchtitan_speechlm.config.errors import ConfigError
from torchtitan_speechlm.config.job_config import (
    AudioEncoderConfig,
    Batching,
    Checkpoint,
    JobConfig,
    Lora,
    LossRegion,
    NonFinitePolicy,
    OrderName,
    SpeechLM,
    SpeechLMData,
    SpeechLMFaults,
)
from torchtitan_speechlm.config.toml_check import MOVED_KEYS, check_toml

__all__ = [
    "MOVED_KEYS",
    "AudioEncoderConfig",
    "Batching",
    "Checkpoint",
    "ConfigError",
    "OrderName",
    "JobConfig",
    "Lora",
    "LossRegion",
    "NonFinitePolicy",
    "SpeechLM",
    "SpeechLMData",
    "SpeechLMFaults",
    "check_toml",
]
