"""One run's shared training state, built once by the trainer and handed to what uses it.

torchtitan's Trainer builds the loss function, the metrics processor, the optimizers and the
data loader separately and never hands one to another. Three things must still meet:

- the statistics: the loss function adds each micro-batch's raw sums, the metrics processor
  reduces them over ranks at log time (stats.py);
- the step guard: the loss function reports each micro-batch's loss, the loader its sample ids,
  the optimizers ask it before every update (nonfinite.py);
- the heartbeat: this rank's counter in the rendezvous store, read when a collective fails to
  name the peer that went silent (heartbeat.py).

They live in this object, made by ``trainer.SpeechLMTrainer`` for its run and passed to each
builder (trainer/builders.py): no process globals, nothing parked on the job config, and two
trainers in one process (the Python API, the tests) never share state.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_speechlm.components.heartbeat import Heartbeat
from torchtitan_speechlm.components.nonfinite import GuardSettings, StepGuard
from torchtitan_speechlm.components.stats import StatsAccumulator


@dataclass
class TrainingState:
    stats: StatsAccumulator
    guard: StepGuard
    heartbeat: Heartbeat

    @classmethod
    def create(
        cls, data_stats_keys: tuple[str, ...], guard: GuardSettings, dump_folder: str
    ) -> TrainingState:
        return cls(StatsAccumulator(data_stats_keys), StepGuard(guard, dump_folder), Heartbeat())
