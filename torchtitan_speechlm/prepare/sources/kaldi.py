"""Kaldi-style data folders as a ``torchtitan prepare`` source.

A Kaldi data dir is the de-facto interchange format of many speech recipes (ESPnet, k2/icefall,
WeNet)::

    wav.scp    <recording-id> <path>                  one audio file per recording
    text       <utterance-id> <transcript>
    segments   <utterance-id> <recording-id> <start> <end>   (optional; seconds, end -1 = to EOF)
    utt2spk    <utterance-id> <speaker-id>              (optional)
    spk2utt    <speaker-id> <utterance-id> ...          (optional; with utt2spk, must agree)

Without ``segments`` each recording is one utterance with the same id. Only plain file paths are
supported in ``wav.scp``: piped commands (``sox ... |``) and ark offsets (``foo.ark:123``) are
refused up front, since running shell commands from a data file is neither safe nor portable.
Relative paths follow Kaldi's convention (the recipe directory, i.e. the current working
directory); if not found there, the data dir itself is tried. Speakers come from ``utt2spk``
(else ``spk2utt``); an utterance listed in neither is its own speaker.

Memory: the items go to a spill file (``prepare/spill.py``). The tables are read in bounded
memory when they are sorted by key, as Kaldi's own tools keep them (``kaldi_tables``); a table
that is not sorted is read into a dict. ``wav.scp`` is merged too when the segments'
recordings come in sorted order; otherwise it is a dict of the recordings (fewer than the
utterances).
"""

from __future__ import annotations

import os
import re

from torchtitan_speechlm.prepare.items import AudioRef, ManifestError, ManifestItem
from torchtitan_speechlm.prepare.sources.base import (
    PrepareSource,
    SourceRead,
    register_source,
)
from torchtitan_speechlm.prepare.sources.kaldi_speakers import check_speakers
from torchtitan_speechlm.prepare.sources.kaldi_tables import KeyedTable, check_table, table_rows
from torchtitan_speechlm.prepare.spill import SpilledItems

_ARK_OFFSET = re.compile(r"\.ark:\d+$")


def _check_entry(entry: str, where: str) -> None:
    if entry.endswith("|"):
        raise ManifestError(
            f"{where}: {entry!r} is a piped command; torchtitan prepare only reads plain audio "
            "file paths from wav.scp. Run the command once to write audio files (e.g. "
            "`sox in.sph out.wav`) and list those paths instead"
        )
    if entry.startswith("-") or _ARK_OFFSET.search(entry):
        raise ManifestError(
            f"{where}: {entry!r} is a Kaldi ark/stdin reference, not an audio file; convert the "
            "audio to wav/flac files and list their paths"
        )


def _audio_path(entry: str, where: str, base: str) -> str:
    _check_entry(entry, where)
    path = os.path.expanduser(entry)
    if os.path.isabs(path):
        return os.path.normpath(path)
    cwd_path = os.path.abspath(path)
    return cwd_path if os.path.exists(cwd_path) else os.path.normpath(os.path.join(base, path))


def _segment(where: str, rest: list[str]) -> tuple[str, float, float]:
    """(recording, start, end) of a ``segments`` line's fields after the utterance."""
    rec, start, end = rest
    try:
        start_s, end_s = float(start), float(end)
    except ValueError:
        raise ManifestError(f"{where}: start/end must be numbers, got {start!r} {end!r}") from None
    if start_s < 0 or (end_s >= 0 and end_s <= start_s):
        raise ManifestError(f"{where}: bad segment times {start_s} .. {end_s}")
    return rec, start_s, end_s


class _RecordingOrder:
    """Checks each ``segments`` line and notes whether its recordings come in sorted order."""

    def __init__(self) -> None:
        self.sorted, self._last = True, ""

    def __call__(self, where: str, utt: str, rest: list[str]) -> None:
        rec = _segment(where, rest)[0]
        self.sorted, self._last = self.sorted and rec >= self._last, rec


def read_kaldi_dir(data_dir: str, items=None):
    """Items of a Kaldi data dir, in ``segments`` (else ``wav.scp``) order.

    An utterance with no line in ``text`` gets empty text (a failure unless audio-only items are
    allowed); an utterance in ``text`` with no audio is kept and fails as missing audio, so every
    transcript is accounted for in ``failures.jsonl``. Each item's speaker is its utterance's in
    ``utt2spk`` / ``spk2utt`` (None when neither lists it). ``items``: where they go
    (``append``; default a new list, returned), e.g. a ``SpilledItems``. Tables sorted by key
    are merged as they are read, others are read into dicts (``kaldi_tables``).
    """
    data_dir = os.path.abspath(data_dir)
    wav_scp, text_file = os.path.join(data_dir, "wav.scp"), os.path.join(data_dir, "text")
    seg_file = os.path.join(data_dir, "segments")
    for f in (wav_scp, text_file):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"Kaldi data dir {data_dir}: {os.path.basename(f)} not found")
    # each table checked in the order (and with the messages) of reading it into a dict
    recs = check_table(wav_scp, 2, "recording id", after=lambda w, _, r: _check_entry(r[0], w))
    texts = check_table(text_file, 1, "utterance id")
    segments = None
    if os.path.isfile(seg_file):
        order = _RecordingOrder()
        segments = check_table(seg_file, 4, "utterance id", before=order, repeats_first=False)
    speakers = check_speakers(data_dir)
    items = [] if items is None else items
    ordered = (segments or recs).sorted  # the items' utterances come in sorted order
    text_of = KeyedTable(texts, lambda: ((utt, (r[0] if r else "", n))
                                         for n, utt, r in table_rows(text_file, 1)))  # fmt: skip
    texts_of, speaker_of = text_of.lookup(ordered), _speakers(speakers, ordered)
    matched = bytearray(texts.last_line + 1)  # the text lines an item took

    def text(utt: str) -> str:
        found = texts_of.get(utt)
        if found is None:
            return ""
        matched[found[1]] = 1
        return found[0]

    if segments is not None:
        paths = KeyedTable(recs, lambda: ((rec, _audio_path(r[0], f"{wav_scp}:{n}", data_dir))
                                          for n, rec, r in table_rows(wav_scp, 2)))  # fmt: skip
        path_of = paths.lookup(order.sorted)
        for lineno, utt, rest in table_rows(seg_file, 4):
            where = f"{seg_file}:{lineno}"
            rec, start_s, end_s = _segment(where, rest)
            path = path_of.get(rec)
            ref = AudioRef(path=path or os.path.join(data_dir, f"<no wav.scp entry {rec}>"),
                           start=start_s, end=end_s)  # fmt: skip
            items.append(ManifestItem(utt, ref.path, text(utt), lineno, where, ref=ref,
                                      speaker=speaker_of(utt)))  # fmt: skip
    else:
        for lineno, rec, rest in table_rows(wav_scp, 2):
            where = f"{wav_scp}:{lineno}"
            path = _audio_path(rest[0], where, data_dir)
            items.append(ManifestItem(rec, path, text(rec), lineno, where, speaker=speaker_of(rec)))
    speaker_of = _speakers(speakers, texts.sorted)
    for lineno, utt, rest in table_rows(text_file, 1):
        if not matched[lineno]:  # transcript without audio: reported as a failure, not dropped
            where = f"{text_file}:{lineno}"
            missing = os.path.join(data_dir, f"<no audio for {utt}>")
            items.append(ManifestItem(utt, missing, rest[0] if rest else "", lineno, where,
                                      speaker=speaker_of(utt)))  # fmt: skip
    if hasattr(items, "seal"):
        items.seal()
    return items


def _speakers(table: KeyedTable | None, ordered: bool):
    """``speaker_of(utterance)`` (None when no file names its speaker)."""
    if table is None:
        return lambda utt: None
    return table.lookup(ordered).get


def _read(path: str) -> SourceRead:
    # on disk while prepare plans and encodes (prepare/spill.py): O(shards) in memory
    return SourceRead(read_kaldi_dir(path, SpilledItems()), {"type": "kaldi"})


register_source(
    PrepareSource(
        "kaldi", "--kaldi", "DIR", "Kaldi data dir: wav.scp, text, [segments, utt2spk]", _read
    )
)
