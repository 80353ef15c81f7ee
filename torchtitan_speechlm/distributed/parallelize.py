"""Apply activation checkpointing -> torch.compile -> FSDP2/HSDP or DDP, torchtitan's order.

Everything reuses torchtitan's own helpers (``apply_ac``, ``apply_ddp``,
``disable_fsdp_gradient_division``); only the FSDP grouping is ours, because it must follow the
SpeechLM's modules:

- one FSDP unit per decoder layer (``backbone.layers[i]``);
- an audio encoder (model/audio/tower.py): one unit per encoder layer and one for the rest of
  the tower (convolutions, positions, adaptor), which keeps its inputs as they are (waveforms,
  lengths); its layers are activation-checkpointed like the decoder's;
- untied: the embedding and the head are units of their own (like llama3's);
- tied: the embedding and the head share one Parameter, which torch 2.13's FSDP2 refuses to put
  in two groups, so both stay in the root unit.

DDP (replicate only) is torchtitan's ``apply_ddp`` plus a SUM all-reduce comm hook: torchtitan's
loss is already ``local loss sum / global loss count``, so gradients must be summed over ranks,
not averaged (``compat.sum_gradients_in_ddp``, fix 7). FSDP/HSDP get the same behaviour from
``disable_fsdp_gradient_division``.

Tensor parallelism (with sequence parallelism) is torchtitan's own llama3 plan on the ``native``
backbone; expert parallelism is torchtitan's MoE plan (distributed/expert_parallel.py), pipelines
are cut by distributed/pipeline.py; context parallelism is refused with the reason.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from torchtitan_speechlm.distributed.batch import accumulation_steps
from torchtitan_speechlm.distributed.expert_parallel import (
    apply_expert_parallel,
    check_expert_parallel,
    shard_experts,
)
from torchtitan_speechlm.model.lora import ADAPTER, lora_layers
from torchtitan_speechlm.utils import upstream
from torchtitan_speechlm.utils.compat import (
    force_sum_reduction_on_cpu,
    sum_gradients_in_ddp,
    sync_gradients_on_last_microbatch,
)
from torchtitan_speechlm.utils.upstream import (
    TORCH_DTYPE_MAP,
    ParallelDims,
    apply_ac,
    apply_ddp,
    disable_fsdp_gradient_division,
    logger,
    op_sac_save_list,
)


def parallelize_speechlm(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    check_parallelism(job_config, model.family, model.args.backbone_config)
    if parallel_dims.tp_enabled:
        apply_tensor_parallel(model, parallel_dims.get_mesh("tp"))
        logger.info("Applied tensor + sequence parallelism (torchtitan's llama3 plan)")
    if parallel_dims.ep_enabled:
        apply_expert_parallel(model, parallel_dims)
        logger.info(f"Applied expert parallelism (EP={parallel_dims.ep}, torchtitan's MoE plan)")
    apply_freeze(model, model.args.freeze)
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        # apply_ac wraps the children of `layers`; the backbone owns them.
        # Selective "op" mode saves the outputs of torchtitan's llama3 list (matmuls, SDPA
        # kernels) and recomputes the rest; without a list it would recompute everything.
        apply_ac(
            model.backbone,
            job_config.activation_checkpoint,
            model_compile_enabled=compile_model,
            op_sac_save_list=op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
        if model.audio_encoder is not None:
            apply_ac(
                model.audio_encoder.encoder,
                job_config.activation_checkpoint,
                model_compile_enabled=compile_model,
                op_sac_save_list=op_sac_save_list,
                base_folder=job_config.job.dump_folder,
            )
    if compile_model:
        apply_compile(model, job_config.compile.backend)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(names),
            # bf16 master weights (training.dtype) run with mixed precision off (trainer/checks.py)
            param_dtype=(
                TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
                if job_config.training.dtype == "float32"
                else None
            ),
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward != "never",
            experts=(
                (parallel_dims.get_optional_mesh("efsdp"), parallel_dims.ep)
                if parallel_dims.ep_enabled
                else None
            ),
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
        accumulation_steps(
            job_config.training, parallel_dims.dp_replicate * parallel_dims.dp_shard
        ),
        ddp=parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled,
        hsdp=parallel_dims.dp_replicate_enabled and parallel_dims.fsdp_enabled,
    )
    return model


UNSUPPORTED = {
    "context": "packed rows are split into their documents, which context parallelism would "
    "have to shard again (and torch's CPU SDPA has no context-parallel rule)",
}


def check_parallelism(job_config, family, backbone_config: dict | None = None) -> None:
    """Refuse, naming the reason, what cannot work (called before any rank starts, too)."""
    check_expert_parallel(job_config, family, backbone_config)
    p = job_config.parallelism
    degrees = {
        "tensor": p.tensor_parallel_degree,
        "context": p.context_parallel_degree,
        "pipeline": p.pipeline_parallel_degree,
        "expert": p.expert_parallel_degree,
    }
    for name, degree in degrees.items():
        if degree > 1 and name in UNSUPPORTED:
            raise ValueError(
                f"parallelism.{name}_parallel_degree = {degree}: not supported: "
                f"{UNSUPPORTED[name]}. FSDP/HSDP/DDP, tensor and pipeline parallelism "
                "(flavor native) and expert parallelism (flavor qwen3, MoE) are"
            )
    if degrees["tensor"] > 1 and not family.tensor_parallel:
        raise ValueError(
            f"parallelism.tensor_parallel_degree = {degrees['tensor']} needs a backbone with a "
            f'tensor-parallel plan: set model.flavor = "native" (torchtitan\'s llama3 blocks) '
            f"instead of {family.name!r}"
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """torchtitan's own llama3 plan on the decoder (its blocks and final norm, with sequence
    parallelism; the plan's embedding and output entries have no counterpart here and are
    skipped), the rest (embeddings, head) replicated on the tensor-parallel mesh, so every
    parameter lives on one mesh (gradient clipping, FSDP on top). The head then computes the
    exact loss on the full sequence on every tensor-parallel rank."""
    import warnings

    from torch.distributed.tensor import distribute_module

    # distributing a parameter makes a new one that requires grad: keep LoRA's frozen ones
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    adapted = unwrap_lora(model)  # torchtitan's plan names the nn.Linears themselves
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Parallelize plan key")
        upstream.apply_tp(
            model.backbone, tp_mesh, loss_parallel=False, enable_float8_tensorwise_tp=False
        )
    for name, layer in adapted.items():
        model.backbone.set_submodule(name, layer)
        shard_lora(layer, tp_mesh)
    model.backbone.tp_mesh = tp_mesh
    for module in (model.tok_embeddings, model.head):
        if module is not None:  # None: a pipeline stage without it
            distribute_module(module, tp_mesh)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)


def unwrap_lora(model: nn.Module) -> dict[str, nn.Module]:
    """Put each LoRA layer's base nn.Linear back in its place (for torchtitan's TP plan);
    returns {name: LoRA layer} to put back after."""
    layers = lora_layers(model) if model.args.lora else {}
    for name, layer in layers.items():
        model.backbone.set_submodule(name, layer.get_base_layer())
    return layers


def shard_lora(layer: nn.Module, tp_mesh) -> None:
    """Shard a LoRA layer's adapters to match its tensor-parallel base layer (torchtitan's
    plan, sequence parallel): beside a column-wise base (input replicated, output features
    sharded) A is replicated and B column-wise; beside a row-wise base (input features sharded,
    output sharded over the sequence) A is row-wise (its r outputs all-reduced) and B replicated,
    its output split over the sequence like the base's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    a, b = layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]
    if layer.get_base_layer().weight.placements[0] == Shard(0):  # column-wise
        parallelize_module(a, tp_mesh, upstream.NoParallel())
        parallelize_module(b, tp_mesh, ColwiseParallel())
    else:
        parallelize_module(a, tp_mesh, RowwiseParallel(output_layouts=Replicate()))
        parallelize_module(b, tp_mesh, upstream.NoParallel(output_layout=Shard(1)))


def apply_freeze(model: nn.Module, prefixes: list[str]) -> None:
    """requires_grad=False for parameters under the given prefixes (the optimizer skips them)."""
    for prefix in prefixes:
        hits = [p for n, p in model.named_parameters() if n == prefix or n.startswith(prefix + ".")]
        if not hits and not model.is_pipeline_stage:  # a stage may hold none of them
            raise ValueError(
                f"speechlm.freeze entry {prefix!r} matches no parameter; names look like "
                "tok_embeddings, backbone.layers.0, backbone.norm, head.output, head.stream_emb"
            )
        for p in hits:
            p.requires_grad_(False)
        if hits:
            logger.info("Froze %d parameters under %s", len(hits), prefix)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks (``backbone.layers``: a ModuleList or, for torchtitan's blocks, a
    ModuleDict)."""
    layers = model.backbone.layers
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def apply_compile(model: nn.Module, backend: str) -> None:
    """Compile each decoder layer separately: repeated structure compiles once (and each audio
    encoder layer, the same way)."""
    stacks = [model.backbone.layers]
    if model.audio_encoder is not None:
        stacks.append(model.audio_encoder.encoder.layers)
    for layers in stacks:
        for layer_id, block in layers.named_children():
            layers.register_module(layer_id, torch.compile(block, backend=backend))
    logger.info("Compiled each decoder layer with torch.compile (backend=%s)", backend)
    if model.audio_encoder is not None:
        logger.info("Compiled each audio encoder layer with torch.compile (backend=%s)", backend)


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    experts: tuple | None = None,
) -> None:
    """``experts``: (efsdp mesh, EP degree) with expert parallelism: each MoE block's routed
    experts become a unit of their own on that mesh (distributed/expert_parallel.py)."""
    config = {"mesh": dp_mesh, "mp_policy": MixedPrecisionPolicy(param_dtype, reduce_dtype)}
    if cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy()
    for block in blocks(model):
        if experts is not None and getattr(block, "moe_enabled", False):
            shard_experts(block, experts[0], config, experts[1], reshard_after_forward)
        fully_shard(block, **config, reshard_after_forward=reshard_after_forward)
    # The root's inputs stay as the loader made them: FSDP would cast the float ones (loss
    # weights, data statistics such as frame counts) to bf16, which cannot hold 513 exactly.
    # The embeddings' output is already in the compute dtype; each block casts its input.
    root_policy = MixedPrecisionPolicy(param_dtype, reduce_dtype, cast_forward_inputs=False)
    if model.audio_encoder is not None:
        for layer in model.audio_encoder.encoder.layers:
            fully_shard(layer, **config, reshard_after_forward=reshard_after_forward)
        # its inputs: the embeddings (already in the compute dtype) and fp32/int16 waveforms,
        # whose log-mel is computed in fp32 before the first convolution casts it
        fully_shard(model.audio_encoder, **{**config, "mp_policy": root_policy})
    if not model.args.tie_embeddings:
        if model.tok_embeddings is not None:  # None: a later pipeline stage
            fully_shard(model.tok_embeddings, **config, reshard_after_forward=reshard_after_forward)
        if model.head is not None:
            # The head runs last; resharding it right before backward needs it again is waste.
            fully_shard(model.head, **config, reshard_after_forward=False)
    fully_shard(model, **{**config, "mp_policy": root_policy})
    disable_fsdp_gradient_division(model)
    force_sum_reduction_on_cpu(model)
