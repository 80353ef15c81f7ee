"""The global, exactly resumable stream of training steps (packed or bucketed), in shards.

**The unit of the stream is the optimizer step**: ``S = step_pieces`` pieces (pack: rows of
``seq_len`` frames, the global batch ``training.global_batch_size``; bucket: ``dp x
accumulation`` micro-batches under the ``max_tokens`` budget). Piece ``j`` of every step comes
from *shard* ``j``, an independent sub-stream over its own share of the data: each (task,
dataset) mixture entry walks a seeded permutation per epoch of which shard ``j`` takes every
``S``-th item (a source smaller than ``S`` is shared whole), and a seeded generator of the shard
picks the entry of each draw by weight. A shard takes items ``window`` at a time and turns a
window into pieces from item lengths alone:

- ``pack``: a piece is a row of ``seq_len`` frames holding several samples, each with its own
  position ids (attention stays within a sample: model/documents.py);
- ``bucket``: a piece is a micro-batch: one sample per row, length-sorted, as many rows as fit
  the ``max_tokens`` budget, padded to the longest.

Samples of under-filled pieces at the end of a window are carried into the shard's next window;
piece order within a window is shuffled.

Rank ``r``'s micro-batch ``m`` (of ``accumulation``) is slice ``i = m * dp + r`` of the step:
pieces (shards) ``i*B .. i*B+B-1`` (pack, ``B`` rows) or ``i`` (bucket). So a rank only ever
builds its own shards: its data work per step is the same at dp = 8 and dp = 512. And 1 process
x 4 micro-batches, 2 x 2 and 4 x 1 train on the same samples in every step, since which samples
form a step depends only on ``S``. Loader worker ``w`` of ``n`` serves this rank's micro-batches
``w, w + n, ...``.

Position = optimizer steps done, micro-batches done in an unfinished step, and each shard's
cursor (its window's start state and the pieces taken from it). A rank knows its own shards'
cursors; the loader gathers all of them when a checkpoint is written
(components/dataloader.py), so a resume on another data-parallel degree or accumulation (same
global batch) picks up its shards where the stream left them.

The pieces, one job per module (as lhotse keeps sampler, bucketing, dataset and collation
apart): ``settings`` (the stream's settings and their ranges), ``mixing`` (sources and the
weighted draw), ``lengths`` (example lengths from the index, the too-long check), ``shards``
(pieces per step, a rank's shards), ``planner`` (window -> pieces, pure functions over
lengths), ``windows`` (a shard's walk, window after window), ``position`` (the typed resume
position and its checkpoint form), ``sampler`` (plans and the resume checks), ``examples``
(a plan's samples read), ``speaker_prompts`` (a prompted task's speaker prompt of each draw)
and ``collation`` (tensors, statistics, hashes). ``SpeechLMDataset`` below composes them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import Stateful

from torchtitan_speechlm.data.collation import (
    Collator,
    batch_bytes,
    data_stats_keys,
)
from torchtitan_speechlm.data.examples import Examples
from torchtitan_speechlm.data.lengths import LengthTable, check_lengths
from torchtitan_speechlm.data.mixing import Mixture, Source, keep_eligible
from torchtitan_speechlm.data.pairs import preference_stream
from torchtitan_speechlm.data.planner import Draw, Unit
from torchtitan_speechlm.data.sampler import Plan, StreamSampler
from torchtitan_speechlm.data.settings import StreamSettings
from torchtitan_speechlm.data.shards import ShardLayout
from torchtitan_speechlm.data.speaker_prompts import SpeakerPrompts
from torchtitan_speechlm.data.tasks import TemplateBuilder, get_task

__all__ = ["SpeechLMDataset"]


class SpeechLMDataset(IterableDataset, Stateful):
    """This rank's share of the global stream; a torchdata-Stateful IterableDataset.

    An optimizer step is ``step_pieces`` pieces (pack: the global batch in rows of ``seq_len``
    frames; bucket: ``dp x accumulation`` micro-batches under the ``max_tokens`` budget), piece
    ``j`` from shard ``j``. Which samples form a step depends only on the data, the seed, the
    piece parameters and ``step_pieces``; rank ``r``'s micro-batch ``m`` is the slice
    ``m * dp + r`` of it, built from that slice's shards only, so the layout (processes x
    accumulation) decides who computes which slice, never which samples form a step.

    A composition: ``sampler`` (plans and position), ``examples`` and ``collator`` (plans ->
    micro-batches); ``lengths_table`` holds the example lengths."""

    def __init__(
        self,
        sources: list[Source],
        builder: TemplateBuilder,
        settings: StreamSettings | None = None,
        *,
        dp_rank: int,
        dp_world_size: int,
        accumulation: int = 1,
        **values,
    ):
        """``settings``: the stream's (a run plan's ``StreamSettings``, checked when it was
        made); or its fields by name (``values``: ``seq_len=``, ``mode=``, ... as
        ``StreamSettings`` takes them, checked here), as the tests and benchmarks build one."""
        if settings is None:
            settings = StreamSettings(**values)  # refuses values out of range, naming the key
        elif values:
            raise TypeError(f"SpeechLMDataset: settings and {sorted(values)} both given")
        self.settings = s = settings
        self.shards = ShardLayout(s.mode, s.local_batch_size, dp_rank, dp_world_size, accumulation)
        self.sources, self.builder, self.layout = sources, builder, builder.layout
        self.stats_keys = data_stats_keys(self.layout.num_streams)
        keep_eligible(sources)
        preference = preference_stream(sources)  # (refuses a mixture with other tasks)
        # speaker prompts of the prompted tasks (tts_prompt), drawn within each source's split
        prompted = any(get_task(src.task).prompted for src in sources)
        self.prompts = SpeakerPrompts(sources, s.seed) if prompted else None
        self.lengths_table = LengthTable(sources, builder, self.prompts)
        self.check_lengths(s.max_too_long_fraction, s.seq_len_key)
        mixture = Mixture(
            sources,
            step_pieces=self.step_pieces,
            seed=s.seed,
            shuffle=s.shuffle,
            infinite=s.infinite,
            cfg_dropout=s.train_cfg_dropout,
            length=self.lengths_table.length,
            prompts=self.prompts,
            own_shards=self.own_shards(),
            order=s.start_order,
        )
        self.sampler = StreamSampler(mixture, self.settings, self.shards)
        self.examples = Examples(sources, builder)
        continuous = any(get_task(s.task).continuous for s in sources)
        self.collator = Collator(self.layout, builder, self.examples, continuous, preference)

    @property
    def preference(self) -> bool:
        """Whether the stream's tasks are preference tasks (its batches carry pairs)."""
        return self.collator.preference

    def set_reference_logps(self, table: dict[int, np.ndarray] | None) -> None:
        """The pairs' reference log-probs, ``{source index: float [items, 2]}`` (chosen,
        rejected) of every item of each source's dataset, NaN where none; each batch's
        ``pref_ref`` is looked up in it (data/pairs.py). Not part of the stream's position or
        state (it is no data order): set it again after a resume, before the loader's
        workers start (they take a copy of the stream when they do)."""
        if not self.preference:
            raise ValueError("reference log-probs for a stream without preference tasks")
        self.collator.reference = None if table is None else {
            int(k): np.asarray(v, dtype=np.float32) for k, v in table.items()
        }  # fmt: skip

    @property
    def step_pieces(self) -> int:
        """Pieces per optimizer step: the global batch's rows (pack) or micro-batches (bucket)."""
        return self.shards.step_pieces

    def lengths(self, src: int) -> np.ndarray:
        """Frames of every eligible item's example (no CFG drop), from the index alone."""
        return self.lengths_table.lengths(src)

    def check_lengths(self, max_fraction: float, key: str) -> None:
        """Stop before the first step if no sample (or too large a share) fits ``seq_len``."""
        check_lengths(self.lengths_table, self.settings.seq_len, max_fraction, key)

    def slice_shards(self, m: int, r: int | None = None) -> list[int]:
        """The shards (pieces of a step) of rank ``r``'s micro-batch ``m``."""
        return self.shards.slice_shards(m, r)

    def own_shards(self) -> list[int]:
        return self.shards.own_shards()

    def batch_bytes(self, unit: Unit) -> int:
        """Bytes of the micro-batch ``collate`` builds from ``unit`` (for the loader's bundles)."""
        return batch_bytes(unit, self.layout.num_streams)

    # ---- position ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Back to the start of the stream."""
        self.sampler.reset()

    def state_dict(self) -> dict:
        """The position after the last planned micro-batch, and what the stream is made of."""
        return self.sampler.state_dict(self.layout.fingerprint())

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state, self.layout.fingerprint())

    # ---- iteration ---------------------------------------------------------------------------
    def plans(self) -> Iterator[Plan]:
        """This rank's micro-batches as ``Plan``s (which samples go where), without building
        them: cheap, from item lengths alone. The loader computes them once, in the main
        process, and hands each to one loader worker to build (components/dataloader.py)."""
        return self.sampler.plans()

    def __iter__(self):
        """Micro-batches ``(inputs, labels)``; in a plain DataLoader's worker ``w`` of ``n``,
        micro-batches ``w, w + n, ...`` (SpeechLMDataLoader instead plans once, in the main
        process, and spreads only the building over its workers)."""
        worker = get_worker_info()
        n_workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        for i, plan in enumerate(self.plans()):
            if i % n_workers == worker_id:
                yield self.collate(plan.unit, plan.skipped)

    def fetch(
        self, plan: Plan, sample_hashes: bool = False
    ) -> tuple[tuple[dict, torch.Tensor], dict]:
        """Build a planned micro-batch: ``(batch, meta)``, meta holding the stream position
        after it, the sample ids and (``sample_hashes``) each sample's content hash."""
        hashes: list[str] | None = [] if sample_hashes else None
        batch = self.collate(plan.unit, plan.skipped, hashes)
        ids = [self.sample_id(d) for row in plan.unit.rows for d in row]
        return batch, {"position": plan.position, "samples": hashes, "ids": ids}

    def collate(
        self, unit: Unit, skipped_too_long: int = 0, sample_hashes: list[str] | None = None
    ) -> tuple[dict, torch.Tensor]:
        """Frames, targets, weights and positions of a unit's rows; with ``sample_hashes``, a
        content hash of every sample placed is appended to it."""
        return self.collator.collate(unit, skipped_too_long, sample_hashes)

    def sample_id(self, d: Draw) -> str:
        """``TASK:DATASET:ITEM_ID`` of a draw: what a log of a bad step names."""
        return self.examples.sample_id(d)
