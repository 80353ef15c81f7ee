"""The speakers of a prepared dataset, from its index: who speaks each item, and which items
each speaker has (``PreparedDataset.speakers`` and friends; docs/data.md).

A source may name each item's speaker (``items.jsonl`` key ``speaker``); an item without one
(every item of a dataset prepared before speakers existed, or from a source without speaker
labels) is *unlabelled* and is its own speaker: a speaker of one utterance, named by the item's
id and marked ``labelled = False``. Speakers are numbered in order of their first item, so the
numbering depends only on the dataset. Nothing here reads a shard's arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from torchtitan_speechlm.data.format import speaker_summary


@dataclass(frozen=True)
class SpeakerTable:
    """``names[s]``: speaker ``s``'s label (an unlabelled item's own speaker: the item's id);
    ``labelled[s]``: False for such an item's own speaker; ``of_item[i]``: item ``i``'s speaker."""

    names: list[str]
    labelled: np.ndarray  # bool [speakers]
    of_item: np.ndarray  # int32 [items]
    _order: np.ndarray = field(repr=False)  # item numbers grouped by speaker, in item order
    _starts: np.ndarray = field(repr=False)  # int64 [speakers + 1]: speaker s is _order[a:b]

    @classmethod
    def from_labels(cls, ids: list[str], labels: list[str | None]) -> SpeakerTable:
        """The table of items ``ids`` whose source-named speakers are ``labels`` (None:
        unlabelled)."""
        names: list[str] = []
        labelled: list[bool] = []
        number: dict[str, int] = {}
        of_item = np.empty(len(ids), dtype=np.int32)
        for i, (item_id, label) in enumerate(zip(ids, labels, strict=True)):
            if label is None:
                of_item[i] = len(names)
                names.append(item_id)
                labelled.append(False)
                continue
            s = number.get(label)
            if s is None:
                s = number[label] = len(names)
                names.append(label)
                labelled.append(True)
            of_item[i] = s
        order = np.argsort(of_item, kind="stable").astype(np.int64)
        counts = np.bincount(of_item, minlength=len(names))
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return cls(names, np.array(labelled, dtype=bool), of_item, order, starts)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def has_labels(self) -> bool:
        """Whether the source named any item's speaker."""
        return bool(self.labelled.any())

    @property
    def utterances(self) -> np.ndarray:
        """int64 [speakers]: items of each speaker."""
        return np.diff(self._starts)

    def items_of(self, s: int) -> np.ndarray:
        """int64: the items of speaker ``s``, in dataset order."""
        if not 0 <= s < len(self.names):
            raise IndexError(f"speaker {s} out of range for {len(self.names)} speakers")
        return self._order[self._starts[s] : self._starts[s + 1]]

    def summary(self) -> dict:
        """The counts ``torchtitan prepare`` reports (``format.speaker_summary``)."""
        counts = self.utterances
        named = {self.names[s]: int(counts[s]) for s in np.nonzero(self.labelled)[0]}
        return speaker_summary(named, int((~self.labelled).sum()))
