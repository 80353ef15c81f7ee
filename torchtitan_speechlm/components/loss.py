"""The loss function torchtitan's Trainer calls: ``loss_fn(pred, labels) -> loss sum``.

The SpeechLM computes its weighted multi-stream loss inside ``forward`` (so FSDP reduces the
head's gradients); this function returns that sum unchanged (torchtitan divides it by the
global number of loss frames, ``labels != -100``) and feeds the statistics to the run's
accumulator and the loss to its step guard (a NaN is caught before the optimizer step,
nonfinite.py); both belong to the run's TrainingState (training_state.py).
"""

from __future__ import annotations

import torch

from torchtitan_speechlm.components.nonfinite import StepGuard
from torchtitan_speechlm.components.stats import StatsAccumulator
from torchtitan_speechlm.model.head import SpeechLMOutput


class SpeechLMLoss:
    """``loss_fn(pred, labels)``: the model's loss sum; its statistics go to the run's
    accumulator and (training micro-batches) its loss to the run's step guard."""

    def __init__(self, accumulator: StatsAccumulator | None, guard: StepGuard | None = None):
        self.accumulator = accumulator
        self.guard = guard
        # this micro-batch's global loss frames: the trainer sets it before each step under
        # pipeline parallelism, whose schedule runs backward inside (distributed/pipeline.py)
        self.global_valid_tokens: torch.Tensor | None = None

    def __call__(
        self, pred: SpeechLMOutput, labels: torch.Tensor, count_micro_batch: bool = True
    ) -> torch.Tensor:
        """The loss sum; ``count_micro_batch=False`` for a pipeline microbatch (a piece of
        the loader's micro-batch, which the trainer counts once)."""
        if not isinstance(pred, SpeechLMOutput):
            raise TypeError(
                "SpeechLM loss expects the model to be called with targets and loss_weights "
                "(the speechlm dataloader provides them)"
            )
        if self.accumulator is not None:
            self.accumulator.add(pred.stats, count_micro_batch)
        if self.guard is not None and torch.is_grad_enabled():
            return self.guard.note_loss(pred.loss_sum, labels)
        return pred.loss_sum
