"""The SpeechLM TrainSpecs: torchtitan's own loop, optimizers, LR schedule and checkpointer,
with our model, parallelize function, data loader, loss, metrics and validator.

``speechlm`` (flavors ``hf`` and ``native``) runs transformers' decoders or torchtitan's llama3
blocks. ``register_speechlm_spec`` registers a SpeechLM over another decoder family (a
registered Backbone): one call, e.g. ``register_speechlm_spec("speechlm_mine",
backbone="mine")`` and ``model.name = "speechlm_mine"``, ``model.flavor = "mine"`` in the TOML
(docs/extending.md). The builders are the run's (builders.py ``RunBuilders``): the registered
spec is what ``trainer.SpeechLMTrainer`` builds each run's spec from.
"""

from __future__ import annotations

from torchtitan_speechlm.components import lora as _lora_converter  # noqa: F401 (registers it)
from torchtitan_speechlm.distributed.parallelize import parallelize_speechlm
from torchtitan_speechlm.distributed.pipeline import pipeline_speechlm
from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.backbones import get_backbone
from torchtitan_speechlm.model.model import SpeechLM
from torchtitan_speechlm.model.state_dict_adapter import SpeechLMStateDictAdapter
from torchtitan_speechlm.trainer.builders import needs_the_run
from torchtitan_speechlm.utils.upstream import (
    TrainSpec,
    get_train_spec,
    register_train_spec,
)

SPEC_NAME = "speechlm"
# the TrainSpecs registered through ``register_speechlm_spec`` (torchtitan's registry holds
# the specs; this names which of them are SpeechLMs, whose sections and checks apply)
SPEECHLM_SPECS: set[str] = set()


def is_speechlm(job_config) -> bool:
    """The job trains a spec registered through ``register_speechlm_spec``."""
    return job_config.model.name in SPEECHLM_SPECS


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
        model_args={name: SpeechLMModelArgs(backbone=name) for name in backbones},
        parallelize_fn=parallelize_fn,
        pipelining_fn=pipeline_speechlm,
        # the run's builders replace these (builders.RunBuilders.train_spec); torchtitan's own
        # Trainer has no run, and the first of them it calls says which commands have one
        build_optimizers_fn=needs_the_run,
        build_lr_schedulers_fn=needs_the_run,
        build_dataloader_fn=needs_the_run,
        build_tokenizer_fn=None,
        build_loss_fn=needs_the_run,
        build_validator_fn=needs_the_run,
        build_metrics_processor_fn=needs_the_run,
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
    return register_speechlm_spec(SPEC_NAME, ("hf", "native", "qwen3"))


register()  # importing this module registers the spec, as torchtitan's own model packages do
