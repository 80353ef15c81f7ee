"""lhotse ``CutSet`` manifests as a ``torchtitan prepare`` source (``--lhotse cuts.jsonl.gz``).

lhotse is what k2/icefall, NeMo and recent ESPnet recipes write. A cut manifest holds one JSON
object per line (optionally gzipped), each with its recording and supervisions attached::

    {"id": "c1", "start": 1.5, "duration": 2.25, "channel": 0, "type": "MonoCut",
     "recording": {"id": "r1", "sampling_rate": 16000, "num_samples": 64000, "duration": 4.0,
                   "channel_ids": [0, 1],
                   "sources": [{"type": "file", "channels": [0, 1], "source": "/data/r1.wav"}]},
     "supervisions": [{"id": "s1", "recording_id": "r1", "start": 0.0, "duration": 2.25,
                       "channel": 0, "text": "hello there"}]}

One item per cut: its audio is ``[start, start + duration)`` of the recording (only that part is
read), its channel only (``channel`` within the source file's ``channels``), and its text the
texts of the supervisions on that channel, in time order, joined by a space (no text: an audio
item). The reader does not need the lhotse package. Refused up front, naming the line: other
source types (``url``, ``command``, ``memory``), recordings with transforms (speed or volume
perturbation, resampling: export the audio first), mixed/padding cuts and multi-channel cuts.
Relative paths resolve like Kaldi's: the current directory, else the manifest's folder.
"""

from __future__ import annotations

import gzip
import json
import os

from torchtitan_speechlm.prepare.items import AudioRef, ManifestError, ManifestItem
from torchtitan_speechlm.prepare.sources.base import PrepareSource, SourceRead, register_source

_CUT_TYPES = (None, "MonoCut", "Cut", "DataCut")


def _open(path: str):
    return (
        gzip.open(path, "rt", encoding="utf-8")
        if path.endswith(".gz")
        else open(path, encoding="utf-8")
    )


def _number(obj: dict, key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ManifestError(f"{where}: {key!r} must be a number, got {value!r}")
    return float(value)


def _resolve(path: str, base: str) -> str:
    path = os.path.expanduser(path)
    if os.path.isabs(path):
        return os.path.normpath(path)
    cwd_path = os.path.abspath(path)
    return cwd_path if os.path.exists(cwd_path) else os.path.normpath(os.path.join(base, path))


def _audio(recording: dict, channel: int, where: str, base: str) -> tuple[str, int]:
    """(file path, channel index within that file) of ``channel`` of ``recording``."""
    rid = recording.get("id")
    if recording.get("transforms"):
        kinds = [
            t.get("name", "?") if isinstance(t, dict) else "?" for t in recording["transforms"]
        ]
        raise ManifestError(
            f"{where}: recording {rid!r} has transforms {kinds} (speed/volume perturbation, "
            "resampling), which torchtitan prepare does not apply; write the transformed audio "
            "to files first (e.g. lhotse's `Recording.load_audio` + soundfile) and list those"
        )
    for src in recording.get("sources") or []:
        if channel not in (src.get("channels") or []):
            continue
        kind = src.get("type")
        if kind != "file":
            raise ManifestError(
                f"{where}: recording {rid!r} channel {channel} has a {kind!r} source; only "
                "'file' sources are read (convert url/command/memory audio to files)"
            )
        return _resolve(str(src.get("source", "")), base), src["channels"].index(channel)
    raise ManifestError(f"{where}: recording {rid!r} has no source for channel {channel}")


def _text(cut: dict, channel: int, where: str) -> str:
    sups = cut.get("supervisions") or []
    if not isinstance(sups, list):
        raise ManifestError(f"{where}: 'supervisions' must be a list")
    chosen = [
        s
        for s in sups
        if s.get("channel", channel) == channel
        or (isinstance(s.get("channel"), list) and channel in s["channel"])
    ]
    chosen.sort(key=lambda s: float(s.get("start", 0.0)))
    return " ".join(str(s["text"]).strip() for s in chosen if s.get("text"))


def read_lhotse_cuts(path: str) -> list[ManifestItem]:
    """Items of a lhotse cut manifest (``.jsonl`` or ``.jsonl.gz``), in file order."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"lhotse cut manifest {path} not found")
    base = os.path.dirname(path)
    items, seen = [], set()
    with _open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                cut = json.loads(line)
            except ValueError as e:
                raise ManifestError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(cut, dict) or not isinstance(cut.get("id"), str) or not cut["id"]:
                raise ManifestError(f"{where}: a cut needs a non-empty string 'id'")
            cid = cut["id"]
            if cut.get("type") not in _CUT_TYPES:
                raise ManifestError(
                    f"{where}: cut {cid!r} is a {cut['type']}; only single-recording cuts are "
                    "read (mix or pad cuts to audio files first)"
                )
            channel = cut.get("channel", 0)
            if isinstance(channel, list):
                if len(channel) != 1:
                    raise ManifestError(
                        f"{where}: cut {cid!r} has channels {channel}; pick one "
                        "(e.g. CutSet.to_mono) - codecs here are mono"
                    )
                channel = channel[0]
            recording = cut.get("recording")
            if not isinstance(recording, dict):
                raise ManifestError(
                    f"{where}: cut {cid!r} has no attached 'recording' (write the CutSet with "
                    "its recordings, as lhotse's CutSet.from_manifests(...).to_file() does)"
                )
            start, duration = _number(cut, "start", where), _number(cut, "duration", where)
            if start < 0 or duration <= 0:
                raise ManifestError(f"{where}: cut {cid!r} has start {start}, duration {duration}")
            audio, index = _audio(recording, int(channel), where, base)
            ref = AudioRef(path=audio, start=start, end=start + duration, channel=index)
            if cid in seen:
                raise ManifestError(f"{where}: duplicate cut id {cid!r}")
            seen.add(cid)
            items.append(
                ManifestItem(cid, audio, _text(cut, int(channel), where), lineno, where, ref=ref)
            )
    return items


def _read(path: str) -> SourceRead:
    return SourceRead(read_lhotse_cuts(path), {"type": "lhotse"})


register_source(
    PrepareSource(
        "lhotse", "--lhotse", "CUTS", "lhotse CutSet manifest (.jsonl / .jsonl.gz)", _read
    )
)
