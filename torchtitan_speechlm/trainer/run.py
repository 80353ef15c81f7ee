"""One SpeechLM run: what its job config resolves to, checked, and the state it trains with.

``prepare_run`` is what every process does with a SpeechLM job before anything is built: the
launcher, to refuse a bad job before any rank starts (commands/train.py), and each rank's
trainer. ``start_run`` is a rank's: prepared, its model recorded in the dump folder, and its
training state made (components/training_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_speechlm.components.nonfinite import GuardSettings
from torchtitan_speechlm.components.resume import resolve_resume
from torchtitan_speechlm.components.training_state import TrainingState
from torchtitan_speechlm.data.collation import data_stats_keys
from torchtitan_speechlm.data.external import ExternalData
from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.run_record import record_run
from torchtitan_speechlm.trainer.checks import validate_job_config
from torchtitan_speechlm.trainer.plan import RunPlan


@dataclass
class SpeechLMRun:
    """One run, built once by its trainer: the job config, what it resolved to, the model args,
    and the training state the loss, metrics, optimizers and loader share."""

    job_config: object
    plan: RunPlan
    model_args: SpeechLMModelArgs
    state: TrainingState


def prepare_run(
    job_config, external: ExternalData | None = None
) -> tuple[RunPlan, SpeechLMModelArgs, GuardSettings]:
    """Resolve and check a SpeechLM job (every process: the launcher and each rank), and point
    torchtitan's ``checkpoint.load_step`` at the checkpoint to resume from."""
    plan = RunPlan.resolve(job_config, external)
    validate_job_config(job_config, plan)
    guard = GuardSettings.from_config(job_config.speechlm_faults)
    model_args = plan.model_args(job_config)
    resolve_resume(job_config, model_args)  # before torchtitan's checkpointer picks a step
    return plan, model_args, guard


def start_run(job_config, external: ExternalData | None = None) -> SpeechLMRun:
    """A rank's run: prepared, its model recorded in the dump folder, its state made."""
    plan, model_args, guard = prepare_run(job_config, external)
    record_run(
        job_config,
        model_args,
        backbone_path=plan.backbone_path,
        codec=plan.codec,
        tokenizer=next(iter(plan.data.metadata.values()))["tokenizer"],
        datasets=plan.data.datasets,
    )
    state = TrainingState.create(
        data_stats_keys(plan.num_streams), guard, job_config.job.dump_folder
    )
    return SpeechLMRun(job_config, plan, model_args, state)
