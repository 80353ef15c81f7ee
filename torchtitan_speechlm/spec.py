"""The `speechlm` TrainSpec: torchtitan's own loop, optimizers, LR schedule and checkpointer,
with our model, parallelize function, data loader, loss, metrics and validator."""

from __future__ import annotations

from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from torchtitan_speechlm.components.loss import build_speechlm_loss
from torchtitan_speechlm.components.metrics import build_speechlm_metrics_processor
from torchtitan_speechlm.components.validate import build_speechlm_validator
from torchtitan_speechlm.data.loader import build_speechlm_dataloader
from torchtitan_speechlm.infra.parallelize import parallelize_speechlm
from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.model import SpeechLM

SPEC_NAME = "speechlm"

# One flavor: sizes come from the backbone's config.json, not from a table of presets.
speechlm_flavors = {"hf": SpeechLMModelArgs()}


def get_speechlm_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=SpeechLM,
        model_args=speechlm_flavors,
        parallelize_fn=parallelize_speechlm,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_speechlm_dataloader,
        build_tokenizer_fn=None,
        build_loss_fn=build_speechlm_loss,
        build_validator_fn=build_speechlm_validator,
        build_metrics_processor_fn=build_speechlm_metrics_processor,
    )


def register() -> TrainSpec:
    """Register the spec once; importing twice (custom_import + our CLI) is harmless."""
    try:
        return get_train_spec(SPEC_NAME)
    except ValueError:
        spec = get_speechlm_train_spec()
        register_train_spec(SPEC_NAME, spec)
        return spec
