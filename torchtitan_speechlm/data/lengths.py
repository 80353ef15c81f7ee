"""Example lengths from the index, and the check that the samples fit ``seq_len``.

The planner needs only lengths, so a stream never builds an example to plan it: each source's
example lengths (with and without CFG drop) come once from the index's text and audio lengths
(``TemplateBuilder.length``), and a draw looks its length up. A speaker prompt adds its own
turn's frames, from the prompt item's index length (``TemplateBuilder.prompt_length``). Only
a dialogue reader without turn counts is measured by building the example.
"""

from __future__ import annotations

import numpy as np

from torchtitan_speechlm.data.mixing import Source
from torchtitan_speechlm.data.tasks import TemplateBuilder, get_task


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
        s = self.sources[src]
        table = self.table(src, False)
        if table is not None:
            out = table[s.indices].astype(np.int64)
            if self.prompts is not None and self.prompts.prompted(src):
                longest = self.prompts.longest_prompt(src)[s.indices]
                has = longest >= 0
                out = out.astype(np.int64)
                out[has] += self.builder.prompt_length(longest[has])
            return out
        return np.array([self.length(src, int(i), False) for i in s.indices], dtype=np.int64)

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
            table = self._from_index(self.sources[src], cfg_drop)
            # uint16 where every length fits (2 bytes per item of the dataset: 20 MB for 10M
            # items, on every rank), else int32
            if table is not None:
                table = np.asarray(table)
                small = table.size == 0 or (table.min() >= 0 and table.max() < 2**16)
                table = table.astype(np.uint16 if small else np.int32)
            self._tables[key] = table
        return self._tables[key]

    def _from_index(self, s: Source, cfg_drop: bool):
        data, spec = s.data, get_task(s.task)
        continuous = spec.continuous  # audio: the (one) turn's wave samples

        def lengths():
            audio = getattr(data, "wave_samples", None) if continuous else data.audio_lengths
            return np.asarray(data.text_lengths), np.asarray(audio)

        if spec.turns is not None:  # a task template with fixed turns
            return self.builder.length(s.task, *lengths(), cfg_drop=cfg_drop)
        if getattr(data, "num_turns", None) is not None:
            return self.builder.length(
                s.task,
                *lengths(),
                n_audio_turns=np.asarray(data.num_audio_turns),
                n_turns=np.asarray(data.num_turns),
            )
        return None


def check_lengths(
    table: LengthTable, seq_len: int, max_fraction: float, key: str = "training.seq_len"
) -> None:
    """Stop before the first step if no sample (or too large a share) fits ``seq_len``:
    otherwise a stream with nothing to emit spins for ever."""
    for i, s in enumerate(table.sources):
        need = table.lengths(i) - 1  # input positions a sample occupies
        too_long = need > seq_len
        if not too_long.any():
            continue
        name = f"{s.task}:{s.name}"
        shortest, longest = int(need.min()), int(need.max())
        if too_long.all():
            raise DataLengthError(
                f"no sample of {name} fits {key} = {seq_len} frames: the shortest of "
                f"its {len(need)} samples needs {shortest} frames (the longest {longest}); "
                f"set {key} >= {shortest}, or >= {longest} to keep them all"
            )
        frac = float(too_long.mean())
        if frac > max_fraction:
            keep99 = int(np.quantile(need, 0.99, method="higher"))
            raise DataLengthError(
                f"{100 * frac:.1f}% of the samples of {name} ({int(too_long.sum())} of "
                f"{len(need)}) are longer than {key} = {seq_len} frames and would be "
                f"skipped (limit speechlm_data.max_too_long_fraction = {max_fraction}); set "
                f"{key} >= {keep99} to keep 99% of them (>= {longest} for all), or raise "
                "speechlm_data.max_too_long_fraction"
            )
