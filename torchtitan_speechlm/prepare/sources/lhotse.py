"""lhotse cuts as a ``torchtitan prepare`` source (``--lhotse cuts.jsonl.gz``), read with lhotse.

lhotse is what k2/icefall, NeMo and recent ESPnet recipes write, and lhotse itself is the one
reader that knows every cut it can write: ``url`` / ``command`` / ``memory`` sources,
recordings with transforms (speed or volume perturbation, resampling), ``MixedCut`` (mixed by
lhotse, with its offsets and SNRs), ``PaddingCut`` and padded cuts, multi-channel cuts. So the
manifest is opened with ``CutSet.from_file`` (lazy for ``.jsonl`` / ``.jsonl.gz``: one cut in
memory at a time while planning) and each item's audio is ``cut.load_audio()``, resampled to the
codec's rate like every other source (``audio.to_codec_audio``). lhotse is an optional extra
(``pip install 'torchtitan-speechlm[lhotse]'``), imported where it is used; without it the
source stops with that line.

Choices made while planning, in this process, so the cut a worker loads is the final one:
``--lhotse-padding keep`` (default: the cut as lhotse loads it, padding included) or ``trim``
(the ``PaddingCut`` tracks of a ``MixedCut`` dropped and the leading/trailing padding cut off;
a cut that is all padding is recorded as ``empty_audio``); ``--lhotse-channel mix`` (default:
a multi-channel cut's channels averaged, like the other sources' multi-channel files) or ``N``
(recording channel ``N`` of every multi-channel cut, via ``cut.with_channels``; a cut without
that channel is refused while planning). Mixed cuts are always averaged to mono. Text: the
texts of the cut's supervisions (those on its channels), in time order, joined by a space.
Speaker: the ``speaker`` those supervisions name; a cut whose supervisions name none, or more
than one speaker, is its own speaker (unlabelled).

Workers get the cut itself: each item's ``AudioRef.lhotse`` is the chosen cut's dict as JSON
(``memory`` sources' bytes as base64), so a worker rebuilds it with lhotse's own
``deserialize_item`` without opening the manifest. A cut lhotse cannot load becomes a recorded
failure naming the cut id; a cut it cannot even parse stops the run, naming the line. Relative
file paths are tried against the current directory, then the manifest's folder (like Kaldi's).
A ``CutSet`` object can be given from Python (``source=("lhotse", cuts)``), memory cuts
included.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from types import SimpleNamespace

import numpy as np

from torchtitan_speechlm.prepare.items import AudioRef, ManifestError, ManifestItem, speaker_label
from torchtitan_speechlm.prepare.sources.base import (
    PrepareSource,
    SourceOption,
    SourceRead,
    register_source,
)
from torchtitan_speechlm.prepare.sources.unique import (
    KeyHashes,
    duplicates_first,
    refuse_repeated_id,
)
from torchtitan_speechlm.prepare.spill import SpilledItems
from torchtitan_speechlm.utils.audio import EMPTY, MISSING, BadAudioError, to_codec_audio

INSTALL = "pip install 'torchtitan-speechlm[lhotse]'"
PADDING = ("keep", "trim")
_BYTES = "__bytes_b64__"


def require_lhotse():
    """The lhotse module, or an ImportError naming the install line."""
    try:
        import lhotse  # optional dependency: only lhotse sources need it
    except ImportError as e:
        raise ImportError(f"reading lhotse cuts needs the lhotse package: {INSTALL}") from e
    return lhotse


def check_options(padding: str, channel) -> tuple[str, int | None]:
    """(padding, channel or None for a downmix) from the option values, or a ValueError."""
    if padding not in PADDING:
        raise ValueError(f"--lhotse-padding must be keep or trim, got {padding!r}")
    if channel is None or channel == "mix":
        return padding, None
    try:
        number = int(channel)
    except (TypeError, ValueError):
        number = -1
    if number < 0 or isinstance(channel, bool):
        raise ValueError(
            f"--lhotse-channel must be 'mix' or a channel number >= 0, got {channel!r}"
        )
    return padding, number


def _encode_bytes(obj):
    if isinstance(obj, bytes):
        return {_BYTES: base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, dict):
        return {k: _encode_bytes(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode_bytes(v) for v in obj]
    return obj


def _decode_bytes(obj):
    if isinstance(obj, dict):
        if set(obj) == {_BYTES}:
            return base64.b64decode(obj[_BYTES])
        return {k: _decode_bytes(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_bytes(v) for v in obj]
    return obj


def file_sources(obj) -> list[dict]:
    """Every ``file`` audio source in a cut's dict (nested recordings of mixed cuts too)."""
    if isinstance(obj, list):
        return [s for v in obj for s in file_sources(v)]
    if not isinstance(obj, dict):
        return []
    if obj.get("type") == "file" and "channels" in obj and isinstance(obj.get("source"), str):
        return [obj]
    return [s for v in obj.values() for s in file_sources(v)]


def _resolve(path: str, base: str) -> str:
    path = os.path.expanduser(path)
    if os.path.isabs(path):
        return os.path.normpath(path)
    cwd_path = os.path.abspath(path)
    return cwd_path if os.path.exists(cwd_path) else os.path.normpath(os.path.join(base, path))


def _trim(cut):
    """A MixedCut without its padding tracks, starting at its first non-padding track (None if
    nothing but padding is left)."""
    from lhotse.cut import MixedCut, PaddingCut

    if isinstance(cut, PaddingCut):
        return None
    if not isinstance(cut, MixedCut):
        return cut
    kept = [t for t in cut.tracks if not isinstance(t.cut, PaddingCut)]
    if not kept:
        return None
    first = min(t.offset for t in kept)
    tracks = [dataclasses.replace(t, offset=t.offset - first) for t in kept]
    return dataclasses.replace(cut, tracks=tracks)


def choose(cut, padding: str, channel: int | None, where: str):
    """The cut to load under the padding/channel choices (None: trimmed to nothing)."""
    from lhotse.cut import MultiCut

    if padding == "trim":
        cut = _trim(cut)
    if cut is not None and channel is not None and isinstance(cut, MultiCut):
        if channel not in cut.channel:
            raise ManifestError(
                f"{where}: cut {cut.id!r} has channels {cut.channel}, not --lhotse-channel "
                f"{channel}; choose one of them or mix"
            )
        cut = cut.with_channels(channel)
    return cut


def _supervisions(cut) -> list:
    """The cut's supervisions on its channels, in time order."""
    from lhotse.cut.data import DataCut

    sups = list(cut.supervisions)
    if isinstance(cut, DataCut):
        mine = set(cut.channel if isinstance(cut.channel, list) else [cut.channel])
        sups = [
            s
            for s in sups
            if s.channel is None
            or bool(mine & set(s.channel if isinstance(s.channel, list) else [s.channel]))
        ]
    sups.sort(key=lambda s: s.start)
    return sups


def cut_text(cut) -> str:
    """Supervision texts on the cut's channels, in time order, joined by a space."""
    return " ".join(s.text.strip() for s in _supervisions(cut) if s.text and s.text.strip())


def cut_speaker(cut, where: str) -> str | None:
    """The one speaker the supervisions on the cut's channels name (None if they name none or
    several: the item is then its own speaker)."""
    named = {speaker_label(s.speaker, f"{where}: supervision {s.id!r}") for s in _supervisions(cut)}
    named.discard(None)
    return named.pop() if len(named) == 1 else None


def cut_item(cut, where: str, line: int, options: tuple[str, int | None], base: str,
             shar: dict | None = None) -> ManifestItem:  # fmt: skip
    """The item of one cut; ``shar``: where its audio lies in a Shar tar (``lhotse_shar``).
    (Repeated cut ids are the reader's to refuse: ``prepare/sources/unique.py``.)"""
    chosen = choose(cut, *options, where)
    if chosen is None:
        ref = AudioRef(lhotse=json.dumps({"empty": "all padding (--lhotse-padding trim)"}))
        return ManifestItem(cut.id, None, "", line, where, ref=ref)
    data = _encode_bytes(chosen.to_dict())
    files = file_sources(data)
    for src in files:
        src["source"] = _resolve(src["source"], base)
    record = {"id": cut.id, "cut": data, **({"shar": shar} if shar is not None else {})}
    path = shar["tar"] if shar is not None else (files[0]["source"] if files else None)
    # default=str: a custom field JSON cannot hold (a Path ...) is not needed to load the audio
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)
    ref = AudioRef(path=path, lhotse=text)
    speaker = cut_speaker(chosen, where)
    return ManifestItem(cut.id, path, cut_text(chosen), line, where, ref=ref, speaker=speaker)


def _shar_recording(shar: dict, name: str):
    """The cut's Recording from its Shar tar, audio bytes attached (lhotse's own placeholder
    filling, as its TarIterator does)."""
    from lhotse.serialization import decode_json_line, deserialize_item
    from lhotse.shar.utils import fill_shar_placeholder

    if shar.get("data") is None:
        raise BadAudioError(name, "the Shar holds no recording for this cut", MISSING)
    if not os.path.isfile(shar["tar"]):
        raise BadAudioError(shar["tar"], "Shar tar not found", MISSING)
    with open(shar["tar"], "rb") as f:
        (d_off, d_size), (m_off, m_size) = shar["data"], shar["meta"]
        f.seek(d_off)
        data = f.read(d_size)
        f.seek(m_off)
        meta = f.read(m_size)
    if len(data) != d_size or len(meta) != m_size:
        raise BadAudioError(name, "Shar tar is shorter than when the run was planned")
    recording = deserialize_item(decode_json_line(meta.decode("utf-8")))
    fill_shar_placeholder(manifest=recording, data=data, tarpath=shar["member"])
    return recording


def load_cut_audio(ref: AudioRef, target_sr: int) -> np.ndarray:
    """``cut.load_audio()`` of an item's cut, channels averaged, at ``target_sr``.

    Raises :class:`BadAudioError` (naming the cut) for whatever lhotse cannot load."""
    record = json.loads(ref.lhotse)
    if "empty" in record:
        raise BadAudioError(ref.describe(), record["empty"], EMPTY)
    require_lhotse()
    from lhotse.serialization import deserialize_item

    data = _decode_bytes(record["cut"])
    name = f"lhotse cut {record['id']!r}" + (f" ({ref.path})" if ref.path else "")
    for src in file_sources(data):
        if not os.path.isfile(src["source"]):
            raise BadAudioError(src["source"], f"file not found ({name})", MISSING)
    try:
        cut = deserialize_item(data)
        if "shar" in record:
            cut.recording = _shar_recording(record["shar"], name)
        audio = cut.load_audio()
    except BadAudioError:
        raise
    except Exception as e:  # lhotse raises AudioLoadingError, AssertionError, OSError ...
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise BadAudioError(name, f"lhotse cannot load it ({type(e).__name__}: {detail})") from e
    if audio is None:
        raise BadAudioError(name, "the cut has no recording", MISSING)
    return to_codec_audio(np.asarray(audio).T, int(cut.sampling_rate), target_sr, name=name)


def read_lhotse_cuts(cuts, padding: str = "keep", channel="mix", items=None):
    """Items of a lhotse cut manifest (any file ``CutSet.from_file`` reads) or a ``CutSet``,
    in order. ``items``: where they go (``append``; default a new list, returned), e.g. a
    ``SpilledItems``; the reader keeps 8 bytes per cut (a hash of its id)."""
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
    items = [] if items is None else items
    ids, stream = KeyHashes(), iter(cuts)
    reading: list = [None]  # the cut being read once its id is hashed (unique.py: pending)
    with duplicates_first(ids, items, duplicate_cut, lambda: reading[0]):
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
            ids.add(cut.id)
            reading[0] = SimpleNamespace(id=cut.id, where=f"{label}:{line}")
            items.append(cut_item(cut, f"{label}:{line}", line, options, base))
            reading[0] = None
    refuse_repeated_id(ids, items, duplicate_cut)
    return items


def duplicate_cut(later: ManifestItem, first: ManifestItem) -> str:
    return f"{later.where}: duplicate cut id {later.id!r}"


def _read(path, lhotse_padding: str = "keep", lhotse_channel="mix") -> SourceRead:
    # on disk while prepare plans and encodes (prepare/spill.py): O(shards) in memory
    items = read_lhotse_cuts(path, lhotse_padding, lhotse_channel, SpilledItems())
    padding, channel = check_options(lhotse_padding, lhotse_channel)
    return SourceRead(items, {"type": "lhotse", "padding": padding, "channel": channel})


CHANNEL_OPTION = SourceOption(
    "lhotse_channel",
    "mix",
    "lhotse: multi-channel cuts: 'mix' (average, default) or channel N of each",
)

register_source(
    PrepareSource(
        "lhotse",
        "--lhotse",
        "CUTS",
        "lhotse CutSet manifest (.jsonl / .jsonl.gz / .json), read with lhotse",
        _read,
        options=(
            SourceOption(
                "lhotse_padding", "keep", "lhotse: padding of padded cuts: keep (default) or trim"
            ),
            CHANNEL_OPTION,
        ),
    )
)
