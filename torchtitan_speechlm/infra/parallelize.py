"""Apply activation checkpointing -> torch.compile -> FSDP2/HSDP or DDP, torchtitan's order.

Everything reuses torchtitan's own helpers (``apply_ac``, ``apply_ddp``,
``disable_fsdp_gradient_division``); only the FSDP grouping is ours, because it must follow the
SpeechLM's modules:

- one FSDP unit per decoder layer (``backbone.layers[i]``);
- untied: the embedding and the head are units of their own (like llama3's);
- tied: the embedding and the head share one Parameter, which torch 2.13's FSDP2 refuses to put
  in two groups, so both stay in the root unit.

DDP (replicate only) is torchtitan's ``apply_ddp`` plus a SUM all-reduce comm hook: torchtitan's
loss is already ``local loss sum / global loss count``, so gradients must be summed over ranks,
not averaged (``compat.sum_gradients_in_ddp``, fix 7). FSDP/HSDP get the same behaviour from
``disable_fsdp_gradient_division``.

Tensor, context and pipeline parallelism are not supported yet: asking for them is an error.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.infra.parallelize import (
    _op_sac_save_list,
    apply_ddp,
    disable_fsdp_gradient_division,
)
from torchtitan.tools.logging import logger

from torchtitan_speechlm.compat import (
    force_sum_reduction_on_cpu,
    sum_gradients_in_ddp,
    sync_gradients_on_last_microbatch,
)


def parallelize_speechlm(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    for name, enabled in (
        ("tensor", parallel_dims.tp_enabled),
        ("context", parallel_dims.cp_enabled),
        ("pipeline", parallel_dims.pp_enabled),
        ("expert", parallel_dims.ep_enabled),
    ):
        if enabled:
            raise ValueError(
                f"speechlm does not support {name} parallelism yet; set "
                f"parallelism.{name}_parallel_degree = 1 (FSDP/HSDP/DDP are supported)."
            )
    apply_freeze(model, job_config.speechlm.freeze)
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        # apply_ac wraps the children of `layers`; the backbone owns them.
        # Selective "op" mode saves the outputs of torchtitan's llama3 list (matmuls, SDPA
        # kernels) and recomputes the rest; without a list it would recompute everything.
        apply_ac(
            model.backbone,
            job_config.activation_checkpoint,
            model_compile_enabled=compile_model,
            op_sac_save_list=_op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
    if compile_model:
        apply_compile(model, job_config.compile.backend)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward != "never",
        )
        logger.info(
            "Applied %s to the SpeechLM", "HSDP" if parallel_dims.dp_replicate_enabled else "FSDP"
        )
    elif parallel_dims.dp_replicate_enabled:
        dp_mesh = parallel_dims.get_mesh("dp_replicate")
        apply_ddp(model, dp_mesh, enable_compile=compile_model)
        sum_gradients_in_ddp(model, dp_mesh.get_group())
    # With SUM reduction, re-reducing an accumulated .grad would count earlier micro-batches
    # once per rank: reduce only in the last micro-batch's backward (compat fix 6).
    sync_gradients_on_last_microbatch(
        model,
        accumulation_steps(job_config, parallel_dims),
        ddp=parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled,
        hsdp=parallel_dims.dp_replicate_enabled and parallel_dims.fsdp_enabled,
    )
    return model


def accumulation_steps(job_config, parallel_dims: ParallelDims) -> int:
    """Micro-batches per optimizer step, exactly as torchtitan's Trainer computes them."""
    batch = parallel_dims.dp_replicate * parallel_dims.dp_shard if parallel_dims.dp_enabled else 1
    local = job_config.training.local_batch_size
    global_batch = job_config.training.global_batch_size
    return max(1, global_batch // (local * batch)) if global_batch > 0 else 1


def apply_freeze(model: nn.Module, prefixes: list[str]) -> None:
    """requires_grad=False for parameters under the given prefixes (the optimizer skips them)."""
    for prefix in prefixes:
        hits = [p for n, p in model.named_parameters() if n == prefix or n.startswith(prefix + ".")]
        if not hits:
            raise ValueError(
                f"speechlm.freeze entry {prefix!r} matches no parameter; names look like "
                "tok_embeddings, backbone.layers.0, backbone.norm, head.output, head.stream_emb"
            )
        for p in hits:
            p.requires_grad_(False)
        logger.info("Froze %d parameters under %s", len(hits), prefix)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks (``backbone.layers``: a ModuleList or, for torchtitan's blocks, a
    ModuleDict)."""
    layers = model.backbone.layers
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def apply_compile(model: nn.Module, backend: str) -> None:
    """Compile each decoder layer separately: repeated structure compiles once."""
    layers = model.backbone.layers
    for layer_id, block in layers.named_children():
        layers.register_module(layer_id, torch.compile(block, backend=backend))
    logger.info("Compiled each decoder layer with torch.compile (backend=%s)", backend)


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> None:
    config = {"mesh": dp_mesh, "mp_policy": MixedPrecisionPolicy(param_dtype, reduce_dtype)}
    if cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy()
    for block in blocks(model):
        fully_shard(block, **config, reshard_after_forward=reshard_after_forward)
    if not model.args.tie_embeddings:
        fully_shard(model.tok_embeddings, **config, reshard_after_forward=reshard_after_forward)
        # The head runs last; resharding it right before backward needs it again is waste.
        fully_shard(model.head, **config, reshard_after_forward=False)
    fully_shard(model, **config)
    disable_fsdp_gradient_division(model)
    force_sum_reduction_on_cpu(model)
