"""Lhotse Shar directories as a ``torchtitan prepare`` source (``--lhotse-shar DIR``).

Shar (``CutSet.to_shar``) is how large lhotse corpora are shipped and streamed: numbered shards,
each a cut manifest ``cuts.NNNNNN.jsonl.gz`` plus one tar per field, ``recording.NNNNNN.tar``
holding every cut's audio (``<cut id>.<format>``, then its Recording as ``<cut id>.json``). The
audio is read from those tars, never from the files the Shar was written from.

How the work is split: planning reads only the cut manifests (lhotse's ``CutSet.from_shar``
with the ``cuts`` field alone) and the tars' headers (``tarfile``: one 512-byte header per
member, the audio skipped), and records in each item's reference where its audio and its
Recording lie in its tar (byte offsets). A worker then reads exactly its items' bytes with one
seek each, fills lhotse's Shar placeholder with them (``fill_shar_placeholder``, what lhotse's
own ``TarIterator`` does) and calls ``cut.load_audio()``. So ``--workers N`` read their shards
in parallel, any prepare shard can be redone alone (resume), and the planning process never
holds audio. The alternative, each cut's audio bytes put into its item by iterating
``CutSet.from_shar(in_dir=DIR)`` while planning, was measured on the benchmark's Shar (40 cuts,
108 s of speech as flac): planning as fast (31-42 ms against 36-40 ms here), but the main
process then holds every byte of the corpus's audio until the end (2.05 MB here, about 70 GB
for 1000 hours) and pickles it to the workers (2.07 MB against 30 kB of item references).
``benchmarks/bench_prepare.py --lhotse`` compares this source's throughput with the same cuts as
JSONL + wav files. The tars must be plain (uncompressed) tars, as lhotse writes them.

Bad input, found while planning, before any worker starts: a directory without cut manifests
or without ``recording`` tars, a manifest whose tar is missing (or the reverse), a tar that is
unreadable, truncated (its last member cut off, or fewer members than cuts) or whose members do
not match the manifest's cut ids: each error names the file. A cut whose audio lhotse cannot
decode is a recorded failure naming the cut id. ``--lhotse-channel`` applies as for
``--lhotse`` (Shar cuts are never mixed or padded: lhotse writes their audio as loaded).
"""

from __future__ import annotations

import os
import re
import tarfile
from types import SimpleNamespace

from torchtitan_speechlm.prepare.items import ManifestError
from torchtitan_speechlm.prepare.sources.base import PrepareSource, SourceRead, register_source
from torchtitan_speechlm.prepare.sources.lhotse import (
    CHANNEL_OPTION,
    check_options,
    cut_item,
    duplicate_cut,
    require_lhotse,
)
from torchtitan_speechlm.prepare.sources.unique import (
    KeyHashes,
    duplicates_first,
    refuse_repeated_id,
)
from torchtitan_speechlm.prepare.spill import SpilledItems

_SHARD = re.compile(r"^(?P<field>[A-Za-z_]+)\.(?P<n>\d+)\.(?P<ext>jsonl\.gz|jsonl|tar.*)$")


def shar_shards(directory: str) -> list[tuple[str, str]]:
    """``(cuts manifest, recording tar)`` of every shard of a Shar directory, in order."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"Lhotse Shar directory {directory} not found")
    cuts, tars = {}, {}
    for name in sorted(os.listdir(directory)):
        m = _SHARD.match(name)
        if m is None:
            continue
        path, n = os.path.join(directory, name), int(m["n"])
        if m["field"] == "cuts" and m["ext"].startswith("jsonl"):
            cuts[n] = path
        elif m["field"] == "recording":
            if m["ext"] != "tar":
                raise ManifestError(
                    f"{path}: a compressed tar; prepare reads audio at byte offsets of plain "
                    "tars (CutSet.to_shar writes those): unpack it to recording.NNNNNN.tar"
                )
            tars[n] = path
    if not cuts:
        raise ManifestError(
            f"{directory}: no cuts.NNNNNN.jsonl.gz: not a Lhotse Shar directory "
            "(write one with CutSet.to_shar(dir, fields={'recording': 'flac'}))"
        )
    if not tars:
        raise ManifestError(
            f"{directory}: no recording.NNNNNN.tar: this Shar holds no audio (write it with "
            "fields={'recording': 'flac'})"
        )
    for n in sorted(set(cuts) | set(tars)):
        if n not in tars:
            raise ManifestError(
                f"{os.path.join(directory, f'recording.{n:06d}.tar')} is missing (the audio of "
                f"{cuts[n]}); copy it, or remove that manifest"
            )
        if n not in cuts:
            raise ManifestError(
                f"{os.path.join(directory, f'cuts.{n:06d}.jsonl.gz')} is missing (the cuts of "
                f"{tars[n]}); copy it, or remove that tar"
            )
    return [(cuts[n], tars[n]) for n in sorted(cuts)]


def tar_index(tar: str) -> list[tuple[tarfile.TarInfo, tarfile.TarInfo]]:
    """(data member, metadata member) pairs of a Shar tar, from its headers only; a truncated
    or unreadable tar is a ManifestError naming it."""
    size = os.path.getsize(tar)
    try:
        with tarfile.open(tar, "r:") as t:
            members = t.getmembers()
    except (tarfile.TarError, OSError) as e:
        raise ManifestError(f"{tar}: truncated or not a tar ({e}); copy it again") from e
    for m in members:
        if m.offset_data + m.size > size:
            raise ManifestError(
                f"{tar}: truncated (member {m.name} needs {m.offset_data + m.size} bytes, the "
                f"file has {size}); copy it again"
            )
    if len(members) % 2:
        raise ManifestError(
            f"{tar}: truncated or not a Shar tar ({len(members)} members; Shar stores pairs of "
            "audio + metadata); copy it again"
        )
    return list(zip(members[0::2], members[1::2], strict=True))


def _shar_ref(tar: str, data: tarfile.TarInfo, meta: tarfile.TarInfo) -> dict:
    if data.name.endswith(".nodata"):
        return {"tar": tar, "member": data.name, "data": None, "meta": None}
    return {"tar": tar, "member": data.name, "data": [data.offset_data, data.size],
            "meta": [meta.offset_data, meta.size]}  # fmt: skip


def read_shar_items(directory: str, channel="mix", items=None):
    """One item per cut of a Shar directory, in shard order. ``items``: where they go
    (``append``; default a new list, returned), e.g. a ``SpilledItems``: the reader then holds
    one shard's cuts and tar headers at a time, and 8 bytes per cut (a hash of its id)."""
    lhotse = require_lhotse()
    options = check_options("keep", channel)
    directory = os.path.abspath(directory)
    items = [] if items is None else items
    ids = KeyHashes()
    reading: list = [None]  # the cut being read once its id is hashed (unique.py: pending)
    with duplicates_first(ids, items, duplicate_cut, lambda: reading[0]):
        for cuts_file, tar in shar_shards(directory):
            _read_shard(lhotse, cuts_file, tar, options, directory, ids, items, reading)
    refuse_repeated_id(ids, items, duplicate_cut)
    return items


def _read_shard(lhotse, cuts_file: str, tar: str, options, directory: str, ids: KeyHashes,
                items, reading: list) -> None:  # fmt: skip
    pairs = tar_index(tar)
    try:
        cuts = list(lhotse.CutSet.from_shar(fields={"cuts": [cuts_file]}))
    except Exception as e:
        raise ManifestError(f"{cuts_file}: lhotse cannot read it ({type(e).__name__}: {e})") from e
    if len(pairs) < len(cuts):
        raise ManifestError(
            f"{tar}: truncated: holds audio for {len(pairs)} of the {len(cuts)} cuts of "
            f"{cuts_file} (first missing: cut {cuts[len(pairs)].id!r}); copy it again"
        )
    if len(pairs) > len(cuts):
        raise ManifestError(f"{tar}: {len(pairs)} members for the {len(cuts)} cuts of {cuts_file}")
    for line, (cut, (data, meta)) in enumerate(zip(cuts, pairs, strict=True), start=1):
        where = f"{cuts_file}:{line}"
        for key in ("shard_origin", "shar_epoch"):  # set by lhotse's reader, not the cut's
            (cut.custom or {}).pop(key, None)
        if os.path.splitext(data.name)[0] != cut.id:
            raise ManifestError(
                f"{where}: cut {cut.id!r} but {tar} holds {data.name} at its place; the "
                "tar belongs to another manifest"
            )
        ids.add(cut.id)  # (a repeat is named before the cut's own problems, as before)
        reading[0] = SimpleNamespace(id=cut.id, where=where)
        items.append(cut_item(cut, where, line, options, directory, _shar_ref(tar, data, meta)))
        reading[0] = None


def _read(path: str, lhotse_channel="mix") -> SourceRead:
    # on disk while prepare plans and encodes (prepare/spill.py): O(shards) in memory
    items = read_shar_items(path, lhotse_channel, SpilledItems())
    channel = check_options("keep", lhotse_channel)[1]
    return SourceRead(items, {"type": "lhotse_shar", "channel": channel})


register_source(
    PrepareSource(
        "lhotse_shar",
        "--lhotse-shar",
        "DIR",
        "Lhotse Shar directory (CutSet.to_shar: cuts + audio in tars)",
        _read,
        options=(CHANNEL_OPTION,),
    )
)
