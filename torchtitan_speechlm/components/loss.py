"""The loss function torchtitan's Trainer calls: ``loss_fn(pred, labels) -> loss sum``.

The SpeechLM computes its weighted multi-stream loss inside ``forward`` (so FSDP reduces the
head's gradients); this function returns that sum unchanged (torchtitan divides it by the
global number of loss frames, ``labels != -100``) and feeds the statistics to the accumulator
and the loss to the step guard (a NaN is caught before the optimizer step, nonfinite.py).
"""

from __future__ import annotations

import torch

from torchtitan_speechlm.components.heartbeat import HEARTBEAT
from torchtitan_speechlm.components.nonfinite import STEP_GUARD, StepGuard
from torchtitan_speechlm.components.stats import StatsAccumulator
from torchtitan_speechlm.data.stream import data_stats_keys
from torchtitan_speechlm.model.model import SpeechLMOutput
from torchtitan_speechlm.trainer.run_context import run_context

# torchtitan's Trainer builds the metrics processor and the loss function separately and never
# hands one to the other; this per-process accumulator is their meeting point. One Trainer per
# process, so there is exactly one training accumulator.
TRAIN_STATS = StatsAccumulator()


class SpeechLMLoss:
    def __init__(
        self, accumulator: StatsAccumulator | None = TRAIN_STATS, guard: StepGuard | None = None
    ):
        self.accumulator = accumulator
        self.guard = guard  # sees each training micro-batch's loss (components/nonfinite.py)

    def __call__(self, pred: SpeechLMOutput, labels: torch.Tensor) -> torch.Tensor:
        if not isinstance(pred, SpeechLMOutput):
            raise TypeError(
                "SpeechLM loss expects the model to be called with targets and loss_weights "
                "(the speechlm dataloader provides them)"
            )
        if self.accumulator is not None:
            self.accumulator.add(pred.stats)
        if self.guard is not None and torch.is_grad_enabled():
            return self.guard.note_loss(pred.loss_sum, labels)
        return pred.loss_sum


def build_speechlm_loss(job_config, **kwargs) -> SpeechLMLoss:
    """TrainSpec.build_loss_fn."""
    TRAIN_STATS.data_stats_keys = data_stats_keys(run_context(job_config).num_streams)
    TRAIN_STATS.reset()
    STEP_GUARD.configure(job_config)
    HEARTBEAT.start()  # after init_distributed: names a hung peer if a collective fails
    return SpeechLMLoss(TRAIN_STATS, STEP_GUARD)
