"""ESPnet SpeechLM's token ids in our vocabulary (espnet_data.py's docstring): its
``vocab_intervals`` checked, and the table that maps each of its ids onto ours.

ESPnet's vocabulary (``SpeechLMJobTemplate._build_vocabulary``): 256 special slots, then each
discrete io in its config's order. Its first nine specials have our names and ids; its text
interval moves to our text offset; an audio io has one interval per stream, each its stream's
pad token followed by the codebook (``DiscreteAudioIO._stream_intervals``: ``(s, s + C + 1)``),
which is exactly our per-stream block (``model/vocab.py``), so ESPnet's stream-k pad is ours
and its code ``s + 1 + c`` our ``code(k, c)``. Any other special has no place in our vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.model.vocab import SPECIAL_TOKENS, VocabLayout
from torchtitan_speechlm.python_api.espnet_batch import EspnetBatchError

ESPNET_SHARED_SPECIALS = 9  # <|pad|> .. <|audio|>: same names, same ids as ours
SPECIAL_KEY = "special_token"


def int_intervals(vocab_intervals: Mapping[str, Any]) -> dict[str, list[tuple[int, ...]]]:
    """``vocab_intervals`` with int bounds: {modality: [(start, end), ...]}."""
    return {k: [tuple(map(int, iv)) for iv in v] for k, v in vocab_intervals.items()}


class EspnetVocab:
    """The text and audio intervals of ESPnet's vocabulary (``int_intervals``), checked: one
    interval per audio stream, each a pad and a codebook of one common size. ``audio`` None:
    the one modality other than the specials and ``text``."""

    def __init__(self, intervals: dict[str, list[tuple[int, ...]]], audio: str | None, text: str):
        others = [k for k in intervals if k not in (SPECIAL_KEY, text)]
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
        sizes = [e - s - 1 for s, e in streams]  # each interval: the stream's pad, its codes
        if min(sizes) < 1 or len(set(sizes)) != 1:
            raise ConfigError(
                f"EspnetData: the {audio!r} streams have codebooks of sizes {sizes} (each "
                "interval is a pad and the codes); this trainer needs one size for every stream"
            )
        self.intervals, self.audio, self.text = intervals, audio, text
        (self.text_start, self.text_end) = intervals[text][0]
        self.streams = streams
        self.codebook_size = sizes[0]
        self.size = max(e for ivs in intervals.values() for _, e in ivs)
        self._lut: dict[tuple, torch.Tensor] = {}

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    def lookup(self, layout: VocabLayout, device: torch.device | str = "cpu") -> torch.Tensor:
        """ESPnet id -> our id (-1: not representable), on ``device``."""
        key = (layout.fingerprint(), str(device))
        if key in self._lut:
            return self._lut[key]
        if self.text_end - self.text_start > layout.text_size:
            raise ConfigError(
                f"EspnetData: ESPnet's text interval has {self.text_end - self.text_start} ids "
                f"but the backbone has {layout.text_size} text rows; use the same backbone"
            )
        if (self.num_streams, self.codebook_size) != (layout.num_streams, layout.codebook_size):
            raise ConfigError(
                f"EspnetData: ESPnet's {self.audio!r} has {self.num_streams} streams of "
                f"{self.codebook_size} codes, the run's vocabulary {layout.num_streams} of "
                f"{layout.codebook_size}"
            )
        lut = torch.full((self.size,), -1, dtype=torch.long)
        assert SPECIAL_TOKENS[:ESPNET_SHARED_SPECIALS][-1] == "<|audio|>"
        lut[:ESPNET_SHARED_SPECIALS] = torch.arange(ESPNET_SHARED_SPECIALS)
        lut[self.text_start : self.text_end] = layout.text_offset + torch.arange(
            self.text_end - self.text_start
        )
        for k, (s, e) in enumerate(self.streams):
            lut[s] = layout.stream_pad(k)
            lut[s + 1 : e] = layout.code(k, 0) + torch.arange(e - s - 1)
        self._lut[key] = lut.to(device)
        return self._lut[key]

    def to_ours(self, seqs: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
        """ESPnet's ``seqs`` [B, T, N] as our ids; its pad 0 becomes our pad of each stream."""
        lut = self.lookup(layout, seqs.device)
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
        pads = torch.tensor(layout.pad_frame(), device=seqs.device)
        return torch.where(seqs == 0, pads.expand_as(ids), ids)
