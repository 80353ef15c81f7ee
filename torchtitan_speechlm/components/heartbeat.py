"""Rank heartbeats in the c10d store: which peer hung or died when a collective fails.

A gloo/NCCL timeout says "timed out waiting for recv", not *who* did not come. Every rank
runs a daemon thread that bumps its counter ``speechlm/heartbeat/{rank}`` in the job's
rendezvous store once per ``PERIOD`` seconds. A rank stopped with SIGSTOP or killed stops
bumping (all of its threads stop). When a collective fails, ``silent_ranks`` reads every
counter twice, ``3 x PERIOD`` apart: the ranks whose counter did not move are the ones
named in the error (trainer/faults.py). Counters, not clocks, so hosts need not agree on the time.

The store is torchrun's (in its agent process), so it outlives a dead rank 0. One Heartbeat
belongs to a run's TrainingState; the trainer starts it once the process group is up.
"""

from __future__ import annotations

import threading
import time

PERIOD = 1.0  # one tiny store write per rank per second (a 4096-rank job: ~4k store ops/s)
KEY = "speechlm/heartbeat/{rank}"


class Heartbeat:
    def __init__(self) -> None:
        self.store = None
        self.rank = 0
        self.world = 1
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start beating (idempotent; a no-op without a multi-rank process group)."""
        import torch.distributed as dist

        if self._thread is not None or not dist.is_initialized() or dist.get_world_size() < 2:
            return
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self.store = _get_default_store()
        except Exception:  # no store to beat into: errors then name no rank
            return
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._thread = threading.Thread(target=self._beat, name="speechlm-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        key = KEY.format(rank=self.rank)
        while True:
            try:
                self.store.add(key, 1)
            except Exception:
                return  # the store is gone (the job is ending)
            time.sleep(PERIOD)

    def _counters(self) -> list[int | None]:
        out = []
        for r in range(self.world):
            try:
                out.append(self.store.add(KEY.format(rank=r), 0))
            except Exception:
                out.append(None)
        return out

    def silent_ranks(self) -> list[int] | None:
        """Peers whose heartbeat did not move in 3 periods; None if the store is unreachable."""
        if self.store is None:
            return []
        first = self._counters()
        if all(c is None for c in first):
            return None
        time.sleep(3 * PERIOD)
        second = self._counters()
        return [
            r
            for r, (a, b) in enumerate(zip(first, second, strict=True))
            if r != self.rank and (a is None or a == b)
        ]
