"""Where the stream stands, as types: what a checkpoint saves and a resume continues from.

A position is the optimizer steps done, the micro-batches done in an unfinished step, and each
shard's cursor: the state its current window started from (per source: epoch and place in
that epoch's permutation; the shard's random generator; the samples carried in from the
previous window; the window's number) and how many of that window's pieces were taken. The
pieces of a window are a function of its start state, so a cursor is enough to rebuild them.

Checkpoints hold the plain-dict form (``to_dict``), pickled by the loader: ``from_dict`` reads
the checkpoints written before these types existed, and ``to_dict`` gives back the same dict,
key order and value types included, so the saved bytes are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import torch.distributed as dist

SHARD_SEED = 7919  # a shard's generator is seeded [seed, SHARD_SEED, shard]


@dataclass(frozen=True)
class WindowState:
    """The state a shard's window starts from. Never changed once made (a window's walk
    copies what it advances), so positions may share it."""

    epoch: tuple[int, ...]  # per source: passes done over the shard's items
    pos: tuple[int, ...]  # per source: items taken in the current pass
    rng: dict  # numpy bit_generator.state of the shard's generator
    carried: tuple[tuple[int, int, bool, int, int], ...] = ()  # Draw.as_tuple() of each
    index: int = 0  # windows of this shard before this one
    build: dict | None = None  # {"window", "max_tokens"} if a saved state fixed them

    @classmethod
    def first(cls, num_sources: int, seed: int, shard: int) -> WindowState:
        """Shard ``shard``'s first window."""
        rng = np.random.default_rng([seed, SHARD_SEED, shard]).bit_generator.state
        return cls((0,) * num_sources, (0,) * num_sources, rng)

    def to_dict(self) -> dict:
        """The checkpoint form (made once and shared by every position at this window, as
        the stream's dicts always were: treat it as read-only)."""
        return self._dict

    @cached_property
    def _dict(self) -> dict:
        d = {
            "epoch": list(self.epoch),
            "pos": list(self.pos),
            "rng": self.rng,
            "carried": list(self.carried),
            "window": self.index,
        }
        if self.build is not None:
            d["build"] = self.build
        return d

    @classmethod
    def from_dict(cls, d: dict) -> WindowState:
        return cls(
            tuple(d["epoch"]),
            tuple(d["pos"]),
            d["rng"],
            tuple(tuple(c) for c in d["carried"]),
            d["window"],
            d.get("build"),
        )


@dataclass(frozen=True)
class ShardCursor:
    """A shard's place: its current window's start state and the pieces taken from it."""

    window: WindowState
    consumed: int = 0

    def to_dict(self) -> dict:
        """The checkpoint form (made once, shared: treat it as read-only)."""
        return self._dict

    @cached_property
    def _dict(self) -> dict:
        return {"window": self.window.to_dict(), "consumed": self.consumed}

    @classmethod
    def from_dict(cls, d: dict) -> ShardCursor:
        return cls(WindowState.from_dict(d["window"]), d["consumed"])


@dataclass(frozen=True)
class StreamPosition:
    """Optimizer steps done, micro-batches done in the unfinished step, the accumulation and
    pieces per step it was cut with, and the cursors of the shards this position knows."""

    steps: int
    micro_done: int
    accumulation: int
    step_pieces: int
    shards: dict[int, ShardCursor] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "micro_done": self.micro_done,
            "accumulation": self.accumulation,
            "step_pieces": self.step_pieces,
            "shards": {j: c.to_dict() for j, c in self.shards.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> StreamPosition:
        return cls(
            d["steps"],
            d["micro_done"],
            d["accumulation"],
            d["step_pieces"],
            {j: ShardCursor.from_dict(c) for j, c in d["shards"].items()},
        )

    def advanced(self, last_micro: bool, shards: dict[int, ShardCursor]) -> StreamPosition:
        """The position after one more micro-batch (the last of its step if ``last_micro``)
        that left the shards at ``shards``."""
        return replace(
            self,
            steps=self.steps + last_micro,
            micro_done=0 if last_micro else self.micro_done + 1,
            shards=dict(shards),
        )

    def for_rank(self, own: list[int], accumulation: int) -> StreamPosition:
        """This position as a rank with shards ``own`` and ``accumulation`` continues it."""
        return replace(self, accumulation=accumulation, shards={j: self.shards[j] for j in own})

    @classmethod
    def merge(cls, positions: list[StreamPosition]) -> StreamPosition:
        """One position from the ranks' own ones: the same step everywhere, every shard."""
        steps = {(p.steps, p.micro_done) for p in positions}
        if len(steps) != 1:
            raise RuntimeError(
                f"data-parallel ranks disagree on the stream's step: {sorted(steps)}"
            )
        shards: dict[int, ShardCursor] = {}
        for p in positions:
            shards.update(p.shards)
        return replace(positions[0], shards=shards)


def merge_positions(positions: list[dict]) -> dict:
    """One stream position (dict form) from the ranks' own ones: the same step everywhere,
    every shard."""
    return StreamPosition.merge([StreamPosition.from_dict(p) for p in positions]).to_dict()


def gather_position(position: dict) -> dict:
    """Every rank's shard cursors, merged (all ranks of the default process group take part;
    tensor- and pipeline-parallel peers contribute the same shards twice, which is harmless)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return position
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, position)
    return merge_positions(parts)
