"""Training data for torchtitan's loop: builders, the stateful loader and its checkpoint state.

Each micro-batch is ``(input_dict, labels)``:
  input_dict = {"input": [B,T,N], "targets": [B,T,N], "loss_weights": [B,T,N],
                "position_ids": [B,T], "data_stats": [1,K]}
  labels     = [B,T]: 0 where the frame carries loss, -100 elsewhere. torchtitan divides the loss
               sum by the global count of these frames (ESPnet's ``count``).
The stream itself (mixing, packing/bucketing, exact resume) is in ``stream.py``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle

import numpy as np
from torch.utils.data import Dataset, Sampler
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from torchtitan_speechlm.components.nonfinite import STEP_GUARD
from torchtitan_speechlm.config import normalised_stream_weights
from torchtitan_speechlm.data.external import external_data
from torchtitan_speechlm.data.position import gather_position
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.data.stream import Plan, Source, SpeechLMDataset, batch_hash
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.data.transport import Inbox, Outbox
from torchtitan_speechlm.model.audio.tower import AudioEncoderArgs
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.trainer.run_context import MixEntry, audio_encoder_args, run_context


class PlanSampler(Sampler):
    """The stream's plans, computed in the main process (once per rank, however many workers),
    in bundles of consecutive micro-batches up to ``bundle_bytes``: a worker builds and ships
    a bundle as one message, so the loader's per-message cost is paid once per bundle."""

    def __init__(self, stream: SpeechLMDataset, bundle_bytes: int = 4 << 20, max_bundle: int = 16):
        self.stream, self.bundle_bytes, self.max_bundle = stream, bundle_bytes, max_bundle

    def __iter__(self):
        bundle, size = [], 0
        for plan in self.stream.plans():
            bundle.append(plan)
            size += self.stream.batch_bytes(plan.unit)
            if size >= self.bundle_bytes or len(bundle) == self.max_bundle:
                yield bundle
                bundle, size = [], 0
        if bundle:
            yield bundle


class BuildPlans(Dataset):
    """Map-style view of the stream for torch's DataLoader: plans in, the built micro-batches
    out (in a loader worker, through ``transport``'s shared slots)."""

    def __init__(self, stream: SpeechLMDataset, outbox: Outbox, sample_hashes: bool):
        self.stream, self.outbox, self.sample_hashes = stream, outbox, sample_hashes

    def __getitem__(self, plans: list[Plan]):
        return self.outbox.ship([self.stream.fetch(p, self.sample_hashes) for p in plans])


class SpeechLMDataLoader(ParallelAwareDataloader):
    """torchtitan's ParallelAwareDataloader over ready-made micro-batches (batch_size=None).

    The main process plans the stream (``PlanSampler``: which samples form each micro-batch,
    from lengths alone) and the loader workers only build the planned micro-batches, so no
    worker repeats another's work. The stream position travels with each plan and comes back
    with its batch, so the saved state is exactly "after the last micro-batch the trainer
    consumed", whatever the workers prefetched. Each rank knows the cursors of its own shards;
    ``state_dict`` gathers every rank's (a collective: torchtitan's checkpointer calls it on all
    ranks together) and saves the merged, rank-free state under one key instead of the parent's
    ``dp_rank_{r}``: a resume on another data-parallel degree reads the same state and each
    rank takes its shards from it. torchdata's own per-worker snapshots are not used.
    """

    STATE_KEY = "speechlm_stream"

    def __init__(
        self,
        dataset: SpeechLMDataset,
        *,
        hash_log: str | None = None,
        sample_hashes: bool = False,
        on_batch=None,
        **kwargs,
    ):
        # our state comes with the batches; torchdata need not snapshot the workers
        kwargs.setdefault("snapshot_every_n_steps", 1 << 30)
        workers = kwargs.get("num_workers", 0)
        prefetch = kwargs.get("prefetch_factor") or 2
        self.stream = dataset
        outbox = Outbox(slots=prefetch + 2, reuse=not kwargs.get("persistent_workers", False))
        hashes = bool(hash_log) or sample_hashes
        super().__init__(
            BuildPlans(dataset, outbox, hashes),
            # without workers a bundle would only build ahead of the trainer: one at a time
            sampler=PlanSampler(dataset, max_bundle=16 if workers else 1),
            **kwargs,
        )
        # the batches are opaque to torch's pinning (its pin thread would copy the shared
        # slots themselves), so the inbox pins what it hands over
        self.inbox = Inbox(pin_memory=kwargs.get("pin_memory", False))
        self.hash_log = hash_log
        self.last_samples: list[str] | None = None  # content hashes of the last batch's samples
        self.on_batch = on_batch  # called with each consumed micro-batch's sample ids
        self._position = dataset.state_dict()

    def __iter__(self):
        log = None
        if self.hash_log:
            os.makedirs(os.path.dirname(self.hash_log), exist_ok=True)
            log = open(self.hash_log, "a", buffering=1)
        if not self.persistent_workers:
            self.inbox.clear()
        try:
            for msg in super().__iter__():
                for batch, meta in self.inbox.receive(msg):
                    self._position = dict(self._position, position=meta["position"])
                    self.last_samples = meta["samples"]
                    if self.on_batch is not None:
                        self.on_batch(meta["ids"])
                    if log is not None:
                        record = {"hash": batch_hash(batch[0]), "samples": meta["samples"]}
                        log.write(json.dumps(record) + "\n")
                    yield batch
        finally:
            if log is not None:
                log.close()

    def state_dict(self) -> dict:
        state = dict(self._position, position=gather_position(self._position["position"]))
        return {self.STATE_KEY: pickle.dumps(state), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if self.STATE_KEY not in state_dict:
            raise ValueError(
                "the checkpoint's dataloader state was not written by torchtitan_speechlm; "
                "add 'dataloader' to checkpoint.exclude_from_loading to start the data afresh"
            )
        if state_dict.get("world_size") != self.dp_world_size:
            logger.info(
                f"Resuming the data stream saved with {state_dict.get('world_size')} "
                f"data-parallel ranks on {self.dp_world_size} ranks (the stream is global)"
            )
        state = pickle.loads(state_dict[self.STATE_KEY])
        self.stream.load_state_dict(state)
        self._position = self.stream.state_dict()


def _hash01(s: str) -> float:
    return int(hashlib.sha256(s.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def split_indices(ids: list[str], valid_fraction: float, split: str) -> np.ndarray:
    """Deterministic hold-out by id hash: stable across runs, ranks and dataset order.

    ``split`` is "train" (items not held out), "valid" (held out) or "all"."""
    if split == "all":
        return np.arange(len(ids))
    if valid_fraction <= 0:
        return np.arange(len(ids)) if split == "train" else np.arange(0)
    held = np.array([_hash01(i) < valid_fraction for i in ids], dtype=bool)
    return np.nonzero(~held if split == "train" else held)[0]


def build_template_builder(job_config, layout: VocabLayout) -> TemplateBuilder:
    sl = job_config.speechlm
    audio = audio_encoder_args(job_config)
    frames = AudioEncoderArgs(**audio).frames_of if audio else None
    return TemplateBuilder(
        layout,
        sl.pattern,
        LossWeights(
            text=sl.text_weight,
            audio=sl.audio_weight,
            streams=tuple(normalised_stream_weights(sl.stream_weights, layout.num_streams)),
        ),
        loss_region=job_config.speechlm_data.loss_region,
        continuous_frames=frames,
    )


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


@functools.lru_cache(maxsize=64)
def open_prepared(path: str, verify: str = "size"):
    """A prepared dataset is immutable once written, so each process opens (and validates,
    ``speechlm_data.verify_shards``) it once, not once per mixture entry or validation round."""
    return PreparedDataset(path, verify=verify)


def build_sources(job_config, entries: list[MixEntry], split: str) -> list[Source]:
    paths = run_context(job_config).datasets
    frac = job_config.speechlm_data.valid_fraction
    sources = []
    for e in entries:
        data = open_prepared(
            os.path.abspath(paths[e.dataset]), job_config.speechlm_data.verify_shards
        )
        sources.append(
            Source(e.task, e.dataset, e.weight, data, split_indices(data.ids, frac, split))
        )
    return sources


def global_batch_rows(job_config, dp_world_size: int) -> int:
    """torchtitan's global batch in rows (``global_batch_size``, or local x dp when unset)."""
    t = job_config.training
    return t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp_world_size


def build_dataset(
    job_config,
    entries: list[MixEntry],
    split: str,
    *,
    dp_rank: int,
    dp_world_size: int,
    training: bool,
) -> SpeechLMDataset:
    """A train (infinite, shuffled, augmented) or validation (finite, ordered, clean) stream.

    Training steps hold torchtitan's global batch: ``accumulation`` = global rows / (local rows
    x dp), exactly as torchtitan's Trainer computes its gradient accumulation steps."""
    data = job_config.speechlm_data
    layout = run_context(job_config).layout
    if training:
        seq_len, rows = job_config.training.seq_len, job_config.training.local_batch_size
        accumulation = global_batch_rows(job_config, dp_world_size) // (rows * dp_world_size)
        key = "training.seq_len"
    else:
        v = job_config.validation
        seq_len = v.seq_len if v.seq_len > 0 else job_config.training.seq_len
        rows, accumulation = v.local_batch_size, 1
        key = "validation.seq_len" if v.seq_len > 0 else "training.seq_len"
    return SpeechLMDataset(
        build_sources(job_config, entries, split),
        build_template_builder(job_config, layout),
        seq_len=seq_len,
        local_batch_size=rows,
        max_tokens=data.max_tokens if data.batching == "bucket" else 0,
        mode=data.batching,
        window=data.window,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        accumulation=max(1, accumulation),
        seed=data.seed,
        shuffle=data.shuffle and training,
        infinite=training,
        cfg_dropout=data.cfg_dropout if training else 0.0,
        max_too_long_fraction=data.max_too_long_fraction if training else 1.0,
        seq_len_key=key,
    )


def check_data(job_config) -> None:
    """Build the training stream and every validation set once, as the ranks will: bad
    mixtures, empty entries and lengths that do not fit ``seq_len`` fail here, before any rank
    starts (see SpeechLMDataset.check_lengths)."""
    if external_data(job_config) is not None:  # a Python data object checks its own
        return
    ctx = run_context(job_config)
    build_dataset(job_config, ctx.train, "train", dp_rank=0, dp_world_size=1, training=True)
    if job_config.validation.enable:
        for entries, split in ctx.valid.values():
            build_dataset(job_config, entries, split, dp_rank=0, dp_world_size=1, training=False)


def build_speechlm_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs
) -> SpeechLMDataLoader:
    """TrainSpec.build_dataloader_fn."""
    ctx = run_context(job_config)
    record_vocab(job_config.job.dump_folder, ctx.layout)
    external = external_data(job_config)
    if external is not None:  # a Python data object (data/external.py)
        return external.train_loader(job_config, ctx.layout, dp_rank, dp_world_size)
    dataset = build_dataset(
        job_config, ctx.train, "train", dp_rank=dp_rank, dp_world_size=dp_world_size, training=True
    )
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
        on_batch=STEP_GUARD.note_micro_batch,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        hash_log=hash_log,
        batch_size=None,
        num_workers=dl.num_workers,
        persistent_workers=dl.persistent_workers,
        pin_memory=dl.pin_memory,
        prefetch_factor=dl.prefetch_factor,
    )
