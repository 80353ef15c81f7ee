"""ESPnet SpeechLM's token ids in our vocabulary (espnet_data.py's docstring): its
``vocab_intervals`` checked, and the table that maps each of its ids onto ours. Its first nine
special tokens have our names and ids, its text interval moves to our text offset, its audio
stream intervals become our codebooks; any other special has no place in our vocabulary."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.model.vocab import SPECIAL_TOKENS, VocabLayout
from torchtitan_speechlm.python_api.espnet_batch import EspnetBatchError

ESPNET_SHARED_SPECIALS = 9  # <|pad|> .. <|audio|>: same names, same ids as ours


def int_intervals(vocab_intervals: Mapping[str, Any]) -> dict[str, list[tuple[int, ...]]]:
    """``vocab_intervals`` with int bounds: {modality: [(start, end), ...]}."""
    return {k: [tuple(map(int, iv)) for iv in v] for k, v in vocab_intervals.items()}


class EspnetVocab:
    """The text and audio intervals of ESPnet's vocabulary (``int_intervals``), checked: one
    interval per audio stream, all of one size (the codebook size). ``audio`` None: the one
    modality other than the specials and ``text``."""

    def __init__(self, intervals: dict[str, list[tuple[int, ...]]], audio: str | None, text: str):
        others = [k for k in intervals if k not in ("special_token", text)]
        if audio is None:
            if len(others) != 1:
                raise ConfigError(
                    f"EspnetData: vocab_intervals has the modalities {others}; say which one is "
                    "the audio codec with audio=NAME"
                )
            audio = others[0]
        if audio not in intervals or text not in intervals:
            raise ConfigError(
                f"EspnetData: vocab_intervals needs {text!r} and {audio!r} entries, has "
                f"{sorted(intervals)}"
            )
        streams = intervals[audio]
        sizes = {e - s for s, e in streams}
        if len(sizes) != 1:
            raise ConfigError(
                f"EspnetData: the {audio!r} streams have codebooks of sizes {sorted(sizes)}; "
                "one size for every stream is needed"
            )
        self.intervals, self.audio = intervals, audio
        (self.text_start, self.text_end) = intervals[text][0]
        self.streams = streams
        self.codebook_size = sizes.pop()
        self._lut: dict[int, torch.Tensor] = {}

    def lookup(self, layout: VocabLayout) -> torch.Tensor:
        """ESPnet id -> our id (-1: not representable)."""
        key = id(layout)
        if key in self._lut:
            return self._lut[key]
        if self.text_end - self.text_start > layout.text_size:
            raise ConfigError(
                f"EspnetData: ESPnet's text interval has {self.text_end - self.text_start} ids "
                f"but the backbone has {layout.text_size} text rows; use the same backbone"
            )
        size = max(e for ivs in self.intervals.values() for _, e in ivs)
        lut = torch.full((size,), -1, dtype=torch.long)
        assert SPECIAL_TOKENS[:ESPNET_SHARED_SPECIALS][-1] == "<|audio|>"
        lut[:ESPNET_SHARED_SPECIALS] = torch.arange(ESPNET_SHARED_SPECIALS)
        lut[self.text_start : self.text_end] = layout.text_offset + torch.arange(
            self.text_end - self.text_start
        )
        for k, (s, e) in enumerate(self.streams):
            lut[s:e] = layout.code(k, 0) + torch.arange(e - s)
        self._lut[key] = lut
        return lut

    def to_ours(self, seqs: torch.Tensor, layout: VocabLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """ESPnet's ``seqs`` [B, T, N] as our ids, its pad 0 as our pad of each stream; and
        where ESPnet's pads were (bool [B, T, N])."""
        lut = self.lookup(layout)
        if int(seqs.min()) < 0 or int(seqs.max()) >= len(lut):
            raise EspnetBatchError(
                f"token id {int(seqs.max())} is outside ESPnet's vocab_intervals (size {len(lut)})"
            )
        ids = lut[seqs]
        bad = ids < 0
        if bad.any():
            raise EspnetBatchError(
                f"ESPnet token id {int(seqs[bad][0])} (a special token other than pad, bos, eos, "
                "eot, system, user, assistant, text, audio) has no place in our vocabulary"
            )
        pad = seqs == 0
        pads = torch.tensor(layout.pad_frame())
        return torch.where(pad, pads.expand_as(ids), ids), pad
