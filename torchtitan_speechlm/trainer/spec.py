"""The SpeechLM TrainSpecs: torchtitan's own loop, optimizers, LR schedule and checkpointer,
with our model, parallelize function, data loader, loss, metrics and validator.

``speechlm`` (flavor ``hf``) runs transformers' decoders. ``register_speechlm_spec`` registers
a SpeechLM over another decoder family (a registered Backbone): one call, e.g.
``register_speechlm_spec("speechlm_mine", backbone="mine")`` and ``model.name =
"speechlm_mine"``, ``model.flavor = "mine"`` in the TOML (docs/extending.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from torchtitan_speechlm.components import lora as _lora_converter  # noqa: F401 (registers it)
from torchtitan_speechlm.components.dataloader import build_speechlm_dataloader
from torchtitan_speechlm.components.loss import build_speechlm_loss
from torchtitan_speechlm.components.metrics import build_speechlm_metrics_processor
from torchtitan_speechlm.components.optim import (
    build_speechlm_lr_schedulers,
    build_speechlm_optimizers,
)
from torchtitan_speechlm.components.resume import resolve_resume
from torchtitan_speechlm.components.validate import build_speechlm_validator
from torchtitan_speechlm.distributed.parallelize import parallelize_speechlm
from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.backbones import get_backbone
from torchtitan_speechlm.model.model import SpeechLM
from torchtitan_speechlm.model.run_record import record_run
from torchtitan_speechlm.model.state_dict_adapter import SpeechLMStateDictAdapter
from torchtitan_speechlm.trainer.preflight import validate_job_config
from torchtitan_speechlm.trainer.run_context import SPEECHLM_SPECS, fill_model_args, run_context

SPEC_NAME = "speechlm"


@dataclass
class SpeechLMJobModelArgs(SpeechLMModelArgs):
    """The model args torchtitan's Trainer fills from the job config (``update_from_config``):
    the job's checks, then the resolved run's values. ``SpeechLMModelArgs`` itself (below the
    run layer) knows nothing of job configs; models rebuilt from a record or an export use it."""

    def update_from_config(self, job_config, **kwargs) -> None:
        validate_job_config(job_config)  # builds the resolved run (run_context) once
        resolve_resume(job_config)  # before torchtitan's checkpointer picks the step to load
        fill_model_args(self, job_config)
        record_run(job_config, self, run_context(job_config))


def speechlm_train_spec(
    backbone: str | tuple[str, ...] = "hf", parallelize_fn=parallelize_speechlm
) -> TrainSpec:
    """A TrainSpec of a SpeechLM over ``backbone`` (or several: one flavor each, named after
    it; sizes come from the backbone's own config, not from a table of presets)."""
    backbones = (backbone,) if isinstance(backbone, str) else tuple(backbone)
    for name in backbones:
        get_backbone(name)  # must be registered
    return TrainSpec(
        model_cls=SpeechLM,
        model_args={name: SpeechLMJobModelArgs(backbone=name) for name in backbones},
        parallelize_fn=parallelize_fn,
        pipelining_fn=None,
        build_optimizers_fn=build_speechlm_optimizers,
        build_lr_schedulers_fn=build_speechlm_lr_schedulers,
        build_dataloader_fn=build_speechlm_dataloader,
        build_tokenizer_fn=None,
        build_loss_fn=build_speechlm_loss,
        build_validator_fn=build_speechlm_validator,
        build_metrics_processor_fn=build_speechlm_metrics_processor,
        state_dict_adapter=SpeechLMStateDictAdapter,
    )


def register_speechlm_spec(
    name: str, backbone: str | tuple[str, ...] = "hf", parallelize_fn=parallelize_speechlm
) -> TrainSpec:
    """Register (once; importing twice is harmless) the TrainSpec ``name`` over ``backbone``."""
    SPEECHLM_SPECS.add(name)
    try:
        return get_train_spec(name)
    except ValueError:
        spec = speechlm_train_spec(backbone, parallelize_fn)
        register_train_spec(name, spec)
        return spec


def register() -> TrainSpec:
    """The built-in ``speechlm`` spec: flavor ``hf`` (transformers' decoders) and ``native``
    (torchtitan's llama3 blocks, tensor-parallel)."""
    return register_speechlm_spec(SPEC_NAME, ("hf", "native"))
