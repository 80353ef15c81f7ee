"""Validation over any number of named sets, with the training statistics' exact normalisation.

torchtitan's stock Validator knows one text dataset and keeps its iterator between rounds. Ours
rebuilds each set's iterator every round (same batches in the same order each time), never
applies training-only augmentation, and keeps ranks in lock-step without dropping data: a rank
whose shard is exhausted runs zero-weight copies of its last batch while the others finish (FSDP
needs every rank in every forward). Logged as ``val/{set}/{key}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_speechlm.components.stats import StatsAccumulator, loss_group
from torchtitan_speechlm.data.planner import Unit
from torchtitan_speechlm.utils.upstream import BaseValidator, logger


class SpeechLMValidator(BaseValidator):
    """``sets``: each validation set's name and a function making a fresh pass over it (an
    iterable of ``(inputs, labels)`` micro-batches with ``collate(unit)``, the stream's or an
    external data object's), given by the spec's builder."""

    def __init__(
        self,
        job_config,
        dp_world_size,
        dp_rank,
        parallel_dims,
        maybe_enable_amp,
        metrics_processor,
        validation_context,
        *,
        sets: dict[str, Callable[[], Any]],
        stats_keys: tuple[str, ...],
        step_codec: Callable[[dict], dict] | None = None,
        **kwargs,
    ):
        super().__init__(job_config)
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.parallel_dims = parallel_dims
        self.amp = maybe_enable_amp
        self.context = validation_context
        self.metrics_processor = metrics_processor
        self.stats_keys = stats_keys
        self.sets = sets
        self.step_codec = step_codec  # tokenises a batch's waveforms (components/step_codec.py)
        if not self.sets:
            raise ValueError(
                "validation.enable = true but there is nothing to validate on: set "
                "speechlm_data.valid (TASK:NAME entries) or speechlm_data.valid_fraction > 0"
            )
        for make in self.sets.values():  # fail now, not at the first validation round
            make()

    def _any_rank_has(self, has: bool, device) -> bool:
        flag = torch.tensor([1.0 if has else 0.0], device=device)
        group = loss_group(self.parallel_dims)
        if group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    @torch.no_grad()
    def validate(self, model_parts, step: int) -> None:
        model = model_parts[0]
        device = next(model.parameters()).device
        max_steps = self.job_config.validation.steps
        model.eval()
        for name in self.sets:
            acc = StatsAccumulator(self.stats_keys)
            ds = self.sets[name]()  # a fresh pass: the same batches in the same order
            # a rank whose share is exhausted (or empty) runs this all-padding, zero-weight batch
            last = ds.collate(Unit(rows=[[]], t=8))
            it, n = iter(ds), 0
            while max_steps < 0 or n < max_steps:
                batch = next(it, None)
                if not self._any_rank_has(batch is not None, device):
                    break
                n += 1
                real = batch is not None
                if real:
                    last = batch
                inputs, _ = batch if real else last
                inputs = {k: v.to(device) for k, v in inputs.items()}
                if self.step_codec is not None:
                    self.step_codec(inputs, timed=False)
                if not real:
                    inputs["loss_weights"] = torch.zeros_like(inputs["loss_weights"])
                    inputs["data_stats"] = torch.zeros_like(inputs["data_stats"])
                with self.context(), self.amp:
                    out = model(inputs.pop("input"), **inputs)
                if not real and "data/audio_clips" in out.stats:  # a stand-in's clips count 0
                    out.stats["data/audio_clips"] = torch.zeros_like(out.stats["data/audio_clips"])
                # every rank adds (zeros for a stand-in batch) so all ranks hold the same keys
                # and meet in the same all-reduce below
                acc.add(out.stats, count_micro_batch=real)
            stats = acc.reduce(loss_group(self.parallel_dims))
            stats.pop("data/audio_clips_per_frame", None)  # MFU's, not a validation metric
            self.metrics_processor.logger.log(
                {f"val/{name}/{k}": v for k, v in stats.items()}, step
            )
            logger.info(
                f"validate step {step} [{name}] loss: {stats.get('loss', float('nan')):.4f}  "
                f"acc_layer0: {stats.get('acc_layer0', float('nan')):.3f}  "
                f"frames: {int(stats.get('loss_frames', 0))}  batches: {n}"
            )
        model.train()
