"""Input items for dataset preparation: what every source reader (``prepare/sources/``) returns.

Every source (JSONL manifest, Kaldi folder, HF dataset on disk, lhotse cuts or Shar) is turned into
the same list of :class:`ManifestItem`, so the expensive part of ``torchtitan prepare`` (loading,
encoding, writing shards) does not care where items came from. An item only *refers* to its audio
(a file, a segment of a file, a row of an HF dataset, a lhotse cut); audio is read by the worker
that encodes it.

An item may name its speaker (``ManifestItem.speaker``: JSONL ``speaker``, Kaldi ``utt2spk`` /
``spk2utt``, an HF column, lhotse ``supervision.speaker``); an item without one is *unlabelled*
and counts as its own speaker. The label is stored in the prepared index (``items.jsonl``
``speaker``), which answers a dataset's speakers without reading its arrays
(``PreparedDataset.speakers``, docs/data.md).

Errors in the structure of a line (bad JSON, missing or mistyped key, duplicate id) are fatal
and name the file and line; problems with the audio or text *content* are found later and make
the item a recorded failure instead.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from torchtitan_speechlm.data.format import KINDS, PREFERENCE, ROLES  # noqa: F401  (re-exported)


class ManifestError(ValueError):
    """An input line is malformed; the message starts with ``<file>:<line>:``."""


@dataclass(frozen=True)
class AudioRef:
    """Where an item's audio is: a file (optionally seconds ``[start, end)``), an HF dataset row,
    or a lhotse cut (``lhotse``: the cut as JSON, loaded by the worker with lhotse; ``path`` is
    then its first audio file or Shar tar, for the plan's change check)."""

    path: str | None = None  # absolute path
    start: float | None = None
    end: float | None = None  # < 0: to the end of the file (Kaldi convention)
    row: int | None = None  # row of the HF dataset given to prepare
    channel: int | None = None  # take this channel of the file (else: average all channels)
    lhotse: str | None = None  # a lhotse cut (prepare/sources/lhotse.py: cut_ref_json)

    def describe(self) -> str:
        if self.row is not None:
            return f"row {self.row}"
        if self.lhotse is not None:
            return "lhotse cut" + (f" of {self.path}" if self.path else "")
        where = str(self.path)
        if self.start is not None or self.end is not None:
            where += f"[{self.start}:{self.end}]"
        return where if self.channel is None else f"{where} channel {self.channel}"


@dataclass(frozen=True)
class TurnSpec:
    role: str
    text: str | None = None
    audio: AudioRef | None = None


@dataclass
class ManifestItem:
    """One input item. ``audio`` is the file path (kept for the common speech case), ``ref``
    the full audio reference (segment / HF row); ``where`` names the source line or key;
    ``speaker`` the speaker the source named (None: unlabelled, the item is its own speaker);
    ``extra``: more keys of the item's items.jsonl line, written as they are (JSON values; a
    preference pair's ``{"preference": {...}}`` record, prepare/sources/preference.py), so a
    source can record what the item is without the encode path knowing it."""

    id: str
    audio: str | None
    text: str
    line: int = 0  # 1-based line in the manifest (0 if the source has no lines)
    where: str = ""
    ref: AudioRef | None = None
    turns: list[TurnSpec] | None = None
    speaker: str | None = None
    extra: dict | None = None

    def __post_init__(self) -> None:
        if self.ref is None and self.audio is not None:
            self.ref = AudioRef(path=self.audio)

    @property
    def kind(self) -> str:
        """speech (text + audio), text, audio (no text), dialogue, or preference (turns with a
        ``preference`` record: a prompt and its chosen and rejected answers)."""
        if self.turns is not None:
            return PREFERENCE if self.extra and PREFERENCE in self.extra else "dialogue"
        if self.ref is None:
            return "text"
        return "speech" if self.text.strip() else "audio"


def speaker_label(value, where: str) -> str | None:
    """A source's speaker value as a label: a non-empty string or an integer (as its decimal
    string: HF and lhotse corpora often number their speakers); None stays None (unlabelled).
    Anything else is a ManifestError naming ``where``."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            raise ManifestError(f"{where}: empty speaker (leave it out, or null, for none)")
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    raise ManifestError(
        f"{where}: speaker must be a string or an integer, got {type(value).__name__}"
    )
