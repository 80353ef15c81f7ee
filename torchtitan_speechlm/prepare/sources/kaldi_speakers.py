"""The speakers of a Kaldi data dir (``utt2spk``, ``spk2utt``), checked in bounded memory.

Speakers come from ``utt2spk``, else from ``spk2utt``; with both, they must agree. That check
runs on 64-bit hashes (8 bytes per line of each file while it runs): every (utterance,
speaker) pair of ``spk2utt`` must be one of ``utt2spk``'s, no utterance may be listed twice,
and every utterance of ``utt2spk`` must be listed. The files are read again only to name what
is wrong, with the messages (and in the order) of the check through dicts it replaces. (Two
different pairs with one hash, odds 2^-64 per pair, would pass unseen; the speakers used are
``utt2spk``'s either way.) ``spk2utt`` alone is read into a dict (it is keyed by speaker, not
utterance): write ``utt2spk`` (``utils/spk2utt_to_utt2spk.pl``) for a large corpus.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import numpy as np

from torchtitan_speechlm.prepare.items import ManifestError
from torchtitan_speechlm.prepare.sources.kaldi_tables import (
    KeyedTable,
    Row,
    TableCheck,
    check_table,
    rows_at,
    table_rows,
)
from torchtitan_speechlm.prepare.sources.unique import KeyHashes, contains, key_hash


def check_speakers(data_dir: str) -> KeyedTable | None:
    """Each utterance's speaker (None when neither file lists any). A duplicate utterance, a
    line with the wrong number of fields, or the two files disagreeing is a ManifestError
    naming the file and line."""
    utt2spk, spk2utt = os.path.join(data_dir, "utt2spk"), os.path.join(data_dir, "spk2utt")
    table = None
    if os.path.isfile(utt2spk):

        def one_speaker(where: str, utt: str, rest: list[str]) -> None:
            if len(rest[0].split()) != 1:
                raise ManifestError(
                    f"{where}: expected <utterance-id> <speaker-id>, got {rest[0]!r}"
                )

        check = check_table(utt2spk, 2, "utterance id", before=one_speaker)
        if check.count:  # (an empty utt2spk counts as none)
            table = KeyedTable(check, lambda: ((u, r[0]) for _, u, r in table_rows(utt2spk, 2)))
    if not os.path.isfile(spk2utt):
        return table
    pairs = None
    if table is not None:  # read again once its own hashes are freed: one array at a time
        pairs = KeyHashes()
        for _, utt, rest in table_rows(utt2spk, 2):
            pairs.add(f"{utt} {rest[0]}")  # (an utterance id has no spaces)
    listed = _check_spk2utt(spk2utt, utt2spk, pairs)
    if table is None:
        return KeyedTable(None, lambda: ((utt, r[0]) for _, utt, r in _listed(spk2utt)))
    _refuse_unlisted(spk2utt, table.check, listed)
    return table


def _listed(spk2utt: str) -> Iterator[Row]:
    """(line, utterance, [speaker]) for each utterance of ``spk2utt``, in order."""
    for lineno, spk, rest in table_rows(spk2utt, 2):
        for utt in rest[0].split():
            yield lineno, utt, [spk]


def _check_spk2utt(spk2utt: str, utt2spk: str, pairs: KeyHashes | None) -> np.ndarray:
    """Refuse, in the dict reader's order, a line with too few fields, then an utterance
    listed again or (``pairs``: utt2spk's "utt spk" hashes, emptied here) under another
    speaker than utt2spk's, whichever comes first. Returns the listed utterances' hashes,
    sorted. (Two arrays of 8 bytes per utterance at most at any time.)"""
    known = pairs.sorted() if pairs is not None else None
    if pairs is not None:
        pairs.clear()  # (the caller's reference stays)
    listed, mismatch = KeyHashes(), None
    for lineno, spk, rest in table_rows(spk2utt, 2):  # (its errors stop the run at once)
        if mismatch is not None:
            continue  # read on: a line with too few fields further on comes first
        utts, start = rest[0].split(), len(listed)
        for utt in utts:
            listed.add(utt)
        if known is not None:
            hashes = np.fromiter((key_hash(f"{u} {spk}") for u in utts), np.uint64, len(utts))
            found = contains(known, hashes)
            if not found.all():
                k = int(np.argmin(found))
                mismatch = (start + k, lineno, utts[k], spk)
    del known
    if mismatch is not None:
        _refuse_listed_again(spk2utt, listed, up_to=mismatch[0])
        _, lineno, utt, spk = mismatch
        said = next((f"says {r[0]!r}" for _, u, r in table_rows(utt2spk, 2) if u == utt),
                    "does not list it")  # fmt: skip
        raise ManifestError(
            f"{spk2utt}:{lineno}: utterance {utt!r} is under speaker {spk!r} here but utt2spk "
            f"{said}; regenerate spk2utt from utt2spk (utils/utt2spk_to_spk2utt.pl) or remove it"
        )
    _refuse_listed_again(spk2utt, listed)
    return listed.sorted()


def _refuse_listed_again(spk2utt: str, listed: KeyHashes, up_to: int | None = None) -> None:
    """The first utterance listed a second time (at position ``up_to`` or before)."""
    found: dict[int, Row] = {}
    hit = listed.first_repeat(lambda positions: rows_at(_listed(spk2utt), positions, found))
    if hit is None or (up_to is not None and hit[0] > up_to):
        return
    (lineno, utt, _), first_speaker = found[hit[0]], found[hit[1]][2][0]
    raise ManifestError(
        f"{spk2utt}:{lineno}: utterance {utt!r} is listed again (already under speaker "
        f"{first_speaker!r})"
    )


def _refuse_unlisted(spk2utt: str, utt2spk: TableCheck, listed: np.ndarray) -> None:
    """An utterance of utt2spk that spk2utt does not list (the smallest, and how many). Every
    listed utterance is one of utt2spk's, once (checked before): so they are as many, or
    utt2spk is read again for the ones whose hash is not listed."""
    if utt2spk.count == len(listed):
        return
    first = None
    rows = table_rows(utt2spk.path, 2)
    while block := [utt for _, utt, _ in itertools.islice(rows, 1 << 16)]:
        hashes = np.fromiter((key_hash(u) for u in block), np.uint64, len(block))
        for k in np.flatnonzero(~contains(listed, hashes)):
            first = block[k] if first is None else min(first, block[k])
    raise ManifestError(
        f"{spk2utt}: utterance {first!r} of utt2spk is not in it (and "
        f"{utt2spk.count - len(listed) - 1} more); regenerate spk2utt from utt2spk or remove it"
    )
