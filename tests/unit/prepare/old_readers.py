"""The readers and the dev split as they were before issue 38 (every item, and every table of
a Kaldi dir, held in memory): the independent references the bounded ones are compared with
(test_bounded_sources.py). Copied verbatim but for the lhotse readers' duplicate check, which
the shared ``cut_item`` no longer does."""

# ruff: noqa
# fmt: off
from __future__ import annotations

import hashlib
import os
import re

from torchtitan_speechlm.prepare.items import AudioRef, ManifestError, ManifestItem, speaker_label
from torchtitan_speechlm.prepare.sources.hf import open_hf_dataset, speaker_column_of
from torchtitan_speechlm.prepare.sources import lhotse as lhotse_source
from torchtitan_speechlm.prepare.sources.kaldi import _audio_path
from torchtitan_speechlm.prepare.sources.lhotse import check_options, require_lhotse
from torchtitan_speechlm.prepare.sources.lhotse_shar import _shar_ref, shar_shards, tar_index
from torchtitan_speechlm.utils.text_files import text_lines
from torchtitan_speechlm.prepare.split import Split, SplitError, check_fraction

# --- prepare/split.py -------------------------------------------------------------------------
def _unit(it: ManifestItem) -> str:
    return f"spk:{it.speaker}" if it.speaker is not None else f"id:{it.id}"


def _rank(seed: int, unit: str) -> bytes:
    return hashlib.sha256(f"{seed}:{unit}".encode()).digest()


def split_items(items: list[ManifestItem], fraction: float, seed: int = 0) -> Split:
    """Carve ``items`` into train and dev (each in source order); see the module docstring."""
    check_fraction(fraction)
    sizes: dict[str, int] = {}
    for it in items:
        sizes[_unit(it)] = sizes.get(_unit(it), 0) + 1
    target = min(max(1, round(fraction * len(items))), len(items) - 1)
    dev_units, count = set(), 0
    for unit in sorted(sizes, key=lambda u: (_rank(seed, u), u)):
        if abs(count + sizes[unit] - target) < abs(count - target):
            dev_units.add(unit)
            count += sizes[unit]
    by_speaker = any(it.speaker is not None for it in items)
    if count == 0 or count == len(items):
        raise SplitError(
            f"--dev-fraction {fraction:g}: cannot carve a dev split of about {target} of the "
            f"{len(items)} items from {len(sizes)} "
            + (
                "speakers (a split keeps each speaker's items together; the smallest has "
                f"{min(sizes.values())} items)"
                if by_speaker
                else "items"
            )  # fmt: skip
        )
    dev = [it for it in items if _unit(it) in dev_units]
    train = [it for it in items if _unit(it) not in dev_units]
    speakers = {s: {_unit(it) for it in part if it.speaker is not None} for s, part in
                (("train", train), ("dev", dev))}  # fmt: skip
    info = {
        "dev_fraction": fraction,
        "seed": seed,
        "by": "speaker" if by_speaker else "item",
        "input_items": len(items),
        "target_dev_items": target,
        "train": {"items": len(train), "speakers": len(speakers["train"])},
        "dev": {"items": len(dev), "speakers": len(speakers["dev"])},
    }
    return Split(train, dev, info)


# --- prepare/sources/kaldi.py ----------------------------------------------------------------

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


# --- prepare/sources/hf.py -------------------------------------------------------------------

def read_hf_items(
    path: str,
    audio_column: str = "audio",
    text_column: str | None = "text",
    split: str | None = None,
    speaker_column: str | None = None,
) -> list[ManifestItem]:
    """One item per row; ids come from an ``id`` column if there is one, else ``row-N``;
    speakers from ``speaker_column_of(columns, speaker_column)``."""
    ds, split = open_hf_dataset(path, split)
    where0 = f"{os.path.abspath(path)}" + (f"[{split}]" if split else "")
    cols = ds.column_names
    if audio_column not in cols:
        raise ManifestError(f"{where0}: no audio column {audio_column!r} (columns: {cols})")
    if text_column is not None and text_column not in cols:
        raise ManifestError(
            f"{where0}: no text column {text_column!r} (columns: {cols}); pass --text-column"
        )
    spk_col = speaker_column_of(cols, speaker_column, where0)
    keep = list(dict.fromkeys(c for c in ("id", text_column, spk_col) if c in cols))
    table = ds.select_columns(keep).with_format("arrow")[:] if keep else None
    ids = [str(x) for x in table.column("id").to_pylist()] if "id" in keep else None
    texts = table.column(text_column).to_pylist() if text_column in keep else None
    spks = table.column(spk_col).to_pylist() if spk_col is not None else None
    items, seen = [], set()
    for row in range(len(ds)):
        item_id = ids[row] if ids else f"row-{row:08d}"
        where = f"{where0}:row {row}"
        if item_id in seen:
            raise ManifestError(f"{where}: duplicate id {item_id!r}")
        seen.add(item_id)
        text = texts[row] if texts is not None else ""
        if text is not None and not isinstance(text, str):
            raise ManifestError(f"{where}: text must be a string, got {type(text).__name__}")
        speaker = (
            speaker_label(spks[row], f"{where}: column {spk_col!r}") if spks is not None else None
        )
        items.append(ManifestItem(item_id, None, text or "", row + 1, where,
                                  ref=AudioRef(row=row), speaker=speaker))  # fmt: skip
    return items


# --- prepare/sources/lhotse.py, lhotse_shar.py ------------------------------------------------


def cut_item(cut, where, line, options, base, seen, shar=None):
    """The old ``cut_item``: its duplicate check, then the item."""
    if cut.id in seen:
        raise ManifestError(f"{where}: duplicate cut id {cut.id!r}")
    seen.add(cut.id)
    return lhotse_source.cut_item(cut, where, line, options, base, shar=shar)


def read_lhotse_cuts(cuts, padding: str = "keep", channel="mix") -> list[ManifestItem]:
    """Items of a lhotse cut manifest (any file ``CutSet.from_file`` reads) or a ``CutSet``,
    in order."""
    lhotse = require_lhotse()
    options = check_options(padding, channel)
    if isinstance(cuts, (str, os.PathLike)):
        label = os.path.abspath(cuts)
        if not os.path.isfile(label):
            raise FileNotFoundError(f"lhotse cut manifest {label} not found")
        base = os.path.dirname(label)
        try:
            cuts = lhotse.CutSet.from_file(label)
        except Exception as e:
            raise ManifestError(f"{label}: lhotse cannot open it ({type(e).__name__}: {e})") from e
    else:
        label, base = "<CutSet>", os.getcwd()
    items, seen, stream = [], set(), iter(cuts)
    while True:
        line = len(items) + 1
        try:
            cut = next(stream)
        except StopIteration:
            break
        except Exception as e:  # a line that is not JSON, or not a cut lhotse knows
            raise ManifestError(
                f"{label}:{line}: lhotse cannot read this cut ({type(e).__name__}: {e})"
            ) from e
        if not isinstance(cut, lhotse.cut.Cut):
            raise ManifestError(
                f"{label}:{line}: a {type(cut).__name__}, not a cut (build cuts with "
                "CutSet.from_manifests(recordings, supervisions))"
            )
        items.append(cut_item(cut, f"{label}:{line}", line, options, base, seen))
    return items


def read_shar_items(directory: str, channel="mix") -> list[ManifestItem]:
    """One item per cut of a Shar directory, in shard order."""
    lhotse = require_lhotse()
    options = check_options("keep", channel)
    directory = os.path.abspath(directory)
    items, seen = [], set()
    for cuts_file, tar in shar_shards(directory):
        pairs = tar_index(tar)
        try:
            cuts = list(lhotse.CutSet.from_shar(fields={"cuts": [cuts_file]}))
        except Exception as e:
            raise ManifestError(
                f"{cuts_file}: lhotse cannot read it ({type(e).__name__}: {e})"
            ) from e
        if len(pairs) < len(cuts):
            raise ManifestError(
                f"{tar}: truncated: holds audio for {len(pairs)} of the {len(cuts)} cuts of "
                f"{cuts_file} (first missing: cut {cuts[len(pairs)].id!r}); copy it again"
            )
        if len(pairs) > len(cuts):
            raise ManifestError(
                f"{tar}: {len(pairs)} members for the {len(cuts)} cuts of {cuts_file}"
            )
        for line, (cut, (data, meta)) in enumerate(zip(cuts, pairs, strict=True), start=1):
            where = f"{cuts_file}:{line}"
            for key in ("shard_origin", "shar_epoch"):  # set by lhotse's reader, not the cut's
                (cut.custom or {}).pop(key, None)
            if os.path.splitext(data.name)[0] != cut.id:
                raise ManifestError(
                    f"{where}: cut {cut.id!r} but {tar} holds {data.name} at its place; the "
                    "tar belongs to another manifest"
                )
            shar = _shar_ref(tar, data, meta)
            items.append(cut_item(cut, where, line, options, directory, seen, shar))
    return items
