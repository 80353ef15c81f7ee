"""Example lengths from the index, and the check that the samples fit ``seq_len``.

The planner needs only lengths, so a stream never builds an example to plan it: each source's
example lengths (with and without CFG drop) come once from the index's text and audio lengths
(``TemplateBuilder.length``), and a draw looks its length up. A speaker prompt adds its own
turn's frames, from the prompt item's index length (``TemplateBuilder.prompt_length``). Only
a dialogue reader without turn counts is measured by building the example.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from torchtitan_speechlm.data.mixing import AllItems, Source
from torchtitan_speechlm.data.tasks import TemplateBuilder, get_task

CHUNK = 1 << 22  # items per piece of a pass over every item's length


class DataLengthError(ValueError):
    """No (or too few) samples fit the configured sequence length."""


class LengthTable:
    """Frames of every item's example, per source and CFG drop, computed on first use."""

    def __init__(self, sources: list[Source], builder: TemplateBuilder, prompts=None):
        """``prompts``: the sources' speaker prompts (speaker_prompts.py), for the longest
        prompt an item can draw (``lengths``)."""
        self.sources, self.builder, self.prompts = sources, builder, prompts
        self._tables: dict[tuple[int, bool], np.ndarray | None] = {}

    def lengths(self, src: int) -> np.ndarray:
        """Frames of every eligible item's example (no CFG drop), from the index alone; a
        prompted source's with the longest prompt the item can draw."""
        chunks = [c.astype(np.int64) for c in self.length_chunks(src)]
        return np.concatenate([np.zeros(0, np.int64), *chunks])

    def length_chunks(self, src: int) -> Iterator[np.ndarray]:
        """``lengths(src)`` in pieces of at most ``CHUNK`` items (the table's own narrow dtype
        where it can: a pass over 10^8 items without an int64 array of them all)."""
        s = self.sources[src]
        table = self.table(src, False)
        if table is None:
            yield np.array([self.length(src, int(i), False) for i in s.indices], dtype=np.int64)
            return
        prompted = self.prompts is not None and self.prompts.prompted(src)
        if isinstance(s.indices, AllItems) and not prompted:
            for a in range(0, len(table), CHUNK):
                yield table[a : a + CHUNK]  # every item in order: no gather, no copy
            return
        for a in range(0, len(s.indices), CHUNK):
            idx = np.asarray(s.indices[a : a + CHUNK])
            out = table[idx].astype(np.int64)
            if prompted:
                longest = self.prompts.longest_prompt(src)[idx]
                has = longest >= 0
                out[has] += self.builder.prompt_length(longest[has])
            yield out

    def length(self, src: int, item: int, cfg_drop: bool, prompt: int = -1) -> int:
        """Frames of the example of item ``item`` of source ``src`` (with the speaker prompt
        item ``prompt``, -1: none)."""
        table = self.table(src, cfg_drop)
        if table is not None:
            if prompt >= 0:
                n = int(self.sources[src].data.audio_lengths[prompt])
                return int(table[item]) + int(self.builder.prompt_length(n))
            return int(table[item])
        # a dialogue reader without turn counts: build the example to measure it
        s = self.sources[src]
        return len(self.builder.build(s.task, s.data[item]).frames)

    def table(self, src: int, cfg_drop: bool) -> np.ndarray | None:
        """Example lengths of every item of a source, computed once from the index (a draw
        looks its length up); None for a dialogue reader without turn counts."""
        key = (src, cfg_drop)
        if key not in self._tables:
            self._tables[key] = self._narrow_table(self.sources[src], cfg_drop)
        return self._tables[key]

    def _narrow_table(self, s: Source, cfg_drop: bool) -> np.ndarray | None:
        """uint16 where every length fits (2 bytes per item of the dataset: 20 MB for 10M
        items, on every rank), else int32; computed ``CHUNK`` items at a time (the int64
        arithmetic of 10^8 items at once would take GBs for a moment)."""
        n = len(s.data.text_lengths) if hasattr(s.data, "text_lengths") else 0
        out = np.empty(n, np.uint16)
        for a in range(0, max(n, 1), CHUNK):
            part = self._from_index(s, cfg_drop, slice(a, a + CHUNK))
            if part is None:
                return None
            part = np.asarray(part)
            if out.dtype == np.uint16 and part.size and (part.min() < 0 or part.max() >= 2**16):
                out = out.astype(np.int32)
            out[a : a + len(part)] = part
        return out

    def _from_index(self, s: Source, cfg_drop: bool, rows: slice):
        """The example lengths of items ``rows`` of the source's dataset."""
        data, spec = s.data, get_task(s.task)
        continuous = spec.continuous  # audio: the (one) turn's wave samples

        def lengths():
            audio = getattr(data, "wave_samples", None) if continuous else data.audio_lengths
            return np.asarray(data.text_lengths[rows]), np.asarray(
                audio if audio is None else audio[rows]
            )

        if spec.turns is not None:  # a task template with fixed turns
            return self.builder.length(s.task, *lengths(), cfg_drop=cfg_drop)
        if getattr(data, "num_turns", None) is not None:
            return self.builder.length(
                s.task,
                *lengths(),
                n_audio_turns=np.asarray(data.num_audio_turns[rows]),
                n_turns=np.asarray(data.num_turns[rows]),
            )
        return None


def check_lengths(
    table: LengthTable, seq_len: int, max_fraction: float, key: str = "training.seq_len"
) -> None:
    """Stop before the first step if no sample (or too large a share) fits ``seq_len``:
    otherwise a stream with nothing to emit spins for ever."""
    for i, s in enumerate(table.sources):
        count = too_many = 0
        shortest, longest = None, 0
        for chunk in table.length_chunks(i):  # a sample occupies its length - 1 positions
            too_many += int((chunk > seq_len + 1).sum())
            count += len(chunk)
            if len(chunk):
                low = int(chunk.min()) - 1
                shortest = low if shortest is None else min(shortest, low)
                longest = max(longest, int(chunk.max()) - 1)
        if not too_many:
            continue
        name = f"{s.task}:{s.name}"
        if too_many == count:
            raise DataLengthError(
                f"no sample of {name} fits {key} = {seq_len} frames: the shortest of "
                f"its {count} samples needs {shortest} frames (the longest {longest}); "
                f"set {key} >= {shortest}, or >= {longest} to keep them all"
            )
        frac = too_many / count
        if frac > max_fraction:
            keep99 = int(np.quantile(table.lengths(i) - 1, 0.99, method="higher"))
            raise DataLengthError(
                f"{100 * frac:.1f}% of the samples of {name} ({too_many} of "
                f"{count}) are longer than {key} = {seq_len} frames and would be "
                f"skipped (limit speechlm_data.max_too_long_fraction = {max_fraction}); set "
                f"{key} >= {keep99} to keep 99% of them (>= {longest} for all), or raise "
                "speechlm_data.max_too_long_fraction"
            )
