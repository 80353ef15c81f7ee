"""Which shards (pieces of an optimizer step) each rank's micro-batch is built from.

A step is ``step_pieces`` pieces, piece ``j`` from shard ``j``. Rank ``r``'s micro-batch ``m``
(of ``accumulation``) is slice ``i = m * dp + r`` of the step: pieces ``i*B .. i*B+B-1``
(pack, ``B`` rows) or ``i`` (bucket, one micro-batch per piece). Which samples form a step
depends only on ``step_pieces``, so the layout (processes x accumulation) decides who builds
which slice, never what a step holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLayout:
    """This rank's place in the data-parallel layout and the pieces of a micro-batch."""

    mode: str
    local_batch_size: int
    dp_rank: int
    dp_world_size: int
    accumulation: int = 1

    @property
    def per_micro(self) -> int:
        """Pieces per micro-batch: its rows (pack) or the one bucket unit."""
        return self.local_batch_size if self.mode == "pack" else 1

    @property
    def step_pieces(self) -> int:
        """Pieces per optimizer step: the global batch's rows (pack) or micro-batches (bucket)."""
        return self.per_micro * self.dp_world_size * self.accumulation

    def slice_shards(self, m: int, r: int | None = None) -> list[int]:
        """The shards (pieces of a step) of rank ``r``'s micro-batch ``m``."""
        i = m * self.dp_world_size + (self.dp_rank if r is None else r)
        return list(range(i * self.per_micro, (i + 1) * self.per_micro))

    def own_shards(self) -> list[int]:
        """Every shard this rank builds, in micro-batch order."""
        return [j for m in range(self.accumulation) for j in self.slice_shards(m)]
