"""The sampler: this rank's micro-batches as plans, and the stream position that resumes them.

It walks this rank's own shards (shards.py) window by window (windows.py) and joins each
micro-batch's pieces into a ``Plan``: which samples go where, from lengths alone, plus the
position after it. Like lhotse's samplers it owns the position (``state_dict`` /
``load_state_dict``), and it refuses a saved position this run cannot continue, saying why.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

from torchtitan_speechlm.data.mixing import Mixture
from torchtitan_speechlm.data.planner import Unit
from torchtitan_speechlm.data.position import ShardCursor, StreamPosition, WindowState
from torchtitan_speechlm.data.settings import ORDERS, StreamSettings
from torchtitan_speechlm.data.shards import ShardLayout
from torchtitan_speechlm.data.windows import ShardWindows
from torchtitan_speechlm.model.vocab import VocabMismatchError
from torchtitan_speechlm.utils.upstream import logger

EXCLUDE = "add 'dataloader' to checkpoint.exclude_from_loading to restart the data stream"


@dataclass
class Plan:
    """A micro-batch before it is built: its unit, the samples skipped as too long since the
    previous one, and the stream position after it (the checkpoint's dict form)."""

    unit: Unit
    skipped: int
    position: dict


class StreamResumeError(ValueError):
    """A checkpoint's data position cannot be continued by this run; the message says why."""


def check_same_stream(state: dict, names: list[str], vocab: str, pieces: dict) -> None:
    """Refuse a saved stream of another format, mixture, vocabulary or kind of piece."""
    if "shards" not in state.get("position", {}):
        raise StreamResumeError(
            "the checkpoint's data position was written by an older torchtitan_speechlm "
            "stream format; add 'dataloader' to checkpoint.exclude_from_loading to restart "
            "the data stream, or start a new dump_folder"
        )
    if state.get("sources") != names:
        raise StreamResumeError(
            f"checkpointed data mixture {state.get('sources')} differs from the configured "
            f"{names}; resume with the same speechlm_data.train, or start a new dump_folder"
        )
    if state.get("vocab") != vocab:
        raise VocabMismatchError(
            f"the checkpoint was trained with vocabulary layout {state.get('vocab')} but this "
            f"run builds {vocab} (different backbone, tokenizer or codec); "
            "resume with the original assets or start a new dump_folder"
        )
    saved = state.get("pieces", {})
    default = {"order": "permutation"}  # not recorded: the order before the setting existed
    for key in [*pieces, *(k for k in saved if k not in pieces)]:
        was, now = saved.get(key, default.get(key)), pieces.get(key, default.get(key))
        if was != now:
            what = {"mode": "speechlm_data.batching", "order": "speechlm_data.order"}.get(
                key, f"training.{key}"
            )
            raise StreamResumeError(
                f"the checkpoint's data stream was cut with {what} = {was!r}, this run uses "
                f"{now!r}: the saved position cannot be continued. Keep {what} = {was!r}, or "
                f"{EXCLUDE}"
            )


def check_resume_layout(pos: StreamPosition, layout: ShardLayout) -> None:
    """Refuse a position cut into another number of pieces per step, taken mid-step on another
    layout, or lacking this rank's shards."""
    if pos.step_pieces != layout.step_pieces:
        unit = "rows" if layout.mode == "pack" else "micro-batches"
        raise StreamResumeError(
            f"the checkpoint's data stream has {pos.step_pieces} {unit} per optimizer "
            f"step and this run {layout.step_pieces} (training.global_batch_size, or local "
            "batch x data-parallel degree x accumulation): the stream is sharded by it and "
            f"cannot continue with another. Keep the global batch, or {EXCLUDE}"
        )
    if pos.micro_done and pos.accumulation != layout.accumulation:
        raise StreamResumeError(
            "the checkpoint was taken in the middle of an optimizer step and this run has "
            "another data-parallel layout; resume with the original layout"
        )
    missing = [j for j in layout.own_shards() if j not in pos.shards]
    if missing:
        raise StreamResumeError(
            f"the saved data position lacks shards {missing[:8]} of this rank (a state "
            "saved by one rank of a multi-rank run without merging; see "
            "SpeechLMDataLoader.state_dict)"
        )


class StreamSampler:
    """This rank's plans from its own shards, and the position after the last one planned."""

    def __init__(self, mixture: Mixture, settings: StreamSettings, layout: ShardLayout):
        self.mixture, self.settings, self.layout = mixture, settings, layout
        self.windows = ShardWindows(mixture, settings)
        self.names = [f"{s.task}:{s.name}" for s in mixture.sources]
        self.reset()

    def reset(self) -> None:
        """Back to the start of the stream."""
        n, seed = len(self.mixture.sources), self.settings.seed
        shards = {j: ShardCursor(WindowState.first(n, seed, j)) for j in self.layout.own_shards()}
        self._start = StreamPosition(
            0, 0, self.layout.accumulation, self.layout.step_pieces, shards
        )
        self._position = self._start
        self.mixture.reset()

    @property
    def piece_params(self) -> dict:
        """What a piece is made of: a resume with other values cannot continue the stream
        (``order`` only when not the default: the positions of runs before it had none)."""
        order = self.mixture.order
        keyed = {"order": order} if order != "permutation" else {}
        return {"mode": self.settings.mode, "seq_len": self.settings.seq_len, **keyed}

    def state_dict(self, vocab: str) -> dict:
        """The position after the last planned micro-batch (this rank's shards; the loader
        merges all ranks' when it saves), plus what the stream is made of (``vocab``: the
        vocabulary layout's fingerprint), to refuse an incompatible resume."""
        return {
            "position": copy.deepcopy(self._position.to_dict()),
            "pieces": self.piece_params,
            "sources": list(self.names),
            "vocab": vocab,
        }

    def load_state_dict(self, state: dict, vocab: str) -> None:
        """Continue from a saved position (any rank's merged state; this rank takes its own
        shards), refusing one this run cannot continue."""
        if self.settings.order == "auto":  # continue in the checkpoint's order
            self.follow_order(state.get("pieces", {}).get("order", "permutation"))
        check_same_stream(state, self.names, vocab, self.piece_params)
        pos = StreamPosition.from_dict(copy.deepcopy(state["position"]))
        check_resume_layout(pos, self.layout)
        self._start = self._position = pos.for_rank(
            self.layout.own_shards(), self.layout.accumulation
        )

    def follow_order(self, saved: str) -> None:
        """``order = "auto"``: take the saved stream's epoch order (a run started before
        stream version 2 continues on numpy's permutation)."""
        if saved != self.mixture.order and saved in ORDERS:
            logger.info(
                f'speechlm_data.order = "auto": the checkpoint\'s data stream was cut with '
                f"order {saved!r}; continuing in it (a new run would use "
                f"{self.settings.start_order!r})"
            )
            self.mixture.order = saved
            self.mixture.reset()

    def micro_batch(self, pieces: list) -> Unit:
        """A micro-batch from its slice's pieces: B rows (pack) or the one unit (bucket)."""
        if self.settings.mode == "pack":
            return Unit([p for p in pieces if p is not None], t=self.settings.seq_len)
        return pieces[0] if pieces and pieces[0] is not None else Unit([], t=0)

    def plans(self) -> Iterator[Plan]:
        """This rank's micro-batches as ``Plan``s (which samples go where), without building
        them: cheap, from item lengths alone."""
        position = self._start
        self.mixture.warm({(src, e) for c in position.shards.values()
                           for src, e in enumerate(c.window.epoch)})  # fmt: skip
        shards = {j: self.windows.pieces(j, c) for j, c in position.shards.items()}
        cursors = dict(position.shards)
        done: set[int] = set()  # shards at the end of a finite pass
        while len(done) < len(shards):
            own = self.layout.slice_shards(position.micro_done)
            got = [None if j in done else next(shards[j], None) for j in own]
            done.update(j for j, g in zip(own, got, strict=True) if g is None)
            skipped = 0
            for j, g in zip(own, got, strict=True):
                if g is not None:
                    cursors[j] = g[0]
                    skipped += g[2]
            unit = self.micro_batch([g[1] if g is not None else None for g in got])
            last = position.micro_done == self.layout.accumulation - 1
            position = self._position = position.advanced(last, cursors)
            if unit.rows:  # else nothing is left for this slice in a finite pass
                yield Plan(unit, skipped, position.to_dict())
