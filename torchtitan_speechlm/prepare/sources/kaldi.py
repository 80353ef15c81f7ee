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
from torchtitan_speechlm.utils.text_files import text_lines

_ARK_OFFSET = re.compile(r"\.ark:\d+$")


def _read_table(path: str, min_fields: int) -> list[tuple[int, list[str]]]:
    """(line number, [key, rest...]) for each non-blank line; the last field keeps its spaces."""
    rows = []
    for lineno, line in text_lines(path, ManifestError):
        line = line.strip()
        if not line:
            continue
        parts = line.split(None, min_fields - 1)
        if len(parts) < min_fields:
            raise ManifestError(f"{path}:{lineno}: expected {min_fields} fields, got {line!r}")
        rows.append((lineno, parts))
    return rows


def _audio_path(entry: str, where: str, base: str) -> str:
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
    path = os.path.expanduser(entry)
    if os.path.isabs(path):
        return os.path.normpath(path)
    cwd_path = os.path.abspath(path)
    return cwd_path if os.path.exists(cwd_path) else os.path.normpath(os.path.join(base, path))


def read_speakers(data_dir: str) -> dict[str, str]:
    """``{utterance: speaker}`` from ``utt2spk`` and/or ``spk2utt`` (empty if neither exists).
    A duplicate utterance, a line with the wrong number of fields, or the two files disagreeing
    is a ManifestError naming the file and line."""
    utt2spk, spk2utt = os.path.join(data_dir, "utt2spk"), os.path.join(data_dir, "spk2utt")
    speakers: dict[str, str] = {}
    if os.path.isfile(utt2spk):
        for lineno, (utt, spk) in _read_table(utt2spk, 2):
            where = f"{utt2spk}:{lineno}"
            if len(spk.split()) != 1:
                raise ManifestError(f"{where}: expected <utterance-id> <speaker-id>, got {spk!r}")
            if utt in speakers:
                raise ManifestError(f"{where}: duplicate utterance id {utt!r}")
            speakers[utt] = spk
    if not os.path.isfile(spk2utt):
        return speakers
    from_spk2utt: dict[str, str] = {}
    for lineno, (spk, utts) in _read_table(spk2utt, 2):
        where = f"{spk2utt}:{lineno}"
        for utt in utts.split():
            if utt in from_spk2utt:
                raise ManifestError(
                    f"{where}: utterance {utt!r} is listed again (already under speaker "
                    f"{from_spk2utt[utt]!r})"
                )
            if speakers and speakers.get(utt) != spk:
                said = f"says {speakers[utt]!r}" if utt in speakers else "does not list it"
                raise ManifestError(
                    f"{where}: utterance {utt!r} is under speaker {spk!r} here but utt2spk "
                    f"{said}; regenerate spk2utt from utt2spk (utils/utt2spk_to_spk2utt.pl) "
                    "or remove it"
                )
            from_spk2utt[utt] = spk
    missing = set(speakers) - set(from_spk2utt)
    if speakers and missing:
        raise ManifestError(
            f"{spk2utt}: utterance {sorted(missing)[0]!r} of utt2spk is not in it (and "
            f"{len(missing) - 1} more); regenerate spk2utt from utt2spk or remove it"
        )
    return speakers or from_spk2utt


def read_kaldi_dir(data_dir: str) -> list[ManifestItem]:
    """Items of a Kaldi data dir, in ``segments`` (else ``wav.scp``) order.

    An utterance with no line in ``text`` gets empty text (a failure unless audio-only items are
    allowed); an utterance in ``text`` with no audio is kept and fails as missing audio, so every
    transcript is accounted for in ``failures.jsonl``. Each item's speaker is its utterance's in
    ``utt2spk`` / ``spk2utt`` (None when neither lists it).
    """
    data_dir = os.path.abspath(data_dir)
    wav_scp, text_file = os.path.join(data_dir, "wav.scp"), os.path.join(data_dir, "text")
    for f in (wav_scp, text_file):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"Kaldi data dir {data_dir}: {os.path.basename(f)} not found")
    recordings: dict[str, str] = {}
    for lineno, (rec, entry) in _read_table(wav_scp, 2):
        where = f"{wav_scp}:{lineno}"
        if rec in recordings:
            raise ManifestError(f"{where}: duplicate recording id {rec!r}")
        recordings[rec] = _audio_path(entry, where, data_dir)
    texts: dict[str, str] = {}
    text_lines: dict[str, int] = {}
    for lineno, parts in _read_table(text_file, 1):
        utt, *rest = parts[0].split(None, 1)
        if utt in texts:
            raise ManifestError(f"{text_file}:{lineno}: duplicate utterance id {utt!r}")
        texts[utt], text_lines[utt] = (rest[0] if rest else ""), lineno
    seg_file = os.path.join(data_dir, "segments")
    items: list[ManifestItem] = []
    if os.path.isfile(seg_file):
        for lineno, parts in _read_table(seg_file, 4):
            where = f"{seg_file}:{lineno}"
            utt, rec, start, end = parts[0], parts[1], parts[2], parts[3]
            try:
                start_s, end_s = float(start), float(end)
            except ValueError:
                raise ManifestError(
                    f"{where}: start/end must be numbers, got {start!r} {end!r}"
                ) from None
            if start_s < 0 or (end_s >= 0 and end_s <= start_s):
                raise ManifestError(f"{where}: bad segment times {start_s} .. {end_s}")
            path = recordings.get(rec)
            ref = AudioRef(path=path or os.path.join(data_dir, f"<no wav.scp entry {rec}>"),
                           start=start_s, end=end_s)  # fmt: skip
            items.append(ManifestItem(utt, ref.path, texts.get(utt, ""), lineno, where, ref=ref))
    else:
        for lineno, (rec, _) in _read_table(wav_scp, 2):
            where = f"{wav_scp}:{lineno}"
            items.append(ManifestItem(rec, recordings[rec], texts.get(rec, ""), lineno, where))
    seen: set[str] = set()
    for it in items:
        if it.id in seen:
            raise ManifestError(f"{it.where}: duplicate utterance id {it.id!r}")
        seen.add(it.id)
    for utt, lineno in text_lines.items():
        if utt not in seen:  # transcript without audio: reported as a failure, not dropped
            where = f"{text_file}:{lineno}"
            missing = os.path.join(data_dir, f"<no audio for {utt}>")
            items.append(ManifestItem(utt, missing, texts[utt], lineno, where))
    speakers = read_speakers(data_dir)
    for it in items:
        it.speaker = speakers.get(it.id)
    return items


def _read(path: str) -> SourceRead:
    return SourceRead(read_kaldi_dir(path), {"type": "kaldi"})


register_source(
    PrepareSource(
        "kaldi", "--kaldi", "DIR", "Kaldi data dir: wav.scp, text, [segments, utt2spk]", _read
    )
)
