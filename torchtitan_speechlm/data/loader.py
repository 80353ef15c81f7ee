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

Order: every (task, dataset) mixture entry walks its own seeded permutation of items, epoch by
epoch; a seeded generator picks the entry of each draw by weight. Rank r of W takes items
r, r+W, ... of each permutation. The state (per-entry epoch/position, generator state, the sample
carried over to the next row) is saved in DCP checkpoints through torchtitan's
ParallelAwareDataloader, so a resumed run yields the same micro-batches as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
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
from ..model.vocab import VocabLayout
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
    """Deterministic, stateful stream of packed micro-batches for one data-parallel rank."""

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
            if len(s.indices) < dp_world_size:
                raise ValueError(
                    f"dataset {s.name!r} has {len(s.indices)} items for {dp_world_size} "
                    "data-parallel ranks; every rank needs at least one"
                )
        self.reset()

    # ---- state -----------------------------------------------------------------------------
    def reset(self) -> None:
        self._epoch = [0] * len(self.sources)
        self._pos = [0] * len(self.sources)
        self._rng = np.random.default_rng([self.seed, self.dp_rank, 7919])
        self._carry: tuple[int, int] | None = None  # (source, item) for the next row
        self._batches = 0
        self._perm_cache: dict[int, tuple[int, np.ndarray]] = {}

    def state_dict(self) -> dict:
        return {
            "epoch": list(self._epoch),
            "pos": list(self._pos),
            "rng": self._rng.bit_generator.state,
            "carry": self._carry,
            "batches": self._batches,
            "sources": [f"{s.task}:{s.name}" for s in self.sources],
        }

    def load_state_dict(self, state: dict) -> None:
        names = [f"{s.task}:{s.name}" for s in self.sources]
        if state["sources"] != names:
            raise ValueError(
                f"checkpointed data mixture {state['sources']} differs from the configured "
                f"{names}; resume with the same speechlm_data.train, or start a new dump_folder"
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
            cached = self._perm_cache[src] = (epoch, idx[self.dp_rank :: self.dp_world_size])
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
    def _sample(self, src: int, item: int):
        s = self.sources[src]
        it = s.data[item]
        ex = self.builder.build(s.task, it.text_tokens, it.audio_codes)
        return ex

    def _rows(self):
        """Yield (rows, stats) lists of packed rows; each row is a list of Examples."""
        cap = self.seq_len + 1  # a sample of L frames uses L - 1 input positions
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
            ex = self._sample(*nxt)
            length = len(ex.frames)
            if length > cap:
                skipped += 1
                continue
            if row and (not self.pack or used + length - 1 > self.seq_len):
                self._carry = nxt
                yield row, skipped
                skipped = 0
                row, used = [], 0
                continue
            row.append(ex)
            used += length - 1

    def _collate(self, rows: list[list], skipped: int) -> tuple[dict, torch.Tensor]:
        b, t, n = len(rows), self.seq_len, self.layout.num_streams
        inp = np.broadcast_to(self._pad_frame, (b, t, n)).copy()
        tgt = inp.copy()
        w = np.zeros((b, t, n), dtype=np.float32)
        pos = np.zeros((b, t), dtype=np.int64)
        examples = 0
        for r, row in enumerate(rows):
            at = 0
            for ex in row:
                length = len(ex.frames) - 1
                inp[r, at : at + length] = ex.frames[:-1]
                tgt[r, at : at + length] = ex.frames[1:]
                w[r, at : at + length] = ex.weights[1:]
                pos[r, at : at + length] = np.arange(length)
                at += length
                examples += 1
            pos[r, at:] = np.arange(t - at)  # padding is its own "document"
        loss_frames = (w > 0).any(-1)
        labels = np.where(loss_frames, 0, IGNORE_INDEX)
        frames = sum(len(ex.frames) - 1 for row in rows for ex in row)
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
        pending, skipped = [], 0
        for row, sk in self._rows():
            pending.append(row)
            skipped += sk
            if len(pending) == self.batch_size:
                self._batches += 1
                if (self._batches - 1) % n_workers == worker_id:
                    yield self._collate(pending, skipped)
                pending, skipped = [], 0
        if pending and not self.infinite:
            yield self._collate(pending, skipped)


class SpeechLMDataLoader(ParallelAwareDataloader):
    """torchtitan's ParallelAwareDataloader over ready-made micro-batches (batch_size=None)."""


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


def build_sources(job_config, entries: list[MixEntry], split: str) -> list[_Source]:
    from .prepared import PreparedDataset

    paths = parse_datasets(job_config.speechlm_data.datasets)
    frac = job_config.speechlm_data.valid_fraction
    cache: dict[str, PreparedDataset] = {}
    sources = []
    for e in entries:
        data = cache.setdefault(e.dataset, PreparedDataset(paths[e.dataset]))
        ids = [data[i].id for i in range(len(data))] if frac > 0 else [""] * len(data)
        sources.append(_Source(e.task, e.dataset, e.weight, data, split_indices(ids, frac, split)))
    return sources


def build_speechlm_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs
) -> SpeechLMDataLoader:
    """TrainSpec.build_dataloader_fn."""
    names = parse_datasets(job_config.speechlm_data.datasets)
    entries = parse_mix(job_config.speechlm_data.train, "train", names)
    layout = layout_from_config(job_config)
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
