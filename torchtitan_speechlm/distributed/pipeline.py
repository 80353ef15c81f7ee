"""Pipeline parallelism: the SpeechLM cut into stages for torchtitan's pipeline schedules.

This is the TrainSpec's ``pipelining_fn``. torchtitan's ``pipeline_llm`` cannot cut the SpeechLM
as it is, because it only splits top-level children (``layers.N``) and our decoder blocks sit one
level down (``backbone.layers.N``, the DCP keys every checkpoint has). So this function does
``pipeline_llm``'s job with torchtitan's own pieces, changing only the split:

- stages per rank and the layers of each stage: torchtitan's rules and its
  ``generate_llm_fqn_per_model_part`` (or ``parallelism.module_fqns_per_model_part``), in its
  vocabulary: ``tok_embeddings`` (the summed stream embeddings), ``layers.N``, ``norm`` (the
  decoder's final norm), ``output`` (the per-stream head and its chunked loss);
- each stage a deep copy of the (meta) model with the others' blocks deleted and the missing
  parts set to None, so parameter names stay those of the whole model: a pipeline checkpoint
  is the same DCP checkpoint as any other and reshards to any layout;
- torch's ``PipelineStage`` per stage, the run's parallelize function per stage (FSDP2, TP,
  activation checkpointing, compile), torchtitan's ``build_pipeline_schedule``.

The seam. Every stage gets the micro-batch's ``position_ids``, ``targets`` and ``loss_weights``
(the trainer passes them as torchtitan's stage-forwarded ``extra_kwargs``, trainer/trainer.py),
so packed rows keep their documents and positions in every stage. The last stage returns its
loss sum as a [1] tensor and keeps its statistics (``SpeechLM.stage_forward``); ``StageLoss``,
the schedule's loss function, takes them back, hands them to the run's loss (statistics and step guard,
exactly as without pipelining) and returns the sum in the form the schedule backpropagates
(``compat.pipeline_stage_loss``, fix 10). The head's chunked loss never builds full fp32
logits, on any stage.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    get_schedule_class,
)

from torchtitan_speechlm.components.loss import SpeechLMLoss
from torchtitan_speechlm.distributed.parallelize import apply_freeze
from torchtitan_speechlm.utils.compat import pipeline_stage_loss
from torchtitan_speechlm.utils.upstream import (
    TORCH_DTYPE_MAP,
    build_pipeline_schedule,
    generate_llm_fqn_per_model_part,
    logger,
)

# zero-bubble schedules, whose backward runs in two halves (refused: see stage_layout)
SPLIT_BACKWARD = ("ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV")
# the trainer hands these to every stage (the first also gets the token frames)
STAGE_KWARGS = ("targets", "loss_weights", "position_ids")


def stage_layout(parallelism, n_layers: int) -> tuple[list[list[str]], int]:
    """(module names of every stage, stages per rank): torchtitan's ``pipeline_llm`` rules.
    Raises ValueError naming the ``parallelism`` key when the layers cannot be cut so."""
    p = parallelism
    pp, key = p.pipeline_parallel_degree, "parallelism.pipeline_parallel_schedule"
    try:
        schedule = get_schedule_class(p.pipeline_parallel_schedule)
    except ValueError as e:
        raise ValueError(f"{key} = {p.pipeline_parallel_schedule!r}: {e}") from None
    if p.pipeline_parallel_schedule in SPLIT_BACKWARD:
        raise ValueError(
            f"{key} = {p.pipeline_parallel_schedule!r}: its split backward (input gradients, then "
            "weight gradients) fails on the SpeechLM's stages in torch 2.13 (\"Can't detach "
            'views in-place"); use 1F1B, Interleaved1F1B or GPipe'
        )
    single = issubclass(schedule, PipelineScheduleSingle)
    first, last = (
        p.pipeline_parallel_first_stage_less_layers,
        p.pipeline_parallel_last_stage_less_layers,
    )
    if p.module_fqns_per_model_part:
        names = [list(s) for s in p.module_fqns_per_model_part]
        stages = len(names)
    else:
        if p.pipeline_parallel_layers_per_stage:
            stages = math.ceil((n_layers + first + last) / p.pipeline_parallel_layers_per_stage)
        else:
            stages = pp * (1 if single else 2)
        try:
            names = generate_llm_fqn_per_model_part(stages, n_layers, first, last)
        except ValueError as e:
            raise ValueError(
                f"parallelism.pipeline_parallel_degree = {pp} with {p.pipeline_parallel_schedule} "
                f"cuts the model's {n_layers} layers into {stages} stages: {e} Use fewer stages "
                "(a lower degree, a single-stage schedule such as 1F1B) or a deeper backbone"
            ) from None
    if stages % pp:
        raise ValueError(
            f"parallelism.pipeline_parallel_degree = {pp} does not divide the {stages} stages; "
            "set pipeline_parallel_layers_per_stage (or module_fqns_per_model_part) to a "
            f"multiple of {pp} stages"
        )
    per_rank = stages // pp
    if single and per_rank != 1:
        raise ValueError(
            f"{key} = {p.pipeline_parallel_schedule!r} runs one stage per rank, but the layout "
            f"has {per_rank}; use Interleaved1F1B for several, or {pp} stages"
        )
    if not single and per_rank < 2:
        raise ValueError(
            f"{key} = {p.pipeline_parallel_schedule!r} needs at least 2 stages per rank, the "
            f"layout has {per_rank}; use 1F1B, or more stages"
        )
    check_stage_names(names, n_layers)
    return names, per_rank


def check_stage_names(names: list[list[str]], n_layers: int) -> None:
    """Every layer in exactly one stage, in order; the embeddings first, the norm and the head
    last (ValueError naming parallelism.module_fqns_per_model_part otherwise)."""
    key = "parallelism.module_fqns_per_model_part"
    flat = [n for stage in names for n in stage]
    known = {"tok_embeddings", "norm", "output"} | {f"layers.{i}" for i in range(n_layers)}
    unknown = [n for n in flat if n not in known]
    layers = [int(n.split(".")[1]) for n in flat if n.startswith("layers.")]
    problem = (
        f"unknown names {unknown} (the names are tok_embeddings, layers.0 ... layers."
        f"{n_layers - 1}, norm, output)"
        if unknown
        else "the layers must appear once each, in order"
        if layers != list(range(n_layers))
        else "tok_embeddings must be in the first stage, norm and output in the last"
        if "tok_embeddings" not in names[0] or not {"norm", "output"} <= set(names[-1])
        else "a stage is empty"
        if any(not stage for stage in names)
        else ""
    )
    if problem:
        raise ValueError(f"{key}: {problem}; got {names}")


def stage_indices(stages: int, pp: int, pp_rank: int) -> tuple[int, ...]:
    """The stages rank ``pp_rank`` runs, looped as torchtitan's (r, r + pp, ...); the V-shaped
    schedules are the zero-bubble ones, refused (``SPLIT_BACKWARD``)."""
    return tuple(pp_rank + s * pp for s in range(stages // pp))


def stage_module(whole: nn.Module, names: list[str]) -> nn.Module:
    """A copy of ``whole`` (on the meta device) keeping only ``names``' parts, under the whole
    model's parameter names."""
    part = copy.deepcopy(whole)
    keep = {n.split(".", 1)[1] for n in names if n.startswith("layers.")}
    for key in list(part.backbone.layers.keys()):
        if key not in keep:
            del part.backbone.layers[key]
    if "tok_embeddings" not in names:
        part.tok_embeddings = None
        part.audio_encoder = None
    if "norm" not in names:
        part.backbone.norm = None
    if "output" not in names:
        part.head = None
    return part


class StageLoss:
    """The schedule's ``loss_fn(output, target)`` on the last stage: unpacks the stage's
    output, reports it to the run's loss (statistics, step guard) as one process would, and
    returns the loss sum with the gradient of sum / global loss frames (fix 10)."""

    def __init__(self, loss: SpeechLMLoss, last_stage: nn.Module):
        self.loss, self.last_stage = loss, last_stage

    def __call__(
        self, output: torch.Tensor, labels: torch.Tensor, global_valid_tokens=None
    ) -> torch.Tensor:
        """``global_valid_tokens``: given by a torchtitan that passes it to the schedule's
        loss (patches/0010), which then divides no more after the step."""
        pred = self.last_stage.take_stage_output(output)
        if pred is None:  # DPO's reference pass (trainer/preference_reference.py): no loss
            return output.sum()
        loss_sum = self.loss(pred, labels, count_micro_batch=False)
        if global_valid_tokens is not None:
            return loss_sum / global_valid_tokens
        return pipeline_stage_loss(loss_sum, self.loss.global_valid_tokens)


def stage_examples(job_config, parallel_dims, model_args, device) -> tuple[torch.Tensor, ...]:
    """Tensors shaped like a microbatch's token frames, the hidden states between stages and
    the last stage's output: the stages' static shapes. Given to torch's ``PipelineStage``,
    they spare its metadata inference, which runs a forward, the loss function and a backward
    on uninitialised hidden states (their statistics and loss would reach the run's).
    Packed rows make every micro-batch ``training.seq_len`` frames long (check_pipeline)."""
    t = job_config.training
    rows = job_config.parallelism.pipeline_parallel_microbatch_size
    dtype = TORCH_DTYPE_MAP[
        t.mixed_precision_param if parallel_dims.fsdp_enabled else t.dtype
    ]  # what the blocks compute in: FSDP's mixed precision, or the parameters' dtype
    frames = torch.empty(rows, t.seq_len, model_args.layout.num_streams, dtype=torch.long)
    hidden = torch.empty(rows, t.seq_len, model_args.hidden_size, dtype=dtype, device=device)
    loss = torch.empty(1, dtype=torch.float32, device=device)
    # gradients flow back through the hidden states (and from the loss)
    return frames.to(device), hidden.requires_grad_(), loss.requires_grad_()


def pipeline_speechlm(
    model: nn.Module,
    parallel_dims,
    job_config,
    device: torch.device,
    model_args,
    parallelize_fn,
    loss_fn: SpeechLMLoss,
):
    """TrainSpec.pipelining_fn: (schedule, model parts, has first stage, has last stage), as
    torchtitan's ``pipeline_llm`` returns them."""
    p = job_config.parallelism
    pp_mesh = parallel_dims.get_mesh("pp")
    names, _ = stage_layout(p, len(model.backbone.layers))
    # on the whole model: a stage may hold none of a prefix's parameters, the model must
    apply_freeze(model, model.args.freeze)
    stages, parts = [], []
    example = stage_examples(job_config, parallel_dims, model_args, device)
    for idx in stage_indices(len(names), pp_mesh.size(), pp_mesh.get_local_rank()):
        part = stage_module(model, names[idx])
        logger.info(f"PP rank {pp_mesh.get_local_rank()} runs stage {idx}: {names[idx]}")
        first, last = idx == 0, idx == len(names) - 1
        stages.append(
            PipelineStage(
                part,
                idx,
                len(names),
                device,
                input_args=example[0] if first else example[1],
                output_args=example[2] if last else example[1],
                group=pp_mesh.get_group("pp"),
            )
        )
        parts.append(part)
    for i, part in enumerate(parts):
        parts[i] = parallelize_fn(part, parallel_dims, job_config)
        stages[i].submod = parts[i]
    last = [m for m, s in zip(parts, stages, strict=True) if s.is_last]
    schedule_loss = StageLoss(loss_fn, last[0]) if last else loss_fn
    schedule = build_pipeline_schedule(job_config, stages, schedule_loss)
    return schedule, parts, any(s.is_first for s in stages), bool(last)


def check_pipeline(job_config, family, backbone_config: dict, model_args) -> None:
    """Refuse before any rank starts, naming the key and the fix, what a pipeline cannot run
    (ValueError); nothing falls back to another layout."""
    p, t = job_config.parallelism, job_config.training
    pp = p.pipeline_parallel_degree
    if pp <= 1:
        return
    key = f"parallelism.pipeline_parallel_degree = {pp}"
    if not family.pipeline_parallel:
        raise ValueError(
            f"{key} needs a backbone whose blocks run as separate stages: set model.flavor = "
            f'"native" (torchtitan\'s llama3 blocks); {family.name!r} runs its decoder as one call '
            "(transformers computes the rotary embedding and the masks once for all layers)"
        )
    if family.moe(backbone_config):
        raise ValueError(
            f"{key}: the MoE load-balance loss does not cross stages yet; use expert parallelism"
        )
    if p.data_parallel_replicate_degree > 1:
        raise ValueError(
            f"{key} with parallelism.data_parallel_replicate_degree = "
            f"{p.data_parallel_replicate_degree}: combine pipelines with FSDP "
            "(data_parallel_shard_degree) instead; torch's schedule and the replicas' gradient "
            "sync would each decide which backward reduces"
        )
    refusals = {
        "model_args.tie_embeddings": (
            model_args.tie_embeddings,
            "tied embeddings live in the first stage and the head in the last: set "
            'speechlm.tie_embeddings = "false"',
        ),
        "audio_encoder": (
            bool(model_args.audio_encoder),
            "continuous audio segments are indexed across the whole micro-batch and cannot be "
            "cut into pipeline microbatches: remove [audio_encoder] or train without a pipeline",
        ),
        "speechlm_data.batching": (
            job_config.speechlm_data.batching != "pack",
            "bucket micro-batches change their rows and length every step, and pipeline stages "
            'exchange fixed shapes: set speechlm_data.batching = "pack"',
        ),
        "validation.enable": (
            job_config.validation.enable,
            "validation runs the whole model in one call: set validation.enable = false and "
            "score the checkpoints with `torchtitan eval` (it reads pipeline checkpoints)",
        ),
        "speechlm.sample_every": (
            job_config.speechlm.sample_every > 0,
            "training samples decode with the whole model: set speechlm.sample_every = 0",
        ),
    }
    for name, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"{key} with {name}: {why}")
    names, per_rank = stage_layout(p, family.num_layers(backbone_config))
    mb = p.pipeline_parallel_microbatch_size
    if mb < 1 or t.local_batch_size % mb:
        raise ValueError(
            f"parallelism.pipeline_parallel_microbatch_size = {mb} must divide "
            f"training.local_batch_size = {t.local_batch_size}"
        )
    micro = t.local_batch_size // mb
    schedule = get_schedule_class(p.pipeline_parallel_schedule)
    if issubclass(schedule, PipelineScheduleSingle) and micro < len(names):
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {p.pipeline_parallel_schedule!r} needs "
            f"at least as many microbatches as stages ({len(names)}); training.local_batch_size "
            f"{t.local_batch_size} / pipeline_parallel_microbatch_size {mb} gives {micro}: "
            "raise the local batch or lower the microbatch size"
        )
    rounds = max(1, micro // pp)
    if not issubclass(schedule, PipelineScheduleSingle) and micro % rounds:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {p.pipeline_parallel_schedule!r} runs "
            f"microbatches in rounds of {pp}: {micro} microbatches (training.local_batch_size / "
            "pipeline_parallel_microbatch_size) must be a multiple of a round count; use a "
            f"multiple of {pp}"
        )
