"""Training/validation batches for torchtitan's loop, with exactly resumable state.

The dataset yields whole micro-batches ``(input_dict, labels)``:
  input_dict = {"input": [B,T,N], "targets": [B,T,N], "loss_weights": [B,T,N],
                "position_ids": [B,T], "data_stats": [1,K]}
  labels     = [B,T]: 0 where the frame carries loss, -100 elsewhere. torchtitan divides the loss
               sum by the global count of these frames (ESPnet's ``count``).

Rows are built in ``pack`` mode (several samples per row; position ids restart per sample, and
transformers turns restarting position ids into a block-diagonal causal mask, so attention never
crosses samples) or ``pad`` mode (one sample per row). Each sample is shifted on its own, so no
prediction crosses a sample boundary.

Order: one *global* stream of rows, identical on every rank. Each (task, dataset) mixture entry
walks its own seeded permutation of items, epoch by epoch; a seeded generator picks the entry of
each draw by weight; rows are packed from item lengths alone (read from the index, no decoding).
Global micro-batch g is rows [g*B*W, (g+1)*B*W) and rank r collates its B rows from it. So the
data seen for a global batch does not depend on the number of ranks (1 process and 2 processes
train on the same global batch), and the loader state (per-entry epoch/position, generator state,
the item carried over to the next row) is the same on every rank: resuming with a different
data-parallel degree continues the same stream. It is saved in DCP checkpoints through
torchtitan's ParallelAwareDataloader, so a resumed run yields the same micro-batches as an
uninterrupted one.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

from ..config import (
    MixEntry,
    dataset_metadata,
    normalised_stream_weights,
    parse_datasets,
    parse_mix,
)
from ..model.vocab import VocabLayout, VocabMismatchError
from .examples import LossWeights, TemplateBuilder

DATA_STATS_KEYS = ("examples", "rows", "frames", "pad_frames", "loss_frames", "skipped_too_long")


def _hash01(s: str) -> float:
    return int(hashlib.sha256(s.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def split_indices(ids: list[str], valid_fraction: float, split: str) -> np.ndarray:
    """Deterministic hold-out by id hash: stable across runs, ranks and dataset order."""
    if valid_fraction <= 0:
        return np.arange(len(ids)) if split == "train" else np.arange(0)
    held = np.array([_hash01(i) < valid_fraction for i in ids], dtype=bool)
    return np.nonzero(~held if split == "train" else held)[0]


@dataclass
class _Source:
    task: str
    name: str
    weight: float
    data: object  # PreparedDataset
    indices: np.ndarray


class SpeechLMDataset(IterableDataset):
    """Deterministic, stateful stream of packed micro-batches; this rank's share of each."""

    def __init__(
        self,
        sources: list[_Source],
        builder: TemplateBuilder,
        *,
        seq_len: int,
        batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        shuffle: bool,
        pack: bool,
        infinite: bool,
    ):
        self.sources = sources
        self.builder = builder
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seed, self.shuffle, self.pack, self.infinite = seed, shuffle, pack, infinite
        self.layout = builder.layout
        n = self.layout.num_streams
        self._pad_frame = np.array(
            [self.layout.pad] + [self.layout.stream_pad(k) for k in range(1, n)], dtype=np.int64
        )
        self._weights = np.array([s.weight for s in sources], dtype=np.float64)
        self._weights /= self._weights.sum()
        for s in sources:
            if len(s.indices) == 0:
                raise ValueError(f"{s.task}:{s.name} has no items (after the validation hold-out)")
        self._lengths = [self._item_lengths(s) for s in sources]
        self.reset()

    def _item_lengths(self, s: _Source) -> np.ndarray:
        """Frames of every item's example, from the index alone (no arrays decoded)."""
        text_len, audio_frames = s.data.text_lengths, s.data.audio_lengths
        return np.array([self.builder.length(s.task, int(text_len[i]), int(audio_frames[i]))
                         for i in range(len(text_len))], dtype=np.int64)

    # ---- state -----------------------------------------------------------------------------
    def reset(self) -> None:
        self._epoch = [0] * len(self.sources)
        self._pos = [0] * len(self.sources)
        self._rng = np.random.default_rng([self.seed, 7919])
        self._carry: tuple[int, int] | None = None  # (source, item) opening the next row
        self._batches = 0  # global micro-batches produced so far
        self._perm_cache: dict[int, tuple[int, np.ndarray]] = {}

    def state_dict(self) -> dict:
        return {
            "epoch": list(self._epoch),
            "pos": list(self._pos),
            "rng": self._rng.bit_generator.state,
            "carry": self._carry,
            "batches": self._batches,
            "sources": [f"{s.task}:{s.name}" for s in self.sources],
            "vocab": self.layout.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        names = [f"{s.task}:{s.name}" for s in self.sources]
        if state["sources"] != names:
            raise ValueError(
                f"checkpointed data mixture {state['sources']} differs from the configured "
                f"{names}; resume with the same speechlm_data.train, or start a new dump_folder"
            )
        if state.get("vocab") != self.layout.fingerprint():
            raise VocabMismatchError(
                f"the checkpoint was trained with vocabulary layout {state.get('vocab')} but this "
                f"run builds {self.layout.fingerprint()} (different backbone, tokenizer or codec); "
                "resume with the original assets or start a new dump_folder"
            )
        self._epoch, self._pos = list(state["epoch"]), list(state["pos"])
        self._rng.bit_generator.state = state["rng"]
        self._carry = tuple(state["carry"]) if state["carry"] is not None else None
        self._batches = int(state["batches"])

    # ---- item order ------------------------------------------------------------------------
    def _perm(self, src: int, epoch: int) -> np.ndarray:
        cached = self._perm_cache.get(src)
        if cached is None or cached[0] != epoch:
            idx = self.sources[src].indices
            if self.shuffle:
                rng = np.random.default_rng([self.seed, src, epoch, 104729])
                idx = idx[rng.permutation(len(idx))]
            cached = self._perm_cache[src] = (epoch, idx)
        return cached[1]

    def _next_item(self) -> tuple[int, int] | None:
        if self.infinite:
            src = int(self._rng.choice(len(self.sources), p=self._weights))
        else:  # validation: each source once, in order
            src = next((i for i in range(len(self.sources)) if self._epoch[i] == 0), None)
            if src is None:
                return None
        perm = self._perm(src, self._epoch[src])
        item = int(perm[self._pos[src]])
        self._pos[src] += 1
        if self._pos[src] >= len(perm):
            self._pos[src] = 0
            self._epoch[src] += 1
        return src, item

    # ---- rows and batches --------------------------------------------------------------------
    def _rows(self):
        """Yield (row, skipped): a row is a list of (source, item) whose examples fit seq_len."""
        skipped = 0
        row, used = [], 0
        while True:
            if self._carry is not None:
                nxt, self._carry = self._carry, None
            else:
                nxt = self._next_item()
            if nxt is None:
                if row:
                    yield row, skipped
                return
            need = int(self._lengths[nxt[0]][nxt[1]]) - 1  # a sample of L frames: L-1 inputs
            if need > self.seq_len:
                skipped += 1
                continue
            if row and (not self.pack or used + need > self.seq_len):
                self._carry = nxt
                yield row, skipped
                skipped = 0
                row, used = [], 0
                continue
            row.append(nxt)
            used += need

    def _collate(self, rows: list[list], skipped: int) -> tuple[dict, torch.Tensor]:
        b, t, n = len(rows), self.seq_len, self.layout.num_streams
        inp = np.broadcast_to(self._pad_frame, (b, t, n)).copy()
        tgt = inp.copy()
        w = np.zeros((b, t, n), dtype=np.float32)
        pos = np.zeros((b, t), dtype=np.int64)
        examples = frames = 0
        for r, row in enumerate(rows):
            at = 0
            for src, item in row:
                s = self.sources[src]
                it = s.data[item]
                ex = self.builder.build(s.task, it.text_tokens, it.audio_codes)
                length = len(ex.frames) - 1
                inp[r, at : at + length] = ex.frames[:-1]
                tgt[r, at : at + length] = ex.frames[1:]
                w[r, at : at + length] = ex.weights[1:]
                pos[r, at : at + length] = np.arange(length)
                at += length
                examples += 1
            frames += at
            pos[r, at:] = np.arange(t - at)  # padding is its own "document"
        loss_frames = (w > 0).any(-1)
        labels = np.where(loss_frames, 0, IGNORE_INDEX)
        stats = np.array(
            [examples, b, frames, b * t - frames, int(loss_frames.sum()), skipped],
            dtype=np.float32,
        )
        batch = {
            "input": torch.from_numpy(inp),
            "targets": torch.from_numpy(tgt),
            "loss_weights": torch.from_numpy(w),
            "position_ids": torch.from_numpy(pos),
            "data_stats": torch.from_numpy(stats)[None],
        }
        return batch, torch.from_numpy(labels)

    def __iter__(self):
        worker = get_worker_info()
        n_workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        per_rank, world = self.batch_size, self.dp_world_size
        pending, skipped = [], 0
        for row, sk in self._rows():
            pending.append(row)
            skipped += sk
            if len(pending) == per_rank * world:
                g = self._batches
                self._batches += 1
                if g % n_workers == worker_id:
                    mine = pending[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
                    # skipped items are attributed to rank 0 so the global sum counts them once
                    yield self._collate(mine, skipped if self.dp_rank == 0 else 0)
                pending, skipped = [], 0
        if pending and not self.infinite:
            # Last, partial global batch of a finite set: ranks beyond it get no batch.
            mine = pending[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
            if mine:
                yield self._collate(mine, skipped if self.dp_rank == 0 else 0)


class SpeechLMDataLoader(ParallelAwareDataloader):
    """torchtitan's ParallelAwareDataloader over ready-made micro-batches (batch_size=None).

    Our stream state is global (identical on every rank), so it is saved under one rank-free key
    instead of the parent's ``dp_rank_{r}``. That makes a resume under a different
    data-parallel degree possible: every rank reads the same state and the stream continues.
    """

    STATE_KEY = "speechlm_stream"

    def state_dict(self) -> dict:
        return {
            self.STATE_KEY: pickle.dumps(StatefulDataLoader.state_dict(self)),
            "world_size": self.dp_world_size,
        }

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
        StatefulDataLoader.load_state_dict(self, pickle.loads(state_dict[self.STATE_KEY]))


def build_template_builder(job_config, layout: VocabLayout) -> TemplateBuilder:
    sl = job_config.speechlm
    return TemplateBuilder(
        layout,
        sl.pattern,
        LossWeights(
            text=sl.text_weight,
            audio=sl.audio_weight,
            streams=tuple(normalised_stream_weights(sl.stream_weights, layout.num_streams)),
        ),
    )


def layout_from_config(job_config) -> VocabLayout:
    from ..model.hf_backbone import load_hf_config

    hf = load_hf_config(job_config.speechlm.backbone)
    meta = next(iter(dataset_metadata(job_config).values()))
    return VocabLayout(
        text_size=int(hf.vocab_size),
        num_streams=int(meta["codec"]["num_streams"]),
        codebook_size=int(meta["codec"]["codebook_size"]),
    )


def record_vocab(dump_folder: str, layout: VocabLayout) -> None:
    """Store the layout with the run (``{dump_folder}/vocab.json``); refuse a different one.

    Every checkpoint also carries the layout's fingerprint in its dataloader state.
    """
    import os

    path = os.path.join(dump_folder, "vocab.json")
    if os.path.isfile(path):
        layout.check_same(VocabLayout.load(path), f"the run in {dump_folder} ({path})")
        return
    if int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(dump_folder, exist_ok=True)
        tmp = f"{path}.tmp"
        layout.save(tmp)
        os.replace(tmp, path)


def build_sources(job_config, entries: list[MixEntry], split: str) -> list[_Source]:
    from .prepared import PreparedDataset

    paths = parse_datasets(job_config.speechlm_data.datasets)
    frac = job_config.speechlm_data.valid_fraction
    cache: dict[str, PreparedDataset] = {}
    sources = []
    for e in entries:
        data = cache.setdefault(e.dataset, PreparedDataset(paths[e.dataset]))
        ids = data.ids
        sources.append(_Source(e.task, e.dataset, e.weight, data, split_indices(ids, frac, split)))
    return sources


def build_speechlm_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs
) -> SpeechLMDataLoader:
    """TrainSpec.build_dataloader_fn."""
    names = parse_datasets(job_config.speechlm_data.datasets)
    entries = parse_mix(job_config.speechlm_data.train, "train", names)
    layout = layout_from_config(job_config)
    record_vocab(job_config.job.dump_folder, layout)
    dataset = SpeechLMDataset(
        build_sources(job_config, entries, "train"),
        build_template_builder(job_config, layout),
        seq_len=job_config.training.seq_len,
        batch_size=job_config.training.local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=job_config.speechlm_data.seed,
        shuffle=job_config.speechlm_data.shuffle,
        pack=True,
        infinite=True,
    )
    dl = job_config.training.dataloader
    logger.info(
        f"SpeechLM data: {[f'{s.task}:{s.name} ({len(s.indices)} items, w={s.weight})' for s in dataset.sources]}"
    )
    return SpeechLMDataLoader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        batch_size=None,
        num_workers=dl.num_workers,
        persistent_workers=dl.persistent_workers,
        pin_memory=dl.pin_memory,
        prefetch_factor=dl.prefetch_factor,
    )
