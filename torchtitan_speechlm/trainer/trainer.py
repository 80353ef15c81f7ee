"""``SpeechLMTrainer``: torchtitan's ``Trainer``, its loop unchanged, for one SpeechLM run.

torchtitan's Trainer hands each TrainSpec builder only the job config, so what a run's
builders share (the resolved run, the statistics the loss hands the metrics, the step guard
between loss, loader and optimizers, a Python data object) would have to live in process
globals or be parked on the job config. This subclass instead resolves the run once
(``start_run``: the plan, its checks, the resume decision, the run record, the training state)
and hands torchtitan's ``Trainer.__init__`` the run's TrainSpec (``builders.RunBuilders``: the
registered spec with the run's model args and builders bound to the run; utils/compat.py fix
13 passes it, since torchtitan 0.2.2's Trainer reads its spec from the registry by name). It also starts the run's heartbeat once the process
group is up, and when a collective fails names the peer that went silent.

torchtitan's ``main(trainer_class)`` runs it (commands/train.py), as it runs its experiments'
trainers. A job of another spec (torchtitan's own llama3) runs as the plain Trainer would.
"""

from __future__ import annotations

import logging
import os
import re

import torch
import torch.distributed as dist

from torchtitan_speechlm.data.external import ExternalData
from torchtitan_speechlm.distributed.pipeline import STAGE_KWARGS
from torchtitan_speechlm.model.args import describe_model_args
from torchtitan_speechlm.model.pipeline_pairs import reference_per_frame
from torchtitan_speechlm.trainer.builders import RunBuilders
from torchtitan_speechlm.trainer.checks import master_weights_note
from torchtitan_speechlm.trainer.faults import (
    CollectiveFailure,
    describe_collective_failure,
    is_unexplained_collective_failure,
)
from torchtitan_speechlm.trainer.lifecycle import hold_as_rank, release_rank, track_run
from torchtitan_speechlm.trainer.preference_reference import use_reference_logps
from torchtitan_speechlm.trainer.run import start_run
from torchtitan_speechlm.trainer.spec import is_speechlm
from torchtitan_speechlm.utils import compat
from torchtitan_speechlm.utils.checkpoint_folders import checkpoint_folder
from torchtitan_speechlm.utils.checkpoint_manifest import set_identity
from torchtitan_speechlm.utils.compat import (
    end_train_on_a_barrier,
    init_trainer,
    save_checkpoint_now,
)
from torchtitan_speechlm.utils.upstream import Trainer, get_train_spec, logger

SAVE_AND_STOP = "SAVE_AND_STOP"


def save_request_path(job_config) -> str:
    return os.path.join(job_config.job.dump_folder, SAVE_AND_STOP)


def stop_requested(job_config, device: torch.device) -> bool:
    """Rank 0 looks for the request file; every rank learns its answer (one tiny all-reduce
    per step in a multi-rank run), so all stop after the same step."""
    asked = os.path.exists(save_request_path(job_config)) if _rank() == 0 else False
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([float(asked)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        asked = bool(flag.item() > 0)
    return asked


def withdraw_save_request(job_config) -> None:
    """A request file left from the run before (it stopped, this is its rerun) is removed."""
    if _rank() == 0 and os.path.exists(save_request_path(job_config)):
        os.remove(save_request_path(job_config))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class BatchShapeLine(logging.Filter):
    """torchtitan's start-up line gives the batches' shape from ``training.local_batch_size``
    and ``seq_len``; a Python data object (ESPnet's factories) makes its own batches, which
    its loader's line describes, so those two numbers are left out of it."""

    PREFIX = "Trainer is initialized with local batch size"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.PREFIX):
            found = re.search(r"(gradient accumulation steps \d+).*?(total steps .*)$", message)
            rest = f", {found.group(1)}, {found.group(2)}" if found else ""
            record.msg = f"Trainer is initialized with the batches of the Python data object{rest}"
            record.args = ()
        return True


DENORMALS_KEPT = (
    "CPU threads compute denormal floats (below 1.2e-38) in microcode, about 60x slower: torch's "
    "CPU threads started before the trainer was built, or torch.set_flush_denormal(False) was "
    "called. A long CPU run then slows down as it learns (the speaker-prompt benchmark at step "
    "3,200: 1,650 tokens/s, 3,100 flushed). Fix: torch.set_flush_denormal(True) before the "
    "script's first torch op"
)


class SpeechLMTrainer(Trainer):
    """torchtitan's Trainer with the run resolved once and handed to the spec's builders.

    ``external``: a Python data object to train on instead of ``[speechlm_data]``
    (data/external.py; the Python API's ESPnet iterators)."""

    def __init__(self, job_config, external: ExternalData | None = None):
        compat.flush_denormals_on_cpu()  # fix 23: before torch's CPU threads start
        if is_speechlm(job_config):  # one run per dump folder (trainer/lifecycle.py)
            dump = job_config.job.dump_folder
            hold_as_rank(dump, _rank())
            ckpt = checkpoint_folder(job_config) if job_config.checkpoint.enable else None
            track_run(dump, ckpt, lambda: getattr(self, "step", None))
        self.run = start_run(job_config, external) if is_speechlm(job_config) else None
        if not compat.accelerator_available():  # NCCL's flight recorder: nothing on gloo,
            job_config.comm.trace_buf_size = 0  # so no empty {dump_folder}/comm_traces/ either
        if self.run is not None:
            withdraw_save_request(job_config)
            compat.summarise_model_args(describe_model_args)  # one line, not ~170
            note = master_weights_note(job_config, self.run.plan)
            if note and _rank() == 0:  # bf16 master weights lose updates: a warning
                say = logger.info if job_config.training.dtype == "float32" else logger.warning
                say(note)
        shapes = BatchShapeLine()
        if external is not None:
            logger.addFilter(shapes)
        spec = None
        if self.run is not None:  # the run's spec, built from the registered one
            spec = RunBuilders(self.run).train_spec(get_train_spec(job_config.model.name))
        try:
            init_trainer(super().__init__, job_config, spec)  # compat fix 15
        finally:
            logger.removeFilter(shapes)
        if self.run is not None and not compat.accelerator_available() and _rank() == 0:
            if compat.denormals_flushed():
                logger.info("CPU threads flush denormal floats to zero (compat fix 23)")
            else:
                logger.warning(DENORMALS_KEPT)

    def close(self) -> None:
        try:
            super().close()
        finally:
            release_rank()
            set_identity(None)  # a later run in this process records its own

    def init_distributed(self):
        return self.beating(super().init_distributed())

    def beating(self, parallel_dims):
        """Start the run's heartbeat (the process group is up); returns ``parallel_dims``."""
        if self.run is not None:
            self.run.state.heartbeat.start()
        return parallel_dims

    def should_continue_training(self) -> bool:
        """torchtitan's rule, and stop after a checkpoint of this step when the run was asked
        to (``{dump_folder}/SAVE_AND_STOP``: a preempted SLURM job, or a user)."""
        if self.run is not None and stop_requested(self.job_config, self.device):
            if self.step > 0:
                self.save_now()
            logger.warning(
                f"{save_request_path(self.job_config)} asks the run to stop: step {self.step} "
                "is saved; a rerun with the same dump folder continues from it"
            )
            return False
        return super().should_continue_training()

    def save_now(self) -> None:
        """Save this step in full unless torchtitan just did (a step off the save interval:
        compat fix 16)."""
        last = self.step == self.job_config.training.steps
        save_checkpoint_now(self.checkpointer, self.step, last)

    # ---- pipeline parallelism (distributed/pipeline.py) --------------------------------------
    def post_dataloading_process(self, input_dict, labels):
        """torchtitan's, after a data object's waveforms are tokenised into the rows on this
        device (components/step_codec.py); and with pipeline parallelism what every stage needs
        travels with the microbatch: torchtitan forwards only ``extra_kwargs`` past the first stage, so the
        positions, targets and loss weights move there, and a preference batch's pairs in a
        form that splits by rows. The data statistics describe the
        loader's micro-batch, not a pipeline microbatch: the last stage's ranks (where the
        statistics are reduced) count them once, here."""
        if self.run is not None and self.run.step_codec is not None:
            self.run.step_codec(input_dict)
        inputs, labels, extra_inputs, extra_kwargs = super().post_dataloading_process(
            input_dict, labels
        )
        if self.run is None or not self.parallel_dims.pp_enabled:
            return inputs, labels, extra_inputs, extra_kwargs
        data_stats = extra_inputs.pop("data_stats", None)
        if data_stats is not None and self.pp_has_last_stage:
            self.run.state.stats.add({"data_stats": data_stats.float().sum(0)})
        for key in STAGE_KWARGS:
            if key in extra_inputs:
                extra_kwargs[key] = extra_inputs.pop(key)
        if "pref_doc" in extra_inputs:  # pairs split by rows (model/pipeline_pairs.py)
            doc, ref = extra_inputs.pop("pref_doc"), extra_inputs.pop("pref_ref")
            for key in ("pref_pairs", "pref_key"):  # [P, 2]: not split by rows, not needed
                extra_inputs.pop(key, None)
            extra_kwargs["pref_doc"] = doc
            extra_kwargs["pref_ref_frames"] = reference_per_frame(doc, ref)
        return inputs, labels, extra_inputs, extra_kwargs

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        """torchtitan's; a pipeline's last stage is told the global loss frames first (its
        schedule runs backward inside, compat fix 10)."""
        if self.run is not None and self.parallel_dims.pp_enabled:
            self.loss_fn.global_valid_tokens = global_valid_tokens
        return super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )

    def batch_generator(self, data_iterable):
        """torchtitan's, called once the checkpoint is loaded and before step 1: a DPO run's
        training stream first gets its reference log-probs (trainer/preference_reference.py:
        computed now on a first start, read back on a resume)."""
        if self.run is not None:
            use_reference_logps(self)
        return super().batch_generator(data_iterable)

    def train(self) -> None:
        """torchtitan's ``train``, ending on a barrier of the ranks instead of a 2-second sleep
        (compat fix 17); a failed collective names the peer that went silent."""
        try:
            with end_train_on_a_barrier():
                super().train()
        except BaseException as e:  # DCP wraps some failures in a BaseException
            if self.run is None or not is_unexplained_collective_failure(e):
                raise
            heartbeat = self.run.state.heartbeat
            raise CollectiveFailure(describe_collective_failure(e, heartbeat)) from e
