"""One SpeechLM run: what its job config resolves to, checked, and the state it trains with.

``prepare_run`` is what every process does with a SpeechLM job before anything is built: the
launcher, to refuse a bad job before any rank starts (commands/train.py), and each rank's
trainer. ``start_run`` is a rank's: prepared, its model recorded in the dump folder, and its
training state made (components/training_state.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torchtitan_speechlm.components.nonfinite import GuardSettings
from torchtitan_speechlm.components.resume import (
    DataIdentity,
    ResumeError,
    check_checkpoint_identity,
    resolve_resume,
    run_identity,
)
from torchtitan_speechlm.components.step_codec import StepCodec
from torchtitan_speechlm.components.training_state import TrainingState
from torchtitan_speechlm.data.collation import data_stats_keys
from torchtitan_speechlm.data.external import ExternalData
from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.run_record import record_run
from torchtitan_speechlm.trainer.checks import validate_job_config
from torchtitan_speechlm.trainer.plan import RunPlan
from torchtitan_speechlm.utils.checkpoint_folders import checkpoint_folder, complete_checkpoints
from torchtitan_speechlm.utils.checkpoint_manifest import LEGACY, set_identity, verify
from torchtitan_speechlm.utils.upstream import logger


@dataclass
class SpeechLMRun:
    """One run, built once by its trainer: the job config, what it resolved to, the model args,
    the training state the loss, metrics, optimizers and loader share, and what tokenises a
    Python data object's waveforms in the step (None: its batches hold codes)."""

    job_config: object
    plan: RunPlan
    model_args: SpeechLMModelArgs
    state: TrainingState
    step_codec: StepCodec | None = None


def prepare_run(
    job_config, external: ExternalData | None = None
) -> tuple[RunPlan, SpeechLMModelArgs, GuardSettings]:
    """Resolve and check a SpeechLM job (every process: the launcher and each rank), and point
    torchtitan's ``checkpoint.load_step`` at the checkpoint to resume from, once it is known
    to hold what this run's data means (its identity)."""
    plan = RunPlan.resolve(job_config, external)
    validate_job_config(job_config, plan)
    guard = GuardSettings.from_config(job_config.speechlm_faults)
    model_args = plan.model_args
    choose_intact_step(job_config)  # before anything reads a checkpoint's .metadata
    resolve_resume(job_config, model_args, DataIdentity.of(plan.data))  # before torchtitan's
    check_checkpoint_identity(job_config, identity_of(plan))  # checkpointer reads
    return plan, model_args, guard


def identity_of(plan: RunPlan) -> dict:
    """What this run's checkpoints mean (components/resume.py ``run_identity``)."""
    return run_identity(DataIdentity.of(plan.data), plan.order, plan.layout.fingerprint())


VERIFIED_ENV = "TORCHTITAN_SPEECHLM_VERIFIED"  # "{step folder}": the launcher checked it


def choose_intact_step(job_config, warn=None) -> None:
    """Check the checkpoint a resume would load against its manifest
    (utils/checkpoint_manifest.py). A damaged step is named (the file and what differs) and
    the newest intact one is loaded instead, with a warning (``checkpoint.load_step`` is set to
    it); a damaged step the user asked for (``checkpoint.load_step = N``) is refused. A step
    without a manifest loads with a warning only when it was written before manifests (no
    sibling step has one: ``verify``); otherwise it is damaged too.

    The launcher sums every file; its ranks then check the sizes only of the step it chose
    (``TORCHTITAN_SPEECHLM_VERIFIED``), not reading the checkpoint once per rank."""
    ckpt = job_config.checkpoint
    if not ckpt.enable:
        return
    warn = warn or logger.warning
    folder = checkpoint_folder(job_config)
    steps = complete_checkpoints(folder)
    if ckpt.load_step > 0 and ckpt.load_step in steps:
        candidates, explicit = [ckpt.load_step], True
    elif ckpt.load_step < 0:
        candidates, explicit = list(reversed(steps)), False
    else:
        return
    if not candidates:
        return
    damaged = []
    for step in candidates:
        path = os.path.join(folder, f"step-{step}")
        verified = os.environ.get(VERIFIED_ENV) == os.path.abspath(path)
        problem = verify(path, checksums=not verified)
        if problem == LEGACY:
            warn(f"{path} has {LEGACY}: loading it unverified")
            problem = ""
        if not problem:
            if damaged:
                warn(
                    f"checkpoint {damaged[0][0]} is damaged: {damaged[0][1]}. "
                    + "".join(f"{p} is damaged too: {why}. " for p, why in damaged[1:])
                    + f"Loading {path}, the newest intact checkpoint, instead (the steps after "
                    f"it are trained again); delete the damaged folder(s) once you no longer "
                    "need them"
                )
                ckpt.load_step = step
            os.environ[VERIFIED_ENV] = os.path.abspath(path)  # the ranks inherit it
            return
        if explicit:
            raise ResumeError(
                f"checkpoint.load_step = {step}: {path} is damaged: {problem}. Choose another "
                f"step (complete: {steps}) or -1 for the newest intact one"
            )
        damaged.append((path, problem))
    raise ResumeError(
        f"every checkpoint in {folder} is damaged ("
        + "; ".join(f"{p}: {why}" for p, why in damaged)
        + f"). Move {folder} away to start over, or restore a copy"
    )


def start_run(job_config, external: ExternalData | None = None) -> SpeechLMRun:
    """A rank's run: prepared, its model recorded in the dump folder, its state made."""
    plan, model_args, guard = prepare_run(job_config, external)
    folder = checkpoint_folder(job_config) if job_config.checkpoint.enable else None
    set_identity(identity_of(plan), folder)  # what its saves record
    record_run(
        job_config,
        model_args,
        backbone_path=plan.backbone_path,
        codec=plan.codec,
        tokenizer=plan.data.tokenizer,
        datasets=plan.data.datasets,
    )
    keys = data_stats_keys(plan.num_streams)
    state = TrainingState.create(keys, guard, job_config.job.dump_folder)
    return SpeechLMRun(job_config, plan, model_args, state, step_codec_of(job_config, plan, keys))


def step_codec_of(job_config, plan: RunPlan, stats_keys: tuple) -> StepCodec | None:
    """The data object's step tokenizer as the run's ``StepCodec``, or None."""
    make = getattr(plan.external, "step_tokenizer", None)
    tokenizer = make(plan.layout, job_config.speechlm.pattern) if callable(make) else None
    if tokenizer is None:
        return None
    codec = StepCodec(tokenizer, plan.layout, stats_keys)
    if int(os.environ.get("RANK", "0")) == 0:
        logger.info(f"Audio tokenised in the training step: {codec.describe()}")
    return codec
