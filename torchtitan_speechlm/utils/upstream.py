"""The contact surface with torchtitan: every torchtitan symbol the package imports, subclasses or
touches goes through this module, so a torchtitan upgrade is a reading of this one file.

Three tables, plain literals (``tools/import_graph.py`` reads them with ``ast`` to generate the
contact-surface section of docs/architecture.md, without importing torch):

- ``SYMBOLS``: each torchtitan name we use, the torchtitan module it comes from and what we do
  with it. ``from torchtitan_speechlm.utils.upstream import Trainer`` loads that one torchtitan
  module on first use (a module-level ``__getattr__``), so naming a symbol costs what importing
  its torchtitan module costs and no more (``data/`` names only the logger and
  ``IGNORE_INDEX``; a function that needs a symbol only when it runs writes
  ``upstream.apply_tp``). No other module of the package imports ``torchtitan``: a test of
  tests/unit/test_package_layout.py and ``tools/import_graph.py --check`` refuse one.
- ``OVERRIDES``: the torchtitan classes we subclass and the methods our subclasses override
  (each must still exist upstream: tested), i.e. the parts of torchtitan's loop we hook into.
- ``PRIVATE``: every use of something torchtitan (or torch's DCP, under it) does not offer
  publicly, where it is used and why. Where the use works around a missing seam or a bug it is
  a numbered fix of ``utils/compat.py`` with its upstream diff under ``patches/`` (the number is
  given); the others read a private helper instead of copying its rule, and say what the
  upstream change would be.

Besides the tables, ``job_config_class``, ``job_toml`` and ``config_class_of`` wrap
``ConfigManager``'s two private steps, so that the private names are
read here and nowhere else (as the ``SYMBOLS`` that name a private attribute do).

Not here: torchtitan's TOML schema and command line (``ConfigManager``) are reached through
``config/`` and ``commands/train.py`` with these symbols, and the sections we add to the job
config are ours (``config/job_config.py``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

# name -> (torchtitan module, attribute ("": the module itself), what we do with it)
SYMBOLS: dict[str, tuple[str, str, str]] = {
    # ---- the loop, its spec and its entry point
    "Trainer": ("torchtitan.train", "Trainer", "subclassed: trainer.SpeechLMTrainer (OVERRIDES)"),
    "train_main": ("torchtitan.train", "main", "runs our Trainer subclass (compat fix 5)"),
    "train_module": ("torchtitan.train", "", "compat fix 17: Trainer.train's 2-second end sleep"),
    "TrainSpec": ("torchtitan.protocols.train_spec", "TrainSpec", "the SpeechLM specs (trainer/spec.py)"),
    "get_train_spec": ("torchtitan.protocols.train_spec", "get_train_spec", "reads a registered spec (its flavors' backbones)"),
    "register_train_spec": ("torchtitan.protocols.train_spec", "register_train_spec", "registers the SpeechLM specs"),
    "train_spec_module": ("torchtitan.protocols.train_spec", "", "compat fix 15: the spec of one trainer"),
    "BaseModelArgs": ("torchtitan.protocols", "BaseModelArgs", "subclassed: SpeechLMModelArgs"),
    "ModelProtocol": ("torchtitan.protocols", "ModelProtocol", "subclassed: SpeechLM"),
    "StateDictAdapter": ("torchtitan.protocols.state_dict_adapter", "StateDictAdapter", "subclassed: HF names <-> ours"),
    "register_model_converter": ("torchtitan.protocols.model_converter", "register_model_converter", "registers the lora converter"),
    # ---- configuration
    "ConfigManager": ("torchtitan.config", "ConfigManager", "parses a TOML with our sections merged"),
    "TORCH_DTYPE_MAP": ("torchtitan.config", "TORCH_DTYPE_MAP", "training.dtype names -> torch dtypes"),
    "ParallelismConfig": ("torchtitan.config.job_config", "Parallelism", "the Python API's defaults of [parallelism]"),
    "TrainingConfig": ("torchtitan.config.job_config", "Training", "the Python API's defaults of [training]"),
    "OptimizerConfig": ("torchtitan.config.job_config", "Optimizer", "the Python API's defaults of [optimizer]"),
    # ---- components the loop calls
    "BaseDataLoader": ("torchtitan.components.dataloader", "BaseDataLoader", "subclassed: the Python API's ESPnet loader"),
    "ParallelAwareDataloader": ("torchtitan.components.dataloader", "ParallelAwareDataloader", "subclassed: SpeechLMDataLoader"),
    "IGNORE_INDEX": ("torchtitan.components.loss", "IGNORE_INDEX", "the label of positions without loss"),
    "build_optimizers": ("torchtitan.components.optimizer", "build_optimizers", "torchtitan's optimizers, behind our step guard"),
    "build_lr_schedulers": ("torchtitan.components.lr_scheduler", "build_lr_schedulers", "torchtitan's LR schedule, held at its floor"),
    "BaseLogger": ("torchtitan.components.metrics", "BaseLogger", "subclassed: our JSONL and wandb loggers"),
    "LoggerContainer": ("torchtitan.components.metrics", "LoggerContainer", "holds our JSONL logger beside torchtitan's"),
    "MetricsProcessor": ("torchtitan.components.metrics", "MetricsProcessor", "subclassed: SpeechLMMetricsProcessor (OVERRIDES)"),
    "get_metrics_rank": ("torchtitan.components.metrics", "_get_metrics_rank", "private (PRIVATE): the rank that logs"),
    "metrics_module": ("torchtitan.components.metrics", "", "compat fix 2 replaces its memory monitor on CPUs"),
    "BaseValidator": ("torchtitan.components.validate", "BaseValidator", "subclassed: SpeechLMValidator (OVERRIDES)"),
    "checkpoint_module": ("torchtitan.components.checkpoint", "", "compat fixes 8 and 14: CheckpointManager"),
    # ---- parallelism
    "ParallelDims": ("torchtitan.distributed", "ParallelDims", "the meshes torchtitan builds"),
    "NoParallel": ("torchtitan.distributed", "NoParallel", "LoRA adapters beside tensor-parallel layers"),
    "distributed_utils": ("torchtitan.distributed.utils", "", "compat fix 4 replaces set_pg_timeouts on CPUs"),
    "apply_ac": ("torchtitan.distributed.activation_checkpoint", "apply_ac", "activation checkpointing of our blocks"),
    "build_pipeline_schedule": ("torchtitan.distributed.pipeline_parallel", "build_pipeline_schedule", "the pipeline schedule"),
    "generate_llm_fqn_per_model_part": ("torchtitan.distributed.pipeline_parallel", "generate_llm_fqn_per_model_part", "pipeline stages' module names"),
    "apply_ddp": ("torchtitan.models.llama3.infra.parallelize", "apply_ddp", "DDP (with compat fix 7's SUM hook)"),
    "apply_tp": ("torchtitan.models.llama3.infra.parallelize", "apply_tp", "llama3's tensor-parallel plan on native blocks"),
    "disable_fsdp_gradient_division": ("torchtitan.models.llama3.infra.parallelize", "disable_fsdp_gradient_division", "FSDP sums; the loss divides"),
    "op_sac_save_list": ("torchtitan.models.llama3.infra.parallelize", "_op_sac_save_list", "private (PRIVATE): selective AC's saved ops"),
    "apply_moe_ep_tp": ("torchtitan.models.llama4.infra.parallelize", "apply_moe_ep_tp", "expert parallelism of MoE layers"),
    "moe_utils": ("torchtitan.models.moe.utils", "", "compat fix 12 wraps generate_permute_indices"),
    # ---- model building blocks (the native and qwen3 backbones)
    "ScaledDotProductAttentionWrapper": ("torchtitan.models.attention", "ScaledDotProductAttentionWrapper", "native blocks' attention"),
    "create_attention_mask": ("torchtitan.models.attention", "create_attention_mask", "flex attention's block mask"),
    "get_causal_mask_mod": ("torchtitan.models.attention", "get_causal_mask_mod", "flex attention's causal mask"),
    "RoPEScalingArgs": ("torchtitan.models.llama3.model.args", "RoPEScalingArgs", "native backbone config"),
    "TransformerModelArgs": ("torchtitan.models.llama3.model.args", "TransformerModelArgs", "native backbone config"),
    "Llama3Block": ("torchtitan.models.llama3.model.model", "TransformerBlock", "the native backbone's blocks"),
    "llama3_apply_rotary_emb": ("torchtitan.models.llama3.model.model", "apply_rotary_emb", "incremental decoding of native blocks"),
    "precompute_freqs_cis": ("torchtitan.models.llama3.model.model", "precompute_freqs_cis", "native backbone's rotary table"),
    "MoEArgs": ("torchtitan.models.moe", "MoEArgs", "qwen3 MoE layers"),
    "Qwen3ModelArgs": ("torchtitan.models.qwen3.model.args", "Qwen3ModelArgs", "qwen3 backbone config"),
    "Qwen3Block": ("torchtitan.models.qwen3.model.model", "TransformerBlock", "the qwen3 backbone's blocks"),
    "qwen3_apply_rotary_emb": ("torchtitan.models.qwen3.model.model", "apply_rotary_emb", "incremental decoding of qwen3 blocks"),
    "precompute_rope_cache": ("torchtitan.models.qwen3.model.model", "precompute_rope_cache", "qwen3 backbone's rotary table"),
    # ---- logging and device
    "logger": ("torchtitan.tools.logging", "logger", "every layer logs through torchtitan's logger"),
    "init_logger": ("torchtitan.tools.logging", "init_logger", "the Python API's logging set-up"),
    "tools_utils": ("torchtitan.tools.utils", "", "compat fix 1 reads its cached device type"),
}  # fmt: skip

# torchtitan class (a SYMBOLS name) -> what our subclasses override of it (each must exist upstream)
OVERRIDES: dict[str, tuple[str, ...]] = {
    # trainer/trainer.py SpeechLMTrainer; python_api/trainer.py ChunkedTrainer overrides a subset
    "Trainer": (
        "__init__", "close", "init_distributed", "should_continue_training",
        "post_dataloading_process", "forward_backward_step", "batch_generator", "train",
    ),
    # components/metrics.py; ``num_flops_per_token``: torchtitan's attribute, a property here
    # (MFU counts the head on the interval's loss frames: PRIVATE)
    "MetricsProcessor": ("__init__", "should_log", "log", "num_flops_per_token"),
    "BaseLogger": ("__init__", "log", "close"),  # components/metrics.py, python_api/wandb_run.py
    "BaseValidator": ("__init__", "validate"),  # components/validate.py
    "ParallelAwareDataloader": ("__init__", "__iter__", "state_dict", "load_state_dict"),
    "BaseDataLoader": ("__init__", "__iter__", "state_dict", "load_state_dict"),  # python_api
    "StateDictAdapter": ("__init__", "to_hf", "from_hf"),  # model/state_dict_adapter.py
    "BaseModelArgs": ("__init__", "update_from_config", "get_nparams_and_flops"),  # model/args.py (a dataclass)
    "ModelProtocol": ("__init__", "forward", "init_weights"),  # model/model.py
}  # fmt: skip

# (what, where, why, upstream: "compat fix N, patches/00NN-..." or the change that would end it)
PRIVATE: tuple[tuple[str, str, str, str], ...] = (
    ("Trainer.__init__ reads its TrainSpec from the global registry (`get_train_spec(model.name)`)",
     "trainer/trainer.py via compat.trainer_spec",
     "a run's builders need the run (its plan and training state): the trainer hands torchtitan "
     "a spec built for its run (trainer/builders.py RunBuilders) instead of the registered one",
     "compat fix 15, patches/0015-trainer-train-spec-argument.diff (a `train_spec` argument)"),
    ("torchtitan.train's module global `time` replaced while our Trainer.train runs",
     "trainer/trainer.py via compat.end_train_on_a_barrier",
     "Trainer.train ends with rank 0 sleeping 2 s for the other ranks (every run, every Python "
     "API chunk); a barrier of every rank takes its place",
     "compat fix 17, patches/0017-train-ends-on-a-barrier.diff"),
    ("ConfigManager.parse_args replaced while torchtitan's main runs",
     "utils/compat.py run_torchtitan_main (commands/train.py run_worker)",
     "main parses the arguments bound at import (fix 5), and parses again what our launcher "
     "parsed and checked in the same process (fix 21): for that call the method takes the "
     "run's arguments and answers them with the launcher's config",
     "compat fixes 5 and 21, patches/0005-parse-args-default.diff and "
     "patches/0021-main-takes-a-parsed-config.diff (`main(trainer_class, config=None)`)"),
    ("CheckpointManager._should_save and .interval",
     "trainer/trainer.py save_now via compat.save_checkpoint_now",
     "SAVE_AND_STOP (and the Python API's train()) save the current step in full off the "
     "interval, unless the loop's own save of it just did; torchtitan has no public 'save now'",
     "compat fix 16, patches/0016-checkpoint-save-now.diff (CheckpointManager.save_now)"),
    ("torchtitan.tools.utils.get_peak_flops replaced (CPU only)",
     "utils/compat.py quiet_peak_flops_on_cpu (called at import and by components/metrics.py)",
     "a CPU has no peak: torchtitan runs lspci, warns twice and shows MFU against an A100's peak",
     "compat fix 13, patches/0013-no-peak-flops-on-cpu.diff"),
    ("torchtitan's INFO records filtered on the root logger (the MFU line and column, the "
     "`Building ... with {JSON}` dump)",
     "utils/compat.py _RunLogFilter (quiet_peak_flops_on_cpu, summarise_model_args)",
     "the step line without a meaningless mfu on a CPU; the model arguments as one line, the "
     "JSON at DEBUG (about 170 lines at INFO otherwise)",
     "compat fixes 13 and 14, patches/0013-no-peak-flops-on-cpu.diff and "
     "patches/0014-model-args-at-debug.diff"),
    ("CheckpointManager.dcp_save and ._purge_stale_checkpoints wrapped",
     "utils/compat.py install_checkpoint_safety",
     "purge among complete checkpoints only; a stale .metadata removed; save errors in words; "
     "the manifest written around each save",
     "compat fix 8, patches/0008-checkpoint-purge-complete-only.diff"),
    ("torchtitan.hf_datasets.text_datasets's code deferred to its first use (an import hook: "
     "its two dataloader builders stand in until called)",
     "utils/compat.py defer_hf_text_datasets (torchtitan_speechlm/__init__.py, before torchtitan "
     "runs), utils/import_hooks.py run_on_first_use",
     "the module imports Hugging Face datasets, pandas and pyarrow, and torchtitan's trainer "
     "imports it: 0.5-0.8 s of every rank's and every command's start for datasets no SpeechLM "
     "run reads",
     "compat fix 18, patches/0018-hf-datasets-imported-on-use.diff"),
    ("torch.compile replaced while torchtitan.models.attention is imported (CPU only): its "
     "three import-time compiles (flex, varlen, create_block_mask) get stand-ins that compile "
     "at their first call",
     "utils/compat.py defer_attention_compiles_on_cpu (torchtitan_speechlm/__init__.py, before "
     "torchtitan runs), utils/import_hooks.py around_import",
     "those calls import inductor's compiler: about 1.1 s of every rank's and every command's "
     "start, on a CPU where neither attention trains",
     "compat fix 19, patches/0019-attention-compiled-on-first-use.diff"),
    ("torch DCP FileSystem.create_stream wrapped",
     "utils/checkpoint_manifest.py install_stream_sums (from compat fix 8)",
     "each checkpoint file's size and CRC-32C summed as DCP writes it, for the manifest: DCP's "
     "FileSystemWriter has no per-file hook (our feature, kept with the workarounds off)",
     "torch: a FileSystemWriter option that checksums each file it writes (not proposed)"),
    ("_get_metrics_rank (components/metrics.py)",
     "components/metrics.py SpeechLMMetricsProcessor",
     "our JSONL logger writes on the rank torchtitan's loggers write on (the last pipeline "
     "stage's first rank); copying the rule would let the two drift apart",
     "export it as get_metrics_rank"),
    ("_op_sac_save_list (torchtitan/models/llama3/infra/parallelize.py)",
     "distributed/parallelize.py",
     "selective activation checkpointing saves the ops torchtitan's llama3 saves",
     "export it (torchtitan main moved it to torchtitan/distributed/activation_checkpoint.py)"),
    ("MetricsProcessor.num_flops_per_token set by Trainer.__init__, read by log()",
     "components/metrics.py SpeechLMMetricsProcessor (a property)",
     "MFU's FLOPs per frame vary per interval: the head runs on loss frames only and the audio "
     "tower per clip; torchtitan fixes one figure per run",
     "a MetricsProcessor hook giving the FLOPs of the logged interval"),
    ("ConfigManager._maybe_load_toml and ._maybe_add_custom_config",
     "utils/upstream.py job_config_class, job_toml, config_class_of (python_api/args.py; "
     "commands/train.py parse_job and normalise_bool_flags)",
     "the JobConfig class with our sections merged, without parsing a command line (the Python "
     "API writes a TOML from it); the TOML's values and that class before torchtitan parses, so "
     "the TOML is checked key by key and `--key false` flags are normalised for tyro",
     "a public ConfigManager.load_toml(args) and job_config_class(args, toml)"),
    ("Trainer.checkpointer.load replaced on the instance for one call (and validation.enable "
     "set for it)",
     "python_api/trainer.py ChunkedTrainer.train_until",
     "the Python API's train() chunks call torchtitan's train() again; the checkpoint was loaded "
     "once, and a second load would rewind the chunk (a chunk of train() does not validate)",
     "a Trainer.train(load_checkpoint=True) argument"),
)  # fmt: skip


def job_toml(manager, args: list[str]) -> dict | None:
    """The values of the TOML ``args`` name, or None (PRIVATE: ``ConfigManager._maybe_load_toml``)."""
    return manager._maybe_load_toml(args)


def config_class_of(manager, args: list[str], toml_values: dict | None) -> type:
    """The JobConfig class with the custom config module of ``args`` or the TOML merged
    (PRIVATE: ``ConfigManager._maybe_add_custom_config``)."""
    return manager._maybe_add_custom_config(args, toml_values)


def job_config_class(custom_config_module: str) -> type:
    """torchtitan's JobConfig class with ``custom_config_module``'s sections merged, without
    parsing a command line (PRIVATE: ``ConfigManager._maybe_add_custom_config``)."""
    manager = __getattr__("ConfigManager")()
    return config_class_of(manager, ["--job.custom_config_module", custom_config_module], None)


# SYMBOLS whose object is known without importing torchtitan: torchtitan.tools.logging's
# ``logger`` is the root logger (``logging.getLogger()``). Importing any torchtitan module runs
# the package's __init__ first (its quantization converters, the attention module that compiles
# flex attention: about 2 s on 2 cores), which the data side (`torchtitan prepare` and its
# workers) needs nothing else of. tests/unit/test_package_layout.py checks that each is the
# object torchtitan has.
KNOWN_WITHOUT_IMPORT: dict[str, Callable[[], object]] = {"logger": logging.getLogger}


def __getattr__(name: str):
    """A ``SYMBOLS`` name: its torchtitan module imported (once) and the attribute read."""
    try:
        module, attribute, _ = SYMBOLS[name]
    except KeyError:
        raise AttributeError(
            f"{__name__} has no {name!r}: add the torchtitan symbol to SYMBOLS (the one "
            "contact surface with torchtitan)"
        ) from None
    if name in KNOWN_WITHOUT_IMPORT:
        value = KNOWN_WITHOUT_IMPORT[name]()
        globals()[name] = value
        return value
    value = importlib.import_module(module)
    if attribute:
        value = getattr(value, attribute)
    globals()[name] = value  # later reads are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(SYMBOLS))
