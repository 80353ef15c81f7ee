"""The global batch in micro-batches: torchtitan's arithmetic, written once.

torchtitan's ``Trainer.__init__`` computes its gradient accumulation steps inline (global batch
``training.global_batch_size``, or local batch x data-parallel degree when it is < 0; steps =
global // (local x dp)), and exposes no function for it. The data stream (which samples form a
step), the DDP/HSDP gradient-sync hook (which backward is the last) and the start-up check of
the layout all need the same number, so they take it from here.
"""

from __future__ import annotations


def global_batch_rows(training, dp_degree: int) -> int:
    """torchtitan's global batch in rows (``global_batch_size``, or local x dp when unset)."""
    if training.global_batch_size > 0:
        return training.global_batch_size
    return training.local_batch_size * dp_degree


def accumulation_steps(training, dp_degree: int) -> int:
    """Micro-batches per optimizer step on each data-parallel rank, as torchtitan's Trainer."""
    return max(1, global_batch_rows(training, dp_degree) // (training.local_batch_size * dp_degree))


def data_parallel_degree(parallelism, world_size: int) -> int:
    """torchtitan's data-parallel degree (replicate x shard, shard = -1 filling the rest)."""
    p = parallelism
    other = p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        shard = world_size // max(1, other * p.data_parallel_replicate_degree)
    return p.data_parallel_replicate_degree * shard
