"""Preference pairs in the data stream: the two documents of a pair, and what a micro-batch of
pairs hands the preference loss (model/preference.py).

A preference item (kind ``preference``: turns prompt, chosen, rejected; prepare/sources/
preference.py) becomes two documents of its task's base task (``tts_pref``: two ``tts``
documents; ``tts_prompt_pref``: two ``tts_prompt`` documents, the pair's own speaker prompt in
both), each laid out by the base task's template, so a pair trains on exactly the frames the
plain task would. The packer places a pair as one sample (its length is both documents'),
so both are always in one row and one micro-batch, each with positions restarting at 0 (the
model's document masking keeps them apart: model/documents.py).

A micro-batch of a preference stream carries, besides the usual tensors:

- ``pref_doc`` int64 [B, T]: each frame's preference document in the micro-batch (the chosen
  of pair ``p`` is ``2p``, its rejected ``2p + 1``), -1 elsewhere;
- ``pref_pairs`` int64 [P, 2]: (chosen, rejected) documents of each pair;
- ``pref_key`` int64 [P, 2]: (source index in the mixture, item number in its dataset), the
  key of a pair's reference log-probs;
- ``pref_ref`` float32 [P, 2]: those reference log-probs, looked up in the table the stream was
  given (``SpeechLMDataset.set_reference_logps``), NaN where it has none;

and its ``labels`` count the pairs: -100 except at one frame per pair (its chosen document's
first loss frame), so torchtitan's global normaliser is the number of pairs. A pair whose
documents are the same frames (two identical generations) is skipped and counted
(``data/pref_identical``): DPO and SimPO cannot learn from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from torchtitan_speechlm.data.mixing import compact
from torchtitan_speechlm.data.tasks import Example, TemplateBuilder, get_task
from torchtitan_speechlm.utils.upstream import IGNORE_INDEX

PREF_KEYS = ("pref_doc", "pref_pairs", "pref_key")  # hashed with the batch (not pref_ref)


@dataclass
class PairExample:
    """A preference task's example: the chosen and the rejected document, placed together."""

    chosen: Example
    rejected: Example

    @property
    def documents(self) -> tuple[Example, Example]:
        return (self.chosen, self.rejected)

    @property
    def identical(self) -> bool:
        """Whether the two documents are the same frames and weights: DPO and SimPO cannot
        tell them apart (the stream skips and counts such a pair)."""
        c, r = self.chosen, self.rejected
        return np.array_equal(c.frames, r.frames) and np.array_equal(c.weights, r.weights)


@dataclass(frozen=True)
class PairSide:
    """One side of a preference item as the plain item its base task reads: the prompt and
    one answer as ``text_tokens`` / ``audio_codes``."""

    id: str
    text_tokens: np.ndarray
    audio_codes: np.ndarray


def build_pair(builder: TemplateBuilder, task: str, item) -> PairExample:
    """A preference item's two documents, each laid out by the base task's ``build`` (a
    ``tts_prompt`` pair's speaker prompt given as the prompt item, cut as training cuts it);
    an item whose turns are not a pair of the task's base (a pair of another task) is a
    ValueError."""
    spec = get_task(task)
    base = get_task(spec.pair_of)
    turns = getattr(item, "turns", None) or []
    want = list(spec.turns) + [spec.turns[-1]]  # the prompt's turns, chosen, rejected
    have = [(t.role, t.modality) for t in turns]
    if have != want:
        raise ValueError(
            f"item {item.id!r} is not a {spec.pair_of} preference pair: its turns are {have}, "
            f"task {task!r} takes {want}"
        )
    sides = []
    for answer in turns[-2:]:
        tokens, prompt = {}, None
        for i, turn in enumerate([*turns[:-2], answer]):
            if i == base.prompt_turn:  # the pair's speaker prompt, as a prompt item
                prompt = PairSide(item.id, np.zeros(0, np.int64), np.asarray(turn.tokens))
            else:
                tokens[turn.modality] = turn.tokens
        side = PairSide(item.id, np.asarray(tokens["text"]), np.asarray(tokens["audio"]))
        sides.append(builder.build(spec.pair_of, side, prompt=prompt))
    return PairExample(*sides)


def preference_stream(sources: list) -> bool:
    """Whether the mixture's tasks are preference tasks; each preference source is narrowed to
    the pairs of its task (a dataset may hold tts and asr pairs). A mixture of preference and
    other tasks is refused: a preference micro-batch's loss is normalised by its pairs, any
    other's by its loss frames, and torchtitan divides a step's loss sum by one count."""
    pair = [get_task(s.task).pair_of is not None for s in sources]
    if not any(pair):
        return False
    if not all(pair):
        named = [f"{s.task}:{s.name}" for s in sources]
        prefs = [n for n, p in zip(named, pair, strict=True) if p]
        others = [n for n, p in zip(named, pair, strict=True) if not p]
        raise ValueError(
            f"speechlm_data.train mixes preference tasks ({', '.join(prefs)}) with other "
            f"tasks ({', '.join(others)}): a preference batch's loss is normalised by its "
            "pairs, another's by its loss frames, and a step has one normaliser; train them "
            "in separate runs (e.g. fine-tune, then preference-tune from its checkpoint)"
        )
    for s in sources:
        keep_task_pairs(s)
    return True


def keep_task_pairs(source) -> None:
    """Narrow a preference source to the pairs of its task, told apart by their audio turns
    in the index (a tts pair has two, its answers; an asr pair one, its prompt; a tts_prompt
    pair three, its speaker prompt and answers); refuse a source left without any."""
    audio_turns = getattr(source.data, "num_audio_turns", None)
    if audio_turns is None:
        return  # (a reader without turn counts: a pair of another task is a bad sample)
    spec = get_task(source.task)
    want = spec.count("audio") + (spec.turns[-1][1] == "audio")  # (both answers' turns)
    idx = np.asarray(source.indices)
    keep = np.asarray(audio_turns)[idx] == want
    if not keep.any():
        raise ValueError(
            f"{source.task}:{source.name} has no {spec.pair_of} preference pairs (pairs whose "
            f"'task' is {spec.pair_of!r}); its pairs are of another task: use that task's _pref"
        )
    if not keep.all():
        source.indices = compact(idx[keep])


class PairRows:
    """The preference documents placed in one micro-batch of ``b`` rows of ``t`` frames."""

    def __init__(self, b: int, t: int):
        self.doc = np.full((b, t), -1, dtype=np.int64)
        self.keys: list[tuple[int, int]] = []
        self.label_at: list[tuple[int, int]] = []  # (row, frame) counting each pair once

    def add(self, r: int, spans: list[tuple[int, int]], chosen_weights: np.ndarray,
            key: tuple[int, int]) -> None:  # fmt: skip
        """A pair placed in row ``r`` at ``spans`` = (first frame, frames) of its chosen and
        rejected documents; ``chosen_weights`` the chosen's placed target weights [n, N]."""
        p = len(self.keys)
        for k, (first, n) in enumerate(spans):
            self.doc[r, first : first + n] = 2 * p + k
        loss = np.flatnonzero((chosen_weights > 0).any(-1))
        self.label_at.append((r, spans[0][0] + (int(loss[0]) if len(loss) else 0)))
        self.keys.append(key)

    def tensors(self, reference: dict | None) -> dict[str, torch.Tensor]:
        """The batch's ``pref_*`` tensors (``reference``: {source: [items, 2]} or None)."""
        p = len(self.keys)
        keys = np.array(self.keys, dtype=np.int64).reshape(p, 2)
        return {
            "pref_doc": torch.from_numpy(self.doc),
            "pref_pairs": torch.from_numpy(np.arange(2 * p, dtype=np.int64).reshape(p, 2)),
            "pref_key": torch.from_numpy(keys),
            "pref_ref": torch.from_numpy(reference_logps(reference, keys)),
        }

    def labels(self) -> torch.Tensor:
        """-100 except at one frame per pair: torchtitan's count is the pairs."""
        labels = np.full(self.doc.shape, IGNORE_INDEX, dtype=np.int64)
        for r, j in self.label_at:
            labels[r, j] = 0
        return torch.from_numpy(labels)


def reference_logps(table: dict | None, keys: np.ndarray) -> np.ndarray:
    """float32 [P, 2]: ``table[source][item]`` of each key (source, item), NaN where the table
    has none."""
    out = np.full((len(keys), 2), np.nan, dtype=np.float32)
    for i, (src, item) in enumerate(keys.tolist()):
        values = (table or {}).get(src)
        if values is not None and 0 <= item < len(values):
            out[i] = values[item]
    return out
