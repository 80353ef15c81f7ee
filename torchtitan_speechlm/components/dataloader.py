"""Training data for torchtitan's loop: the stateful loader and its checkpoint state.

Each micro-batch is ``(input_dict, labels)``:
  input_dict = {"input": [B,T,N], "targets": [B,T,N], "loss_weights": [B,T,N],
                "position_ids": [B,T], "data_stats": [1,K]}
  labels     = [B,T]: 0 where the frame carries loss, -100 elsewhere. torchtitan divides the loss
               sum by the global count of these frames (ESPnet's ``count``).
The stream itself (mixing, packing/bucketing, exact resume) is in ``data/stream.py``; the
spec's builder (trainer/builders.py) makes it from the job config.
"""

from __future__ import annotations

import json
import os
import pickle

from torch.utils.data import Dataset, Sampler

from torchtitan_speechlm.data.collation import batch_hash
from torchtitan_speechlm.data.position import gather_position
from torchtitan_speechlm.data.sampler import Plan
from torchtitan_speechlm.data.stream import SpeechLMDataset
from torchtitan_speechlm.data.transport import Inbox, Outbox
from torchtitan_speechlm.utils.upstream import ParallelAwareDataloader, logger


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
