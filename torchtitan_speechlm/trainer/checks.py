"""The checks of a job every process runs, before anything is built: the parallel layout
against the backbone and the world size (torchtitan only asserts it inside every rank, after
the process group is up), keys that contradict each other (torchtitan asserts some in the
middle of a run, some at the last save), and LoRA's settings. Each error names the key and the
fix. ``torchtitan train`` runs them once in the launching process (commands/train.py); each
rank's trainer runs them again (ranks started by torchrun or srun check their world size here).
"""

from __future__ import annotations

import os

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.tasks import get_task
from torchtitan_speechlm.distributed.batch import data_parallel_degree
from torchtitan_speechlm.distributed.parallelize import check_parallelism
from torchtitan_speechlm.distributed.pipeline import check_pipeline
from torchtitan_speechlm.model.lora import CONVERTER, LoraError, peft_module
from torchtitan_speechlm.trainer.plan import RunPlan


def validate_job_config(job_config, plan: RunPlan) -> None:
    """The checks every process runs on a resolved run (raise ConfigError naming the key and
    the fix): the parallel layout for its backbone, contradicting keys, LoRA, and inside a rank
    the world size."""
    try:
        check_parallelism(job_config, plan.family, plan.backbone_config)
        check_pipeline(job_config, plan.family, plan.backbone_config, plan.model_args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_conflicts(job_config)
    check_lora(job_config, plan)
    check_preference(job_config, plan)
    if "WORLD_SIZE" in os.environ:  # a rank (the launcher checks with --nproc-per-node)
        check_parallel_layout(job_config, int(os.environ["WORLD_SIZE"]))


def check_parallel_layout(job_config, world_size: int) -> None:
    """Parallel degrees that fit ``world_size``; a global batch that splits into micro-batches."""
    p = job_config.parallelism
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "data_parallel_shard_degree": p.data_parallel_shard_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
    }
    for key, value in degrees.items():
        if value < 1 and not (key == "data_parallel_shard_degree" and value == -1):
            raise ConfigError(f"parallelism.{key} = {value}: must be >= 1 (shard degree: or -1)")
    fixed = 1
    for value in degrees.values():
        if value != -1:
            fixed *= value
    names = " x ".join(f"{k} ({v})" for k, v in degrees.items() if v != 1)
    if p.data_parallel_shard_degree == -1:
        if world_size % fixed:
            raise ConfigError(
                f"parallelism: {names or 'the degrees'} = {fixed} does not divide the job's "
                f"{world_size} ranks: make the product of the fixed degrees a divisor of "
                f"{world_size} (data_parallel_shard_degree = -1 takes the rest), or start "
                f"{fixed} x k ranks (--nproc-per-node)"
            )
    elif fixed != world_size:
        raise ConfigError(
            f"parallelism: {names or 'all degrees 1'} = {fixed} ranks, but the job has "
            f"{world_size} (--nproc-per-node / WORLD_SIZE): make the product {world_size}, e.g. "
            "set parallelism.data_parallel_shard_degree = -1 (it fills the rest)"
        )
    t = job_config.training
    dp = data_parallel_degree(p, world_size)
    ep, shard = p.expert_parallel_degree, dp // p.data_parallel_replicate_degree
    if ep > 1 and (shard * p.context_parallel_degree) % ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} must divide the data-parallel shard "
            f"degree x context-parallel degree ({shard} x {p.context_parallel_degree}): expert "
            "parallelism borrows those ranks (torchtitan's ParallelDims); start more ranks or "
            "lower the expert degree"
        )
    if t.global_batch_size > 0 and t.global_batch_size % (t.local_batch_size * dp):
        step = t.local_batch_size * dp
        lower = max(step, t.global_batch_size // step * step)
        raise ConfigError(
            f"training.global_batch_size = {t.global_batch_size} is not a multiple of "
            f"training.local_batch_size ({t.local_batch_size}) x the data-parallel degree ({dp})"
            f" = {step}: set global_batch_size to a multiple of {step} (e.g. {lower} or "
            f"{lower + step}), or change local_batch_size"
        )


def check_conflicts(job_config) -> None:
    """Pairs of keys torchtitan would refuse only inside the ranks, some at the last step."""
    c = job_config.checkpoint
    if c.keep_latest_k == 1:
        raise ConfigError(
            "checkpoint.keep_latest_k = 1: torchtitan keeps at least 2 (the newest may be "
            "being written when the older one is purged); set 2 or more, or 0 to keep all"
        )
    if c.last_save_in_hf and not c.last_save_model_only:
        raise ConfigError(
            "checkpoint.last_save_in_hf = true needs checkpoint.last_save_model_only = true "
            "(safetensors hold weights only); set both, or use `torchtitan export` after training"
        )
    if c.initial_load_in_hf and not c.initial_load_model_only:
        raise ConfigError(
            "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_model_only = "
            "true (an HF folder holds weights only)"
        )
    if c.enable and c.interval < 1:
        raise ConfigError(f"checkpoint.interval = {c.interval}: must be >= 1")
    if job_config.training.steps < 1:
        raise ConfigError(f"training.steps = {job_config.training.steps}: must be >= 1")
    t = job_config.training
    if t.dtype != "float32" and t.mixed_precision_param != "float32":
        raise ConfigError(
            f"training.dtype = {t.dtype!r} asks for {t.dtype} master weights (parameters, "
            "gradients and optimizer states; every update below its resolution is lost), which "
            f"is honoured only with mixed precision off, but training.mixed_precision_param = "
            f"{t.mixed_precision_param!r}. Keep training.dtype = 'float32' (recommended: "
            "float32 master weights, bf16 compute through mixed_precision_param), or set "
            "training.mixed_precision_param = 'float32' as well"
        )


def master_weights_note(job_config, plan: RunPlan) -> str | None:
    """What a rank says once about its parameters' dtype, when the backbone's checkpoint or the
    run asks for anything but float32 master weights (None otherwise)."""
    t = job_config.training
    stored = plan.family.stored_dtype(plan.backbone_config)
    if t.dtype != "float32":
        return (
            f"training.dtype = {t.dtype!r}: parameters, gradients and optimizer states are "
            f"{t.dtype} (no float32 master copy) and FSDP's mixed precision is off; updates "
            f"below {t.dtype}'s resolution are lost"
        )
    if stored and stored != "float32":
        return (
            f"{plan.backbone_path}/config.json stores the weights as {stored}: they are loaded "
            "into float32 master weights (training.dtype); compute runs in "
            f"{t.mixed_precision_param} (training.mixed_precision_param, through FSDP2's "
            "mixed precision or autocast)"
        )
    return None


def check_lora(job_config, plan: RunPlan) -> None:
    """LoRA's settings, PEFT installed, and the options LoRA cannot work with."""
    if plan.lora is None:  # its values were checked when the plan read them (LoraSettings)
        return
    converters = list(job_config.model.converters)
    try:
        peft_module()
    except LoraError as e:
        raise ConfigError(str(e)) from None
    others = [c for c in converters if c != CONVERTER]
    if others:
        raise ConfigError(
            f"model.converters = {converters}: LoRA cannot be combined with {others} (they "
            "replace the same nn.Linear layers LoRA wraps; a float8/MX base layer under PEFT's "
            'adapters is not supported): keep ["lora"] alone'
        )
    c = job_config.checkpoint
    for key in ("initial_load_in_hf", "last_save_in_hf"):
        if getattr(c, key):
            raise ConfigError(
                f"checkpoint.{key} = true with LoRA: an HF checkpoint has no adapters. Start "
                "from the backbone (model.hf_assets_path) or an export (speechlm.init_from), "
                "and write HF folders with `torchtitan export` (merged, or --adapter)"
            )


def check_preference(job_config, plan: RunPlan) -> None:
    """A preference loss needs preference pairs (``*_pref`` tasks) and they need it."""
    loss = job_config.speechlm.preference_loss
    entries = list(getattr(plan.data, "train", None) or [])
    pref = [f"{e.task}:{e.dataset}" for e in entries if get_task(e.task).pair_of]
    if loss and not pref:
        raise ConfigError(
            f"speechlm.preference_loss = {loss!r} trains on preference pairs, but "
            f"speechlm_data.train {[f'{e.task}:{e.dataset}' for e in entries]} has no preference "
            "task: train tts_pref / asr_pref on a prepared preference dataset "
            "(docs/preference.md), or unset preference_loss"
        )
    if pref and not loss:
        raise ConfigError(
            f"speechlm_data.train has preference tasks {pref} but speechlm.preference_loss is "
            'not set: set it to "dpo" or "simpo" (docs/preference.md)'
        )
