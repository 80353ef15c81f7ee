"""Expert parallelism for MoE backbones built from torchtitan's own MoE layers (``qwen3``).

torchtitan does the work: ``apply_moe_ep_tp`` (its llama4/qwen3 function) puts each MoE layer's
grouped experts on the ``ep`` mesh (experts sharded on dim 0) with its ``ExpertParallel``
all-to-all token dispatch and combine; FSDP2 then shards the experts over what is left of the
data-parallel ranks (``efsdp``) and everything else over all of them (``fsdp``), as torchtitan's
``apply_fsdp`` does. Expert parallelism borrows ranks from data parallelism (torchtitan's
``ParallelDims``: ``ep`` divides ``dp_shard x cp``), so the ranks still train different rows and
the global batch is unchanged. Gradients are summed over ranks (the FSDP gradient divide factor
is 1, as for the dense parameters), so EP equals one process at the same global batch; the
router's load-balance loss is computed on each rank's own rows before dispatch, like the
micro-batch of one process.
"""

from __future__ import annotations

from torch import nn

from torchtitan_speechlm.utils import upstream
from torchtitan_speechlm.utils.compat import permute_tokens_on_cpu


def check_expert_parallel(job_config, family, backbone_config: dict | None) -> None:
    """Refuse (ValueError naming the key and the fix) what expert parallelism cannot run."""
    p = job_config.parallelism
    ep, key = (
        p.expert_parallel_degree,
        f"parallelism.expert_parallel_degree = {p.expert_parallel_degree}",
    )
    if ep <= 1:
        if p.expert_tensor_parallel_degree > 1:
            raise ValueError(
                f"parallelism.expert_tensor_parallel_degree = {p.expert_tensor_parallel_degree} "
                "without expert parallelism: set it to 1"
            )
        return
    if not family.expert_parallel:
        raise ValueError(
            f"{key} needs a backbone built from torchtitan's MoE layers: set model.flavor = "
            f'"qwen3" with a Qwen3-MoE folder; flavor {family.name!r} cannot shard its experts'
        )
    moe = family.moe(backbone_config) if backbone_config is not None else None
    if backbone_config is not None and not moe:
        raise ValueError(
            f"{key}: the backbone at model.hf_assets_path is dense (no experts to shard); use "
            "a Qwen3-MoE folder, or set expert_parallel_degree = 1"
        )
    if moe and moe[0] % ep:
        raise ValueError(
            f"{key} does not divide the backbone's {moe[0]} experts: use a divisor of {moe[0]}"
        )
    if p.expert_tensor_parallel_degree > 1:
        raise ValueError(
            f"parallelism.expert_tensor_parallel_degree = {p.expert_tensor_parallel_degree}: "
            "the qwen3 backbone has no tensor-parallel plan yet; set it to 1"
        )


def apply_expert_parallel(model: nn.Module, parallel_dims) -> None:
    """torchtitan's ``apply_moe_ep_tp`` on the decoder (its ``layers`` are torchtitan's
    blocks, ``moe_enabled`` where they hold an MoE)."""

    permute_tokens_on_cpu()  # compat fix 12
    upstream.apply_moe_ep_tp(
        model.backbone,
        tp_mesh=None,
        ep_mesh=parallel_dims.get_mesh("ep"),
        etp_mesh=None,
        ep_etp_mesh=None,
    )


def shard_experts(block: nn.Module, edp_mesh, config: dict, ep_degree: int, reshard: bool) -> None:
    """FSDP2 on an MoE block's routed experts over ``edp_mesh`` (the data-parallel ranks left
    beside EP), before the block's own unit (torchtitan's ``apply_fsdp``); where EP x efsdp
    exceeds the experts, they are sharded on their second dimension, as torchtitan does."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    experts = block.moe.experts
    placement = None
    if edp_mesh.size() * ep_degree > experts.num_experts:
        placement = lambda param: Shard(1)  # noqa: E731  (torchtitan's own rule)
    fully_shard(
        experts,
        **{**config, "mesh": edp_mesh},
        reshard_after_forward=reshard,
        shard_placement_fn=placement,
    )
