"""A shard's walk: window after window of draws, each turned into pieces by the planner.

A window is ``speechlm_data.window`` draws (the samples carried in from the previous window
first), the too-long ones set aside, the rest packed or bucketed (planner.py) and, in
training, the pieces shuffled. Nothing here depends on the data-parallel layout: a window is a
function of its start state (position.py ``WindowState``) and of the stream's settings, so a
shard cursor (start state + pieces taken) is enough to rebuild and continue it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from torchtitan_speechlm.data.mixing import Mixture
from torchtitan_speechlm.data.planner import Draw, split_too_long, window_pieces
from torchtitan_speechlm.data.position import ShardCursor, WindowState
from torchtitan_speechlm.data.settings import StreamSettings
from torchtitan_speechlm.utils.upstream import logger

PACK_ORDER_SEED = 65537  # a window's pack candidates: permutation [seed, shard, window, this]
PIECE_ORDER_SEED = 31337  # a window's piece order: permutation [seed, shard, window, this]


@dataclass
class Window:
    """A built window: its pieces (pack: rows, bucket: units), the samples skipped as too
    long, whether the shard's stream ends with it, and the state the next window starts at."""

    pieces: list
    too_long: list[Draw]
    done: bool
    after: WindowState


class ShardWindows:
    """Builds shards' windows from the mixture and the stream's settings."""

    def __init__(self, mixture: Mixture, settings: StreamSettings):
        self.mixture, self.settings = mixture, settings
        self._warned_long: set[int] = set()

    def window(self, state: WindowState, shard: int) -> Window:
        """Shard ``shard``'s window starting at ``state`` (not changed: the walk advances a
        copy). A state that fixes its window size and token budget (``build``) is rebuilt with
        those; otherwise the current settings apply."""
        s = self.settings
        build = state.build or self._build()
        rng = np.random.default_rng(0)
        rng.bit_generator.state = state.rng
        epoch, pos = list(state.epoch), list(state.pos)
        draws = [Draw(*d) for d in state.carried]
        exhausted = False
        while len(draws) < build["window"]:
            d = self.mixture.draw(epoch, pos, rng, shard)
            if d is None:
                exhausted = True
                break
            draws.append(d)
        draws, too_long = split_too_long(draws, s.seq_len)
        key = [s.seed, shard, state.index]
        pieces, carried = window_pieces(
            draws,
            mode=s.mode,
            seq_len=s.seq_len,
            max_tokens=build["max_tokens"],
            window=build["window"],
            final=exhausted or not s.infinite,
            pack_order=self._pack_order(key, len(draws)),
        )
        if s.shuffle:
            order = np.random.default_rng([*key, PIECE_ORDER_SEED]).permutation(len(pieces))
            pieces = [pieces[i] for i in order]
        self._warn_too_long(too_long)
        carry = tuple(d.as_tuple() for d in carried)
        after = WindowState(
            tuple(epoch), tuple(pos), rng.bit_generator.state, carry, state.index + 1
        )
        return Window(pieces, too_long, exhausted and not carried, after)

    def _build(self) -> dict:
        return {"window": self.settings.window, "max_tokens": self.settings.token_budget}

    def _pack_order(self, key: list[int], n: int) -> np.ndarray | None:
        """The seeded order a window's pack candidates are offered in (pack only)."""
        if self.settings.mode != "pack":
            return None
        return np.random.default_rng([*key, PACK_ORDER_SEED]).permutation(n)

    def _warn_too_long(self, too_long: list[Draw]) -> None:
        for d in too_long:
            if d.src not in self._warned_long:  # once per source; all are counted
                self._warned_long.add(d.src)
                src = self.mixture.sources[d.src]
                logger.warning(
                    f"skipping samples of {src.task}:{src.name} longer than seq_len "
                    f"{self.settings.seq_len} (first: item {d.item}, {d.length - 1} frames); "
                    "all are counted in data/skipped_too_long"
                )

    def pieces(self, shard: int, cursor: ShardCursor) -> Iterator[tuple[ShardCursor, object, int]]:
        """Yield ``(cursor after it, piece, skipped)`` for shard ``shard`` from ``cursor`` =
        its window's start state and the pieces already taken from it; ``skipped`` = samples
        dropped as too long since the previous piece (a resumed window's were counted before
        it was interrupted)."""
        state, skip, skipped = cursor.window, cursor.consumed, 0
        while True:
            built = self.window(state, shard)
            if not skip:
                skipped += len(built.too_long)
            # the window's size and token budget travel with a cursor inside it, so that a
            # resume with other settings rebuilds this window as it was cut (later ones use
            # the new settings)
            fixed = state if state.build else replace(state, build=self._build())
            for i in range(skip, len(built.pieces)):
                yield ShardCursor(fixed, i + 1), built.pieces[i], skipped
                skipped = 0
            skip = max(0, skip - len(built.pieces))
            if built.done:
                return
            state = built.after
