"""The ``lora`` model converter: torchtitan's seam for changing a built model
(``[model] converters = ["lora"]``; ``torchtitan.protocols.model_converter``).

torchtitan's Trainer builds the SpeechLM on the meta device, runs the converters listed in
``model.converters``, then parallelizes (tensor parallelism, activation checkpointing, compile,
FSDP2) and initialises the weights, and builds the optimizer over the parameters that still
require grad. This converter wraps the decoder's selected linear layers in PEFT's LoRA layers
and freezes the rest (model/lora.py), so every later stage sees the adapted model.
"""

from __future__ import annotations

from torch import nn

from torchtitan_speechlm.model.lora import CONVERTER, apply_lora, trained_parameters
from torchtitan_speechlm.utils.upstream import logger, register_model_converter


class LoraConverter:
    """LoRA on the SpeechLM's decoder (model/lora.py), with the settings the model's args carry
    (``SpeechLMModelArgs.lora``: the run's ``[lora]`` section, read once by the run plan)."""

    def __init__(self, job_config, parallel_dims) -> None:
        pass  # torchtitan's converter protocol; the settings come with the model

    def convert(self, model: nn.Module) -> None:
        self.settings = model.args.lora
        targets = apply_lora(model, self.settings)
        total = sum(p.numel() for p in model.parameters())
        trained = trained_parameters(model)  # the held text rows do not train
        logger.info(
            f"LoRA (rank {self.settings.rank}, alpha {self.settings.alpha}) on "
            f"{len(targets)} linear layers; {trained:,} of {total:,} parameters train"
        )

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Nothing to do after a step (the protocol's optional hook)."""


register_model_converter(LoraConverter, CONVERTER)
