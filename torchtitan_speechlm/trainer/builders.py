"""The SpeechLM TrainSpec's builders: a job config and the run -> what torchtitan's loop calls.

torchtitan's Trainer calls each ``build_*_fn`` of the TrainSpec with the job config (and a few
objects of its own). Ours are the methods of ``RunBuilders``, bound to the ``SpeechLMRun`` the
trainer resolved once, whose plan says what the run is made of and whose training state the
loss, metrics, optimizers and loader share; the trainer hands torchtitan the spec
``RunBuilders.train_spec`` makes for it. The registered spec's builders (``needs_the_run``) only
say which commands run a SpeechLM. Here, and only here, the run's values become the explicit
arguments of a component (components/, data/): the components never read the job config's
SpeechLM sections or each other's state themselves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from torchtitan_speechlm.components.dataloader import SpeechLMDataLoader
from torchtitan_speechlm.components.loss import SpeechLMLoss
from torchtitan_speechlm.components.metrics import SpeechLMMetricsProcessor
from torchtitan_speechlm.components.optim import (
    build_speechlm_lr_schedulers,
    build_speechlm_optimizers,
)
from torchtitan_speechlm.components.samples import SamplePrompts, TrainingSamples
from torchtitan_speechlm.components.validate import SpeechLMValidator
from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.catalog import MixEntry
from torchtitan_speechlm.data.format import KINDS
from torchtitan_speechlm.data.settings import StreamSettings
from torchtitan_speechlm.data.stream import SpeechLMDataset
from torchtitan_speechlm.distributed.batch import accumulation_steps
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.trainer.plan import RunPlan
from torchtitan_speechlm.trainer.run import SpeechLMRun
from torchtitan_speechlm.utils.compat import accelerator_available
from torchtitan_speechlm.utils.upstream import TrainSpec, logger

NEEDS_OUR_TRAINER = (
    "the {name!r} TrainSpec is built by torchtitan_speechlm's trainer, which resolves the run "
    "once and hands it to the spec's builders: start it with `torchtitan train --job.config_file "
    "X.toml`, or under torchrun with `-m torchtitan_speechlm.train` (torchtitan's own main() "
    "with trainer.SpeechLMTrainer), not `-m torchtitan.train`"
)


def needs_the_run(*args, **kwargs):
    """The builders of the registered spec: torchtitan's own Trainer (``-m torchtitan.train``)
    has no run to give them, so the first one it calls says which commands do."""
    job_config = kwargs.get("job_config", next((a for a in args if hasattr(a, "model")), None))
    name = getattr(getattr(job_config, "model", None), "name", "speechlm")
    raise ConfigError(NEEDS_OUR_TRAINER.format(name=name))


@dataclass(frozen=True)
class RunBuilders:
    """The TrainSpec builders of one run, bound to it: torchtitan's Trainer calls each with its
    own arguments (the job config, ranks, model parts...), and what the components share (the
    plan, the model args, the training state, the step codec) is this object's ``run``.

    ``train_spec`` gives torchtitan the spec it builds this run from: the registered one (its
    model class, parallelize and pipelining functions, state-dict adapter) with the run's model
    args and these methods as its builders. ``trainer.SpeechLMTrainer`` hands it to torchtitan's
    ``Trainer.__init__`` (utils/compat.py fix 15); nothing is looked up elsewhere, and two runs
    in one process each have their own."""

    run: SpeechLMRun

    def train_spec(self, registered: TrainSpec) -> TrainSpec:
        """``registered`` for this run: its model args are the run's (complete, so torchtitan's
        ``update_from_config`` has nothing left to do), its builders this object's methods."""
        return replace(
            registered,
            model_args={self.run.job_config.model.flavor: self.run.model_args},
            build_dataloader_fn=self.dataloader,
            build_validator_fn=self.validator,
            build_loss_fn=self.loss,
            build_metrics_processor_fn=self.metrics_processor,
            build_optimizers_fn=self.optimizers,
            build_lr_schedulers_fn=self.lr_schedulers,
        )

    def dataloader(self, dp_world_size: int, dp_rank: int, tokenizer, job_config):
        """TrainSpec.build_dataloader_fn."""
        return build_dataloader(self.run, dp_world_size, dp_rank, job_config)

    def validator(self, **kwargs) -> SpeechLMValidator:
        """TrainSpec.build_validator_fn (torchtitan passes everything by keyword)."""
        run = self.run
        sets = validation_sets(
            kwargs["job_config"], run, kwargs["dp_rank"], kwargs["dp_world_size"]
        )
        return SpeechLMValidator(
            sets=sets, stats_keys=run.state.stats.data_stats_keys, step_codec=run.step_codec,
            **kwargs,
        )  # fmt: skip

    def loss(self, job_config, **kwargs) -> SpeechLMLoss:
        """TrainSpec.build_loss_fn: the loss reports to the run's statistics and step guard."""
        return SpeechLMLoss(self.run.state.stats, self.run.state.guard)

    def metrics_processor(
        self, job_config, parallel_dims, model_args=None, tag=None
    ) -> SpeechLMMetricsProcessor:
        """TrainSpec.build_metrics_processor_fn."""
        run = self.run
        return SpeechLMMetricsProcessor(
            job_config,
            parallel_dims,
            tag,
            accumulator=run.state.stats,
            guard=run.state.guard,
            samples=training_samples(job_config, run.plan),
            frame_rate=run.plan.frame_rate,
            num_streams=run.plan.num_streams,
            model_args=model_args,
            step_codec=run.step_codec,
            code_usage_interval=job_config.speechlm.code_usage_interval,
            espnet_keys=job_config.metrics.espnet_keys,
        )

    def optimizers(self, model_parts, optimizer_config, parallel_dims, ft_manager=None):
        """TrainSpec.build_optimizers_fn: torchtitan's, behind the run's step guard."""
        return build_speechlm_optimizers(
            model_parts, optimizer_config, parallel_dims, ft_manager, guard=self.run.state.guard
        )

    def lr_schedulers(self, optimizers, lr_scheduler_config, training_steps: int):
        """TrainSpec.build_lr_schedulers_fn: torchtitan's, held at its floor; the guard's
        steps."""
        return build_speechlm_lr_schedulers(
            optimizers, lr_scheduler_config, training_steps, guard=self.run.state.guard
        )


# ---- data ----------------------------------------------------------------------------------------
def stream(
    plan: RunPlan, entries: list[MixEntry], split: str, settings: StreamSettings, *,
    dp_rank: int, dp_world_size: int, accumulation: int = 1,
) -> SpeechLMDataset:  # fmt: skip
    """This rank's share of a stream over ``entries`` (``split`` of their datasets):
    ``settings`` is the plan's training stream (infinite, shuffled, augmented) or one of its
    finite forms (``for_validation``, ``finite``)."""
    return SpeechLMDataset(
        plan.data.sources(entries, split),
        plan.template_builder(),
        settings,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        accumulation=accumulation,
    )


def train_stream(job_config, plan: RunPlan, *, dp_rank: int, dp_world_size: int):
    """The training stream: its steps hold torchtitan's global batch, ``accumulation``
    micro-batches per rank, exactly as torchtitan's Trainer computes its gradient accumulation
    steps (from its ``[training]`` section)."""
    accumulation = accumulation_steps(job_config.training, dp_world_size)
    return stream(
        plan, plan.data.train, "train", plan.train_stream,
        dp_rank=dp_rank, dp_world_size=dp_world_size, accumulation=accumulation,
    )  # fmt: skip


def check_data(job_config, plan: RunPlan) -> None:
    """Build the training stream and every validation set once, as the ranks will: bad
    mixtures, empty entries and lengths that do not fit ``seq_len`` fail here, before any rank
    starts (bad batching values already did, when the plan read them)."""
    if plan.external is not None:  # a Python data object checks its own
        return
    train_stream(job_config, plan, dp_rank=0, dp_world_size=1)
    if job_config.validation.enable:
        valid = plan.train_stream.for_validation(job_config.validation)
        for name, (entries, split) in plan.data.valid.items():
            plan.data.check_held_out(name, entries, split)
            stream(plan, entries, split, valid, dp_rank=0, dp_world_size=1)


def record_vocab(dump_folder: str, layout: VocabLayout) -> None:
    """Store the layout with the run (``{dump_folder}/vocab.json``); refuse a different one.

    Every checkpoint also carries the layout's fingerprint in its dataloader state.
    """
    path = os.path.join(dump_folder, "vocab.json")
    if os.path.isfile(path):
        layout.check_same(VocabLayout.load(path), f"the run in {dump_folder} ({path})")
        return
    if int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(dump_folder, exist_ok=True)
        layout.save(path)  # atomic


def build_dataloader(run: SpeechLMRun, dp_world_size: int, dp_rank: int, job_config):
    """This rank's training loader of ``run`` (``RunBuilders.dataloader``)."""
    plan = run.plan
    record_vocab(job_config.job.dump_folder, plan.layout)
    if plan.external is not None:  # a Python data object (data/external.py)
        audio = plan.audio
        return plan.external.train_loader(
            job_config,
            plan.layout,
            dp_rank,
            dp_world_size,
            accumulation=accumulation_steps(job_config.training, dp_world_size),
            continuous_frames=audio.frames_of if audio else None,
        )
    dataset = train_stream(job_config, plan, dp_rank=dp_rank, dp_world_size=dp_world_size)
    logger.info(
        "SpeechLM data: "
        + ", ".join(
            f"{s.task}:{s.name} ({len(s.indices)} items, weight {s.weight})"
            for s in dataset.sources
        )
    )
    dl = job_config.training.dataloader
    hash_log = (
        os.path.join(job_config.job.dump_folder, "batch_hashes", f"rank{dp_rank}.jsonl")
        if job_config.speechlm_data.log_batch_hashes
        else None
    )
    return SpeechLMDataLoader(
        dataset,
        on_batch=run.state.guard.note_micro_batch,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        hash_log=hash_log,
        batch_size=None,
        num_workers=dl.num_workers,
        persistent_workers=dl.persistent_workers,
        pin_memory=dl.pin_memory,
        prefetch_factor=dl.prefetch_factor,
    )


def validation_sets(job_config, run: SpeechLMRun, dp_rank: int, dp_world_size: int) -> dict:
    """Each validation set's name -> a function making a fresh pass over it."""
    plan, audio = run.plan, run.plan.audio
    if plan.external is not None:
        frames = audio.frames_of if audio else None
        return {
            name: partial(plan.external.valid_dataset, name, plan.layout, continuous_frames=frames)
            for name in plan.data.valid
        }
    valid = plan.train_stream.for_validation(job_config.validation)
    return {
        name: partial(
            stream, plan, entries, split, valid, dp_rank=dp_rank, dp_world_size=dp_world_size
        )
        for name, (entries, split) in plan.data.valid.items()
    }


# ---- loss, metrics, optimizers ---------------------------------------------------------------
def sample_prompts(job_config, plan: RunPlan) -> SamplePrompts:
    """The sample set's codec, tokenizer and ASR prompts: the first speech items of the first
    validation set, and their speaker prompts (for a run with a prompted task)."""

    def speech(count: int) -> tuple[list, list]:
        """The first ``count`` speech items and, per item, its speaker prompt: the next
        speech item of its speaker in the set, cyclically (None: no speaker labels, or no
        other utterance), as ``eval --valid tts_prompt`` draws them."""
        if not plan.data.valid or plan.external is not None:
            return [], []
        entries, split = next(iter(plan.data.valid.values()))
        (source,) = plan.data.sources(entries[:1], split)
        ds = source.data
        kinds = getattr(ds, "kind_codes", None)
        if kinds is not None:  # vectorised over the index (no string per item)
            ind = np.asarray(source.indices)
            idx = [int(i) for i in ind[np.asarray(kinds)[ind] == KINDS.index("speech")]]
        else:
            idx = [int(i) for i in source.indices if ds.kinds[int(i)] == "speech"]
        chosen = idx[:count]
        if not ds.has_speakers:
            return [ds[i] for i in chosen], [None] * len(chosen)
        by_speaker: dict[int, list[int]] = {}
        for i in idx:
            by_speaker.setdefault(int(ds.speaker_of(i)), []).append(i)
        prompts = []
        for i in chosen:
            same = by_speaker[int(ds.speaker_of(i))]
            prompts.append(ds[same[(same.index(i) + 1) % len(same)]] if len(same) > 1 else None)
        return [ds[i] for i in chosen], prompts

    return SamplePrompts(
        plan.codec,
        plan.data.tokenizer.get("path", ""),
        plan.frame_rate,
        lambda count: speech(count)[0],
        lambda count: speech(count)[1],
    )


def training_samples(job_config, plan: RunPlan) -> TrainingSamples:
    """``speechlm.sample_every`` (-1: at each validation with an accelerator, off on CPU)."""
    sl = job_config.speechlm
    every = sl.sample_every
    if every < 0:
        every = job_config.validation.freq if accelerator_available() else 0
    folder = os.path.join(job_config.job.dump_folder, "samples")
    return TrainingSamples(
        every, sl.sample_count, sl.sample_texts, folder, sample_prompts(job_config, plan)
    )
