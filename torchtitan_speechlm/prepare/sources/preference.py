"""The preference-pair source (``--preference P.jsonl``): a prompt, a chosen and a rejected
answer, with the scores that ranked them (what ``torchtitan generate`` + a judge write, or any
preference corpus), for the ``tts_pref`` / ``asr_pref`` / ``tts_prompt_pref`` tasks (docs/data.md,
Preference data).

One JSON object per line::

    {"id": "p0", "task": "tts", "text": "the prompt text", "speaker": "spk1",
     "chosen": {"audio": "c.wav"}, "rejected": {"audio": "r.wav"},
     "scores": {"chosen": {"wer": 0.0, "sim": 0.9}, "rejected": {"wer": 0.4, "sim": 0.8}}}
    {"id": "p1", "task": "asr", "audio": "q.wav",
     "chosen": {"text": "a transcript"}, "rejected": {"text": "a worse one"}, "scores": {...}}
    {"id": "p2", "task": "tts_prompt", "audio": "speaker_prompt.wav", "text": "the text",
     "chosen": {"audio": "c.wav"}, "rejected": {"audio": "r.wav"}, "scores": {...}}

A pair is one item of kind ``preference`` whose turns are the prompt (user: ``tts_prompt``'s
two, its speaker prompt's audio then its text), the chosen and the rejected answer (assistant),
so the encode path prepares its audio like a dialogue's; its items.jsonl line records
``"preference": {"task", "chosen": 1, "rejected": 2, "scores"}`` (the answers' turn indices:
2 and 3 for ``tts_prompt``).
The scores are required: a pair whose ranking cannot be checked is refused (file and line),
as is a line without its chosen or rejected answer or a part of its prompt (a ``tts_prompt``
pair's speaker prompt audio). A pair whose answers are the same audio
file or text is skipped by the worker and recorded in failures.jsonl (``identical_pair``):
DPO and SimPO cannot learn from it. Relative paths resolve against the file's folder.

Bounded in memory like the JSONL manifest: items go to a ``SpilledItems`` as they are read,
and ids are checked for repeats through a 64-bit hash each.
"""

from __future__ import annotations

import math
import numbers
import os

from torchtitan_speechlm.data.format import PREFERENCE
from torchtitan_speechlm.data.tasks import PAIR_BASES, pair_layout
from torchtitan_speechlm.prepare.items import (
    AudioRef,
    ManifestError,
    ManifestItem,
    TurnSpec,
    speaker_label,
)
from torchtitan_speechlm.prepare.sources.base import PrepareSource, SourceRead, register_source
from torchtitan_speechlm.prepare.sources.jsonl import json_object
from torchtitan_speechlm.prepare.sources.unique import (
    KeyHashes,
    duplicates_first,
    refuse_repeated_id,
)
from torchtitan_speechlm.prepare.spill import SpilledItems
from torchtitan_speechlm.utils.text_files import text_lines

# task -> (the prompt's modalities, in turn order, the answers' modality): the layout of the
# item's turns (user prompt..., assistant chosen, assistant rejected) that data/tasks.py's pair
# tasks read (tts_prompt: the speaker prompt's audio, then the text)
PAIR_TASKS = {task: pair_layout(task) for task in PAIR_BASES}
PROMPT_PARTS = {("tts_prompt", "audio"): "its speaker prompt"}  # named when missing


def read_preference_jsonl(path: str, items=None):
    """Parse a preference JSONL file into ``ManifestItem``s (``items``: where they go, default
    a new list); blank lines are skipped, ids must be unique."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"preference file {path} not found")
    base = os.path.dirname(path)
    items = [] if items is None else items
    ids = KeyHashes()  # 8 bytes per item: the duplicate check
    with duplicates_first(ids, items, _duplicate):
        for lineno, line in text_lines(path, ManifestError):
            if line.strip():
                item = parse_pair(line, lineno, f"{path}:{lineno}", base)
                ids.add(item.id)  # (with its item: the check reads the repeats' items)
                items.append(item)
    refuse_repeated_id(ids, items, _duplicate)  # (seals a SpilledItems: readable)
    return items


def parse_pair(line: str, lineno: int, where: str, base: str) -> ManifestItem:
    """One line as a preference item; a ``ManifestError`` naming ``where`` if it is malformed."""
    row = json_object(line, where)
    item_id = _string(row, "id", where)
    task = _string(row, "task", where)
    if task not in PAIR_TASKS:
        raise ManifestError(f"{where}: task {task!r} is not one of {', '.join(PAIR_TASKS)}")
    prompt_modalities, answer_modality = PAIR_TASKS[task]
    prompt = [_prompt_part(row, task, m, where, base) for m in prompt_modalities]
    answers = []
    for key in ("chosen", "rejected"):
        if not isinstance(row.get(key), dict):
            raise ManifestError(
                f"{where}: needs {key!r}: an object with its {answer_modality!r} (task {task})"
            )
        answers.append(_content(row[key], answer_modality, f"{where}: {key}", base))
    turns = [TurnSpec("user", **p) for p in prompt] + [TurnSpec("assistant", **a) for a in answers]
    record = {"task": task, "chosen": len(prompt), "rejected": len(prompt) + 1,
              "scores": _scores(row, where)}  # fmt: skip
    return ManifestItem(item_id, None, "", lineno, where, turns=turns,
                        speaker=speaker_label(row.get("speaker"), where),
                        extra={PREFERENCE: record})  # fmt: skip


def identical_answers(item: ManifestItem) -> str | None:
    """Why a pair's chosen and rejected answers are the same (the same audio or text), or None;
    the worker skips such a pair and records it (``identical_pair``)."""
    c, r = item.turns[-2], item.turns[-1]
    if c.audio is not None and c.audio == r.audio:
        return f"chosen and rejected are the same audio ({c.audio.describe()})"
    if c.text is not None and c.text.strip() == (r.text or "").strip():
        return "chosen and rejected are the same text"
    return None


def _string(row: dict, key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        got = "missing" if value is None else f"{type(value).__name__} {value!r}"
        raise ManifestError(f"{where}: {key!r} must be a non-empty string ({got})")
    return value


def _prompt_part(row: dict, task: str, modality: str, where: str, base: str) -> dict:
    """A prompt turn's content; a missing speaker prompt is refused naming what it is."""
    part = PROMPT_PARTS.get((task, modality))
    if part is not None and row.get(modality) is None:
        raise ManifestError(f"{where}: a {task} pair needs {modality!r}: {part} (a file)")
    return _content(row, modality, where, base)


def _content(row: dict, modality: str, where: str, base: str) -> dict:
    """A turn's ``text`` or ``audio`` (a path, resolved against ``base``) as TurnSpec keywords."""
    value = _string(row, modality, where)
    if modality == "text":
        return {"text": value}
    path = os.path.normpath(os.path.join(base, os.path.expanduser(value)))
    return {"audio": AudioRef(path=path)}


def _scores(row: dict, where: str) -> dict:
    """``{"chosen": {name: number}, "rejected": {...}}``: required (the pair's ranking)."""
    scores = row.get("scores")
    if scores is None:
        raise ManifestError(
            f"{where}: a preference pair without 'scores' (the judges' scores of its chosen "
            "and rejected answers, which the pair's ranking comes from)"
        )
    if not isinstance(scores, dict) or set(scores) != {"chosen", "rejected"}:
        raise ManifestError(f"{where}: 'scores' must be an object with 'chosen' and 'rejected'")
    for key, values in scores.items():
        ok = isinstance(values, dict) and values and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
            for v in values.values()
        )  # fmt: skip
        if not ok:
            raise ManifestError(
                f"{where}: scores[{key!r}] must be a non-empty object of finite numbers"
            )
    return scores


def _duplicate(later: ManifestItem, first: ManifestItem) -> str:
    return f"{later.where}: duplicate id {later.id!r} (first on line {first.line})"


def _read(path: str) -> SourceRead:
    return SourceRead(read_preference_jsonl(path, SpilledItems()), {"type": PREFERENCE})


register_source(
    PrepareSource(
        PREFERENCE,
        "--preference",
        "P.jsonl",
        "JSONL preference pairs (tts, asr or tts_prompt): a prompt, a chosen and a rejected "
        "answer, scores",
        _read,
    )
)
