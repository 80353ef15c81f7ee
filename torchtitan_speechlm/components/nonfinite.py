"""Catch a NaN/Inf loss or gradient before the optimizer step, and log loss spikes.

torchtitan's ``train_step`` clips gradients and steps the optimizer with no check: one NaN
batch poisons the weights (and every checkpoint after it), so the run is lost back to the
last checkpoint before it, which keep_latest_k may already have deleted. This guard sits in
the one place every step passes through before the update without copying the loop: the
optimizer container's ``step`` (our ``build_optimizers_fn`` wraps it).

Per step it all-reduces three numbers over all ranks (the local loss sum, the local count of
loss frames and the sum of the local gradient shards' norms), so every rank takes the same
decision: a non-finite loss or gradient anywhere means no rank updates. Policy
(``[speechlm_faults]``): ``skip`` the update (counted, logged with the batch's sample ids, at
most ``max_consecutive_skips`` in a row) or ``stop`` with an error naming the step and the
samples. A finite loss above ``loss_spike_factor`` x the running median is logged with its
sample ids and trained. The cost is that small all-reduce and one pass over the gradients.

The step number comes from the LR scheduler (restored by checkpoints), so it is the trainer's
step also after a resume. The guard is one object of the run's ``TrainingState``
(training_state.py), which the loss function and the training loader report to.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.utils.upstream import logger

SPIKE_MIN_HISTORY = 5  # steps in the running median before spikes are looked for
ANOMALIES = "anomalies.jsonl"


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient; the message names step and samples."""


@dataclass(frozen=True)
class GuardSettings:
    """``[speechlm_faults]``: what a non-finite step does and when a loss is a spike."""

    policy: str = "skip"
    max_consecutive: int = 5
    spike_factor: float = 0.0
    spike_window: int = 50

    @classmethod
    def from_config(cls, faults) -> GuardSettings:
        """The section's values, checked (ConfigError naming the key and the fix)."""
        if faults.max_consecutive_skips < 1:
            raise ConfigError(
                f"speechlm_faults.max_consecutive_skips = {faults.max_consecutive_skips}: must "
                "be >= 1 (to stop at the first non-finite step, set speechlm_faults.nonfinite = "
                '"stop")'
            )
        if faults.loss_spike_factor != 0 and faults.loss_spike_factor <= 1:
            raise ConfigError(
                f"speechlm_faults.loss_spike_factor = {faults.loss_spike_factor}: must be > 1 "
                "(times the running median loss), or 0 to turn spike logging off"
            )
        if faults.loss_spike_window < 1:
            raise ConfigError("speechlm_faults.loss_spike_window must be >= 1")
        return cls(
            faults.nonfinite,
            faults.max_consecutive_skips,
            faults.loss_spike_factor,
            faults.loss_spike_window,
        )


class StepGuard:
    """One run's check before each optimizer step (built with the run's TrainingState): the loss
    function reports each training micro-batch's loss, the loader its sample ids, the LR
    scheduler container gives the step number; ``allow_update`` decides."""

    def __init__(self, settings: GuardSettings | None = None, dump_folder: str | None = None):
        settings = settings or GuardSettings()
        self.policy = settings.policy
        self.max_consecutive = settings.max_consecutive
        self.spike_factor = settings.spike_factor
        self.history: deque[float] = deque(maxlen=settings.spike_window)
        self.dump_folder = dump_folder
        self.schedulers = None  # the LR scheduler container, for the step number
        self._calls = 0
        self.skipped = self.consecutive = self.spikes = 0
        self._reset_step()

    def _reset_step(self) -> None:
        self._loss: torch.Tensor | None = None
        self._count: torch.Tensor | None = None
        self._ids: list[str] = []

    # ---- reports from the loader and the loss --------------------------------------------------
    def note_micro_batch(self, ids: list[str]) -> None:
        self._ids.extend(ids)

    def note_loss(self, loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Record a training micro-batch's loss sum (returned for the backward)."""
        loss = loss_sum.detach().double()
        count = (labels != -100).sum().double()
        self._loss = loss if self._loss is None else self._loss + loss
        self._count = count if self._count is None else self._count + count
        return loss_sum

    # ---- the check ----------------------------------------------------------------------------
    def step(self) -> int:
        """The trainer step being trained (1-based)."""
        if self.schedulers is not None and self.schedulers.schedulers:
            return int(self.schedulers.schedulers[0].last_epoch) + 1
        return self._calls + 1

    def metrics(self) -> dict[str, float]:
        return {"reliability/skipped_steps": self.skipped, "reliability/loss_spikes": self.spikes}

    def allow_update(self, params: list[torch.Tensor]) -> bool:
        """True if the optimizer may step; False to skip; raises NonFiniteError to stop."""
        step = self.step()
        self._calls += 1
        local = local_gradients(params)
        device = local[0].device if local else torch.device("cpu")
        grad_norms = (
            torch.stack(torch._foreach_norm(local)).double().sum()
            if local
            else torch.zeros((), dtype=torch.float64, device=device)
        )
        zero = torch.zeros((), dtype=torch.float64, device=device)
        loss = self._loss.to(device) if self._loss is not None else zero
        count = self._count.to(device) if self._count is not None else zero
        values = torch.stack([loss, count, grad_norms])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values)
        loss_sum, count, grad_norms = values.tolist()
        ids = self._ids
        self._reset_step()
        mean = loss_sum / count if count > 0 else 0.0
        if math.isfinite(mean) and math.isfinite(grad_norms):
            self.consecutive = 0
            self._check_spike(step, mean, ids)
            return True
        what = "loss" if not math.isfinite(mean) else "gradient"
        self.skipped += 1
        self.consecutive += 1
        samples = self._gather(ids)
        self._record(step, f"nonfinite_{what}", mean, samples)
        where = f"step {step}: non-finite {what} (loss {mean}, gradient norm sum {grad_norms})"
        if self.policy == "stop" or self.consecutive >= self.max_consecutive:
            reason = (
                'speechlm_faults.nonfinite = "stop"'
                if self.policy == "stop"
                else f"{self.consecutive} non-finite steps in a row "
                f"(speechlm_faults.max_consecutive_skips = {self.max_consecutive})"
            )
            raise NonFiniteError(
                f"{where}; stopped ({reason}) before the optimizer step, so the weights are "
                f"those of step {step - 1}. Samples of the batch: {_short_ids(samples)}. Check "
                "these samples, lower optimizer.lr or training.max_norm, or set "
                'speechlm_faults.nonfinite = "skip"; a rerun resumes from the newest checkpoint'
            )
        logger.warning(
            f"{where}: optimizer step skipped ({self.consecutive} in a row, {self.skipped} "
            f"in this run). Samples: {_short_ids(samples)}"
        )
        return False

    def _check_spike(self, step: int, loss: float, ids: list[str]) -> None:
        history = self.history
        if self.spike_factor > 0 and len(history) >= SPIKE_MIN_HISTORY:
            median = statistics.median(history)
            if loss > self.spike_factor * median:
                self.spikes += 1
                samples = self._gather(ids)
                self._record(step, "loss_spike", loss, samples, median=median)
                logger.warning(
                    f"step {step}: loss spike {loss:.4f} > {self.spike_factor} x running median "
                    f"{median:.4f} (trained normally). Samples: {_short_ids(samples)}"
                )
        history.append(loss)

    @staticmethod
    def _gather(ids: list[str]) -> list[str]:
        """Every rank's sample ids of this step (all ranks call this together)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return list(ids)
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, list(ids))
        out, seen = [], []
        for part in parts:  # tensor/pipeline peers of a data-parallel rank report its samples
            if part not in seen:
                seen.append(part)
                out += part
        return out

    def _record(self, step: int, kind: str, loss: float, samples: list[str], **extra) -> None:
        if self.dump_folder is None or (dist.is_initialized() and dist.get_rank() != 0):
            return
        os.makedirs(self.dump_folder, exist_ok=True)
        row = {"step": step, "kind": kind, "loss": loss if math.isfinite(loss) else str(loss)}
        row.update(extra, samples=samples)
        with open(os.path.join(self.dump_folder, ANOMALIES), "a") as f:
            f.write(json.dumps(row) + "\n")


def local_gradients(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's (non-empty) shards of the parameters' gradients."""
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return [g for g in local if g.numel()]


def _short_ids(ids: list[str], limit: int = 32) -> str:
    more = f" ... and {len(ids) - limit} more (all in anomalies.jsonl)" if len(ids) > limit else ""
    return ", ".join(ids[:limit]) + more


def guard_optimizers(optimizers, model_parts, guard: StepGuard) -> None:
    """Make ``optimizers.step()`` run only when ``guard.allow_update`` agrees."""
    params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
    inner = optimizers.step

    def step(*args, **kwargs):
        if guard.allow_update(params):
            return inner(*args, **kwargs)
        return None

    optimizers.step = step
