"""Speaker prompts of the prompted tasks (``tts_prompt``): which other utterance of an item's
speaker a draw of it is prompted with.

The candidates of an item are the other items of its speaker *within the source's split* (a
training source's items after the validation hold-out, a validation set's held-out items: the
hold-out is by item-id hash, so one speaker's items fall on both sides and a prompt never
crosses it), never the item itself. Speakers are the dataset's own (``PreparedDataset.
item_speakers``): each source is one dataset, so two datasets' speakers of the same name never
meet. The draw is a pure function of (seed, source, epoch, shard, item): no random generator
of the stream is advanced, so every existing draw is unchanged, and a resumed stream (whose
window states hold the epochs, and whose carried draws hold their prompts) draws exactly the
same prompts. An item whose speaker has no other utterance in the split has no prompt: it is
trained unprompted (its task's template without the prompt turn, i.e. ``tts``), and the
items so affected are counted (``unprompted``, logged once per source).
"""

from __future__ import annotations

import numpy as np

from torchtitan_speechlm.data.mixing import Source
from torchtitan_speechlm.data.tasks import get_task
from torchtitan_speechlm.utils.upstream import logger

PROMPT_SEED = 1299709  # a prompt draw hashes [seed, PROMPT_SEED, source, epoch, shard, item]
_MASK = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def prompt_hash(*values: int) -> int:
    """A 64-bit hash of integers, the same on every platform and Python version."""
    h = 0
    for v in values:
        h = _splitmix(h ^ (int(v) & _MASK))
    return h


class SpeakerPromptError(ValueError):
    """A prompted task on a dataset that names no speakers."""


class SpeakerPrompts:
    """The prompt candidates of the prompted sources, and the draw."""

    def __init__(self, sources: list[Source], seed: int):
        self.seed = seed
        # per prompted source, over the dataset's item numbers: the split's items grouped by
        # speaker (``members``), each item's group start and size, its place in its group, and
        # the longest audio among its candidates (-1: no candidate)
        self._tables: dict[int, tuple[np.ndarray, ...]] = {}
        self.unprompted: dict[int, int] = {}
        for src, s in enumerate(sources):
            if get_task(s.task).prompted:
                self._tables[src] = self._table(s)
                self._report(src, s)

    def prompted(self, src: int) -> bool:
        return src in self._tables

    @staticmethod
    def _table(s: Source) -> tuple[np.ndarray, ...]:
        data = s.data
        if not getattr(data, "has_speakers", False):
            raise SpeakerPromptError(
                f"{s.task}:{s.name}: task {s.task!r} prompts each item with another utterance "
                "of its speaker, and this dataset names no speakers; prepare it from a source "
                "with speaker labels (docs/data.md, Speakers)"
            )
        items = np.asarray(s.indices, dtype=np.int64)
        n = len(data)
        speaker = np.asarray(data.item_speakers, dtype=np.int64)[items]
        order = np.argsort(speaker, kind="stable")  # groups in dataset order within a speaker
        members = items[order]
        spk_sorted = speaker[order]
        bounds = np.flatnonzero(np.diff(spk_sorted)) + 1
        starts_g = np.concatenate([[0], bounds]).astype(np.int64)
        sizes_g = np.diff(np.concatenate([starts_g, [len(members)]])).astype(np.int64)
        group = np.repeat(np.arange(len(starts_g)), sizes_g)  # group of members[k]
        start = np.full(n, -1, dtype=np.int64)
        size = np.zeros(n, dtype=np.int64)
        place = np.full(n, -1, dtype=np.int64)
        start[members] = starts_g[group]
        size[members] = sizes_g[group]
        place[members] = np.arange(len(members)) - starts_g[group]
        # the longest audio of a group, and its second longest: an item's longest candidate
        # is the group's longest unless it is the item itself
        audio = np.asarray(data.audio_lengths, dtype=np.int64)[members]
        longest = np.full(n, -1, dtype=np.int64)
        for a, m in zip(starts_g, sizes_g, strict=True):
            if m < 2:
                continue
            lengths = audio[a : a + m]
            top = np.argsort(-lengths, kind="stable")[:2]
            best, second = int(lengths[top[0]]), int(lengths[top[1]])
            longest[members[a : a + m]] = best
            longest[members[a + top[0]]] = second
        return members, start, size, place, longest

    def _report(self, src: int, s: Source) -> None:
        size = self._tables[src][2]
        alone = int((size[np.asarray(s.indices, dtype=np.int64)] < 2).sum())
        self.unprompted[src] = alone
        if alone:
            logger.warning(
                f"{s.task}:{s.name}: {alone} of {len(s.indices)} items have no other utterance "
                "of their speaker in this split; they are trained unprompted (as tts)"
            )

    def candidates(self, src: int, item: int) -> np.ndarray:
        """The items a draw of ``item`` may be prompted with (its speaker's others)."""
        members, start, size, place, _ = self._tables[src]
        a, m = int(start[item]), int(size[item])
        if m < 2:
            return np.zeros(0, dtype=np.int64)
        group = members[a : a + m]
        return np.delete(group, int(place[item]))

    def longest_prompt(self, src: int) -> np.ndarray:
        """int64 [items of the dataset]: the longest audio (codec frames, before the cut) an
        item can be prompted with; -1: no prompt."""
        return self._tables[src][4]

    def draw(self, src: int, item: int, epoch: int, shard: int) -> int:
        """The prompt of ``item`` drawn by shard ``shard`` in epoch ``epoch``: another item of
        its speaker in the split (-1: there is none)."""
        members, start, size, place, _ = self._tables[src]
        m = int(size[item])
        if m < 2:
            return -1
        k = prompt_hash(self.seed, PROMPT_SEED, src, epoch, shard, item) % (m - 1)
        if k >= int(place[item]):
            k += 1  # never the item itself
        return int(members[int(start[item]) + k])
