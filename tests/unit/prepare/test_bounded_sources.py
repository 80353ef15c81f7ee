"""Planning in bounded memory for every source (issue 38): Kaldi dirs, HF datasets on disk,
lhotse cuts and Shar are read into spill files with a 64-bit hash per id, the dev split keeps a
64-bit rank per unlabelled item, and the k-means fit reads the audio it samples one reference
at a time. Each is checked against the in-memory reader (or split) it replaces
(``old_readers.py``: the same items, the same errors, the same split) and against its memory
(tracemalloc: the growth of the peak per item, between two sizes of one synthetic corpus)."""

from __future__ import annotations

import gc
import gzip
import io
import json
import os
import pickle
import random
import tarfile
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest

from tests.unit.prepare import old_readers as old
from torchtitan_speechlm.codecs.fitting import FITTERS, FitSettings
from torchtitan_speechlm.prepare import run, spill, split
from torchtitan_speechlm.prepare.items import AudioRef, ManifestError, ManifestItem, TurnSpec
from torchtitan_speechlm.prepare.sources import read_source
from torchtitan_speechlm.prepare.sources.kaldi import read_kaldi_dir
from torchtitan_speechlm.prepare.spill import CHUNK, SpilledItems
from torchtitan_speechlm.prepare.split import SplitError, split_items

LIMIT = 50  # bytes per item: a few arrays of 8 bytes per item at most, never the items


def growth(make, read, small: int, large: int) -> float:
    """Bytes per item the peak of ``read(make(n))`` grows by from ``small`` to ``large`` items
    (the constants, a chunk or a shard in memory, cancel). A first read, not measured, fills
    what any reading fills once (imports, caches, Python's free lists of tuples and dicts)."""

    def peak(n: int) -> int:
        source = make(n)
        tracemalloc.start()
        result = read(source)
        size = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(result) > 0.9 * n  # (a Kaldi dir drops utterances with no text and no audio)
        return size

    gc.collect()  # (what earlier tests left)
    read(make(large))
    return (peak(large) - peak(small)) / (large - small)


def outcome(read, *args, **kwargs):
    """The items a reader gives (as a list), or its error's type and message."""
    try:
        return list(read(*args, **kwargs))
    except (ManifestError, ValueError) as e:
        return (type(e).__name__, str(e))


# --- Kaldi --------------------------------------------------------------------------------------


def kaldi_dir(root, n: int, *, shuffle: tuple[str, ...] = (), segments: bool = True,
              speakers: tuple[str, ...] = ("utt2spk", "spk2utt"), interleaved: bool = False,
              seed: int = 0) -> str:  # fmt: skip
    """A Kaldi dir of ``n`` utterances, 40 per speaker (``interleaved``: of 11 speakers, so the
    segments' recordings are not in sorted order), 10 per recording, sorted as Kaldi sorts
    (but the files named in ``shuffle``): every 7th utterance has no text, every 13th text
    has no audio, and one segment names a recording wav.scp lacks."""
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    utts = sorted(f"s{i % 11 if interleaved else i // 40:05d}-u{i:07d}" for i in range(n))
    rec = {u: f"r{int(u.split('u')[1]) // 10:06d}" for u in utts}

    def write(name: str, lines: list[str]) -> None:
        lines = sorted(lines)
        if name in shuffle:
            rng.shuffle(lines)
        with open(os.path.join(root, name), "w") as f:
            f.writelines(x + "\n" for x in lines)

    with_audio = [u for k, u in enumerate(utts) if k % 13 != 5]
    if segments:
        write("wav.scp", [f"{r} /corpus/{r}.flac" for r in sorted(set(rec.values()))[1:]])
        write("segments", [f"{u} {rec[u]} {k % 10}.0 {k % 10 + 0.75}" for k, u in
                           enumerate(with_audio)])  # fmt: skip
    else:
        write("wav.scp", [f"{u} /corpus/{u}.flac" for u in with_audio])
    write("text", [f"{u} words of {u}" for k, u in enumerate(utts) if k % 7 != 3])
    if "utt2spk" in speakers:
        write("utt2spk", [f"{u} {u.split('-')[0]}" for u in utts])
    if "spk2utt" in speakers:
        by: dict[str, list[str]] = {}
        for u in utts:
            by.setdefault(u.split("-")[0], []).append(u)
        write("spk2utt", [f"{s} {' '.join(us)}" for s, us in by.items()])
    return str(root)


KALDI_DIRS = {
    "sorted": {},
    "recordings unsorted": {"interleaved": True},
    "text unsorted": {"shuffle": ("text",)},
    "segments unsorted": {"shuffle": ("segments",)},
    "wav.scp unsorted": {"shuffle": ("wav.scp",)},
    "speakers unsorted": {"shuffle": ("utt2spk", "spk2utt")},
    "no segments": {"segments": False},
    "no segments, unsorted": {"segments": False, "shuffle": ("wav.scp", "text")},
    "utt2spk only": {"speakers": ("utt2spk",)},
    "spk2utt only": {"speakers": ("spk2utt",)},
    "no speakers": {"speakers": ()},
}


@pytest.mark.parametrize("name", list(KALDI_DIRS))
def test_kaldi_items_are_the_dict_reader_s(tmp_path, name):
    d = kaldi_dir(tmp_path / "d", 3 * 97, **KALDI_DIRS[name])
    want = old.read_kaldi_dir(d)
    assert outcome(read_kaldi_dir, d, SpilledItems()) == want
    assert list(read_source("kaldi", d).items) == want  # the registered source: spilled
    assert isinstance(read_source("kaldi", d).items, SpilledItems)


def _edit(path, fn) -> None:
    with open(path) as f:
        lines = f.read().splitlines()
    with open(path, "w") as f:
        f.writelines(x + "\n" for x in fn(lines))


KALDI_ERRORS = {  # file: how its lines are edited; each stops the run, as the dict reader did
    "wav.scp repeat": ("wav.scp", lambda x: x[:5] + [x[2]] + x[5:]),
    "wav.scp repeat, then a pipe": ("wav.scp", lambda x: x[:5] + [x[2], "p sox a |"] + x[5:]),
    "wav.scp pipe, then a repeat": ("wav.scp", lambda x: x[:2] + ["p sox a |"] + x[2:] + [x[0]]),
    "wav.scp short line": ("wav.scp", lambda x: x[:4] + ["lonely"] + x[4:] + [x[0]]),
    "text repeat": ("text", lambda x: x + [x[3].split()[0] + " again"]),
    "segments repeat, then bad times": ("segments", lambda x: x[:3] + [x[1]] + x[3:] + ["z r 2 1"]),
    "segments not numbers": ("segments", lambda x: x[:3] + ["z r000001 a b"] + x[3:]),
    "utt2spk repeat": ("utt2spk", lambda x: x[:9] + [x[8]] + x[9:]),
    "utt2spk two speakers": ("utt2spk", lambda x: x[:4] + [x[4] + " extra"] + x[5:]),
    "utt2spk repeat, then two speakers": ("utt2spk", lambda x: [x[0], x[0], x[1] + " b"] + x[2:]),
    "spk2utt listed again": ("spk2utt", lambda x: x[:2] + [x[2] + " " + x[0].split()[3]] + x[3:]),
    "spk2utt another speaker": (
        "spk2utt",
        lambda x: [x[1].split()[0] + " " + x[0].split()[2]] + x[1:],
    ),
    "spk2utt unknown utterance": ("spk2utt", lambda x: x[:3] + [x[3] + " nobody"] + x[4:]),
    "spk2utt missing some": ("spk2utt", lambda x: x[:4] + x[5:]),
    "spk2utt again, then another": ("spk2utt", lambda x: [x[0] + " " + x[0].split()[1]] + x[1:]),
    "spk2utt field error after again": (
        "spk2utt",
        lambda x: [x[0] + " " + x[0].split()[1]] + ["s"] + x,
    ),
}


@pytest.mark.parametrize("name", list(KALDI_ERRORS))
@pytest.mark.parametrize("layout", ["recordings unsorted", "speakers unsorted", "no segments"])
def test_kaldi_errors_are_the_dict_reader_s(tmp_path, name, layout):
    d = kaldi_dir(tmp_path / "d", 200, **KALDI_DIRS[layout])
    file, edit = KALDI_ERRORS[name]
    if not os.path.isfile(os.path.join(d, file)):
        pytest.skip(f"{layout}: no {file}")
    _edit(os.path.join(d, file), edit)
    want = outcome(old.read_kaldi_dir, d)
    assert isinstance(want, tuple), want  # (the edit is an error)
    assert outcome(read_kaldi_dir, d, SpilledItems()) == want


def test_a_sorted_kaldi_dir_is_read_in_bytes_per_utterance(tmp_path):
    """Sorted tables are merged (nothing held but a byte per text line; while a table is
    checked, 8-byte hashes of its lines); unsorted ones are dicts, as before."""

    def per_item(small: int, large: int, **layout) -> float:
        make = lambda n: kaldi_dir(tmp_path / f"{n}-{len(layout)}", n, **layout)  # noqa: E731
        return growth(make, lambda d: read_kaldi_dir(d, SpilledItems()), small, large)

    ordered = per_item(2_500, 10_000)
    unsorted = per_item(1_000, 4_000, shuffle=("text", "utt2spk"))
    print(
        f"Kaldi bytes per utterance: sorted {ordered:.1f}, text and utt2spk unsorted {unsorted:.0f}"
    )
    assert ordered < LIMIT
    assert unsorted > 4 * LIMIT  # the dicts: why the tables are merged when they can be


# --- HF datasets ----------------------------------------------------------------------------------


def hf_dataset(path, n: int, *, ids=True, speakers=True, texts=None) -> str:
    """An HF dataset of ``n`` rows saved to disk (``ids``, ``speakers``: True for the default
    columns, a list for those values, None for no such column)."""
    from datasets import Audio, Dataset

    columns = {"audio": [{"bytes": b"RIFF", "path": None} for i in range(n)],  # (not decoded)
               "text": texts if texts is not None else [f"text {i}" for i in range(n)]}  # fmt: skip
    if ids is not None:
        columns["id"] = [f"item-{i:07d}" for i in range(n)] if ids is True else ids
    if speakers is not None:
        columns["speaker_id"] = ([i % 37 if i % 5 else None for i in range(n)]
                                 if speakers is True else speakers)  # fmt: skip
    Dataset.from_dict(columns).cast_column("audio", Audio()).save_to_disk(str(path))
    return str(path)


def test_hf_items_and_errors_are_the_list_reader_s(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    from torchtitan_speechlm.prepare.sources import hf

    monkeypatch.setattr(hf, "BATCH", 7)  # several batches of rows
    n, at = 30, lambda k, v, other: [v if i == k else other(i) for i in range(n)]  # noqa: E731
    cases = {
        "ids and speakers": hf_dataset(tmp_path / "a", n),
        "row numbers": hf_dataset(tmp_path / "b", n, ids=None, speakers=None),
        "null texts": hf_dataset(
            tmp_path / "c", n, texts=[None if i % 4 else "x" for i in range(n)]
        ),
        "bad text": hf_dataset(tmp_path / "d", n, texts=list(range(n))),
        "bad speaker": hf_dataset(tmp_path / "e", n, speakers=at(12, "", str)),
        # a repeated id, then a bad speaker: the repeat is named first
        "repeated id": hf_dataset(
            tmp_path / "f", n, ids=at(17, "item-3", lambda i: f"item-{i}"), speakers=at(25, "", str)
        ),
    }
    for name, path in cases.items():
        want = outcome(old.read_hf_items, path)
        assert outcome(hf.read_hf_items, path, items=SpilledItems()) == want, name
    assert outcome(old.read_hf_items, cases["repeated id"])[1].endswith(
        "row 17: duplicate id 'item-3'"
    )
    assert list(read_source("hf_dataset", cases["ids and speakers"]).items) == old.read_hf_items(
        cases["ids and speakers"]
    )


def test_an_hf_dataset_is_read_in_bytes_per_row(tmp_path):
    pytest.importorskip("datasets")
    make = lambda n: hf_dataset(tmp_path / f"hf{n}", n)  # noqa: E731
    spilled = growth(make, lambda p: read_source("hf_dataset", p).items, 5_000, 20_000)
    print(f"HF bytes per row: {spilled:.1f}")
    assert spilled < LIMIT


# --- lhotse cuts and Shar ------------------------------------------------------------------------


def cut_dict(i: int, recording_source: dict) -> dict:
    return {"id": f"cut-{i:07d}", "start": 0, "duration": 0.5, "channel": 0, "type": "MonoCut",
            "supervisions": [{"id": f"s{i}", "recording_id": f"r{i}", "start": 0,
                              "duration": 0.5, "channel": 0, "text": f"text {i}",
                              "speaker": f"spk{i % 7}" if i % 3 else None}],
            "recording": {"id": f"r{i}", "sources": [recording_source], "sampling_rate": 16000,
                          "num_samples": 8000, "duration": 0.5, "channel_ids": [0]}}  # fmt: skip


def cut_manifest(path, n: int, repeat: tuple[int, int] | None = None) -> str:
    with open(path, "w") as f:
        for i in range(n):
            d = cut_dict(i, {"type": "file", "channels": [0], "source": f"/corpus/r{i}.wav"})
            if repeat is not None and i == repeat[1]:
                d["id"] = f"cut-{repeat[0]:07d}"
            f.write(json.dumps(d) + "\n")
    return str(path)


def shar_dir(root, shards: int, per_shard: int, repeat: tuple[int, int] | None = None) -> str:
    """A Shar directory laid out as ``CutSet.to_shar`` writes it (audio bytes are never read
    while planning, so they are a placeholder); ``repeat=(i, j)``: cut j has cut i's id."""
    os.makedirs(root, exist_ok=True)
    for s in range(shards):
        cuts = [cut_dict(s * per_shard + k, {"type": "shar", "channels": [0], "source": ""})
                for k in range(per_shard)]  # fmt: skip
        for c in cuts:
            if repeat is not None and c["id"] == f"cut-{repeat[1]:07d}":
                c["id"] = f"cut-{repeat[0]:07d}"
        with gzip.open(os.path.join(root, f"cuts.{s:06d}.jsonl.gz"), "wt") as f:
            f.writelines(json.dumps(c) + "\n" for c in cuts)
        with tarfile.open(os.path.join(root, f"recording.{s:06d}.tar"), "w") as t:
            for c in cuts:
                for name, data in ((f"{c['id']}.flac", b"fLaC...."),
                                   (f"{c['id']}.json", json.dumps(c["recording"]).encode())):  # fmt: skip
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
    return str(root)


def test_lhotse_items_and_errors_are_the_list_reader_s(tmp_path):
    pytest.importorskip("lhotse")
    from torchtitan_speechlm.prepare.sources.lhotse import read_lhotse_cuts
    from torchtitan_speechlm.prepare.sources.lhotse_shar import read_shar_items

    path = cut_manifest(tmp_path / "cuts.jsonl", 2 * CHUNK + 5)
    assert outcome(read_lhotse_cuts, path, items=SpilledItems()) == old.read_lhotse_cuts(path)
    repeated = cut_manifest(tmp_path / "rep.jsonl", 2 * CHUNK, repeat=(7, CHUNK + 3))
    want = outcome(old.read_lhotse_cuts, repeated)
    assert want[1].endswith(f"rep.jsonl:{CHUNK + 4}: duplicate cut id 'cut-0000007'")
    assert outcome(read_lhotse_cuts, repeated, items=SpilledItems()) == want
    with open(repeated, "a") as f:
        f.write("not json\n")  # a bad line after the repeat: the repeat is named first
    assert outcome(read_lhotse_cuts, repeated, items=SpilledItems()) == want
    shar = shar_dir(tmp_path / "shar", 3, 50)
    assert list(read_source("lhotse_shar", shar).items) == old.read_shar_items(shar)
    shar = shar_dir(tmp_path / "rep", 4, 50, repeat=(12, 140))
    want = outcome(old.read_shar_items, shar)
    assert want[1].endswith("cuts.000002.jsonl.gz:41: duplicate cut id 'cut-0000012'")
    assert outcome(read_shar_items, shar, items=SpilledItems()) == want
    tar = os.path.join(shar, "recording.000003.tar")
    with open(tar, "r+b") as f:
        f.truncate(os.path.getsize(tar) // 2)  # a later shard's error: the repeat first
    assert outcome(read_shar_items, shar, items=SpilledItems()) == want


@pytest.mark.parametrize("source", ["lhotse", "lhotse_shar"])
def test_lhotse_cuts_and_shar_are_read_in_bytes_per_cut(tmp_path, monkeypatch, source):
    """lhotse parses ~0.3 ms per cut here, so the corpora are small; chunks of 128 items and
    Shar shards of 128 cuts, and sizes that are multiples of both, keep the peaks' constants
    (a chunk's items, a shard's cuts: ~1 kB per cut) exactly the same at both sizes."""
    pytest.importorskip("lhotse")
    monkeypatch.setattr(spill, "CHUNK", 128)
    if source == "lhotse":
        make = lambda n: cut_manifest(tmp_path / f"c{n}.jsonl", n)  # noqa: E731
    else:
        make = lambda n: shar_dir(tmp_path / f"s{n}", n // 128, 128)  # noqa: E731
    per_cut = growth(make, lambda p: read_source(source, p).items, 768, 3072)
    print(f"{source} bytes per cut: {per_cut:.1f}")
    assert per_cut < LIMIT


# --- the dev split ------------------------------------------------------------------------------


def mixed_items(rng: random.Random, n: int, labelled: float, speakers: int) -> list[ManifestItem]:
    return [ManifestItem(f"u{i}", None, "t", speaker=f"s{rng.randrange(speakers)}"
                         if speakers and rng.random() < labelled else None)
            for i in range(n)]  # fmt: skip


def split_outcome(fn, items, fraction: float, seed: int):
    try:
        s = fn(items, fraction, seed)
    except SplitError as e:
        return str(e)
    return [it.id for it in s.train], [it.id for it in s.dev], s.info


@pytest.mark.parametrize("tie_bits", [0, 60, 63])
def test_the_split_is_the_in_memory_split_s(monkeypatch, tie_bits):
    """All unlabelled, all speakers, mixed; tiny to large fractions; and (``tie_bits``: the
    64-bit prefix cut to 4 or 1 bits) ranks tied at 64 bits, broken as the full hash breaks them."""
    if tie_bits:
        monkeypatch.setattr(split, "_prefix", lambda r: int.from_bytes(r[:8], "big") >> tie_bits)
    rng = random.Random(tie_bits)
    for _ in range(120):
        n = rng.choice([2, 3, 7, 40, 333])
        items = mixed_items(rng, n, rng.choice([0.0, 0.2, 0.8, 1.0]), rng.choice([0, 1, 4, 50]))
        fraction, seed = rng.choice([0.001, 0.02, 0.1, 0.5, 0.97]), rng.randrange(4)
        got = split_outcome(split_items, items, fraction, seed)
        assert got == split_outcome(old.split_items, items, fraction, seed), (n, fraction, seed)
    s = split_items(mixed_items(rng, 2 * CHUNK + 1, 0.5, 9), 0.1)
    assert isinstance(s.train, SpilledItems) and isinstance(s.dev, SpilledItems)


def test_the_split_holds_bytes_per_item(tmp_path):
    def make(n: int) -> SpilledItems:
        items = SpilledItems()
        for it in mixed_items(random.Random(n), n, 0.3, 40):
            items.append(it)
        return items.seal()

    per_item = growth(make, lambda items: split_items(items, 0.05).train, 10_000, 40_000)
    print(f"dev split bytes per item: {per_item:.1f}")
    assert per_item < LIMIT


# --- the k-means fit's audio --------------------------------------------------------------------


def audio_items(n: int) -> SpilledItems:
    """Audio items, text-only items and two-turn dialogues, spilled."""
    items = SpilledItems()
    for i in range(n):
        if i % 5 == 1:
            items.append(ManifestItem(f"t{i}", None, "text only"))
        elif i % 5 == 3:
            turns = [TurnSpec("user", audio=AudioRef(path=f"/q{i}.wav")), TurnSpec("assistant", "a"),
                     TurnSpec("assistant", audio=AudioRef(path=f"/a{i}.wav"))]  # fmt: skip
            items.append(ManifestItem(f"d{i}", None, "", turns=turns))
        else:
            items.append(ManifestItem(f"u{i}", f"/u{i}.wav", "speech"))
    return items.seal()


def old_refs(items) -> list[AudioRef]:
    """Every audio reference, as the fit listed them before (items, then dialogue turns)."""
    refs = []
    for it in items:
        if it.turns is not None:
            refs.extend(t.audio for t in it.turns if t.audio is not None)
        elif it.ref is not None:
            refs.append(it.ref)
    return refs


def fitted_on(tmp_path, monkeypatch, items, seed: int, seconds: float) -> list[str]:
    """The audio files a fit of ``seconds`` reads (each reference 'holds' 1 s, but every
    9th, which is unreadable), with the fit itself stubbed out."""
    loaded, fits = [], []

    def load_ref(ref, sr, reader):
        if ref.path.endswith(("9.wav",)):
            raise run.BadAudioError(ref.path, "unreadable")
        loaded.append(ref.path)
        return np.zeros(sr, dtype=np.float32)

    monkeypatch.setattr(run, "load_ref", load_ref)
    fitter = replace(FITTERS["kmeans"], fit=lambda wavs, *a: fits.append(len(wavs)))
    run.fit_or_reuse_codec(fitter, str(tmp_path / f"km{seed}"), items, FitSettings(2, 8, seed),
                           seconds, False, False)  # fmt: skip
    assert fits == [len(loaded)]
    return loaded


def test_the_fit_reads_a_seeded_choice_a_reference_at_a_time(tmp_path, monkeypatch):
    items = audio_items(3 * CHUNK + 11)
    refs = old_refs(items)
    # up to PERMUTED references: the choice of every earlier release (numpy's permutation)
    got = fitted_on(tmp_path, monkeypatch, items, 3, 40.0)
    order = np.random.default_rng(3).permutation(len(refs))
    want = [refs[j].path for j in order if not refs[j].path.endswith("9.wav")][:40]
    assert got == want
    # above: a keyed permutation, evaluated as it is read; deterministic per seed
    monkeypatch.setattr(run, "PERMUTED", 100)
    loads = []
    real_chunk = SpilledItems._chunk
    monkeypatch.setattr(SpilledItems, "_chunk", lambda self, c: (
        loads.append(c) if self._cached[0] != c else None) or real_chunk(self, c))  # fmt: skip
    keyed = fitted_on(tmp_path, monkeypatch, items, 3, 40.0)
    chunks = -(-len(items) // CHUNK)
    assert loads[:chunks] == list(range(chunks))  # one pass to count the references ...
    assert len(loads) - chunks <= len(keyed) + 5  # ... then a chunk per reference at most
    assert len(keyed) == 40 and len(set(keyed)) == 40 and keyed != got
    assert keyed == fitted_on(tmp_path, monkeypatch, items, 3, 40.0)
    assert keyed != fitted_on(tmp_path, monkeypatch, items, 4, 40.0)
    order = list(run.fit_order(len(refs), 3))
    assert sorted(order) == list(range(len(refs)))  # every reference, once
    assert keyed == [refs[j].path for j in order if not refs[j].path.endswith("9.wav")][:40]
    few = audio_items(150)
    readable = sorted(r.path for r in old_refs(few) if "9.wav" not in r.path)
    with pytest.raises(run.CodecError, match=rf"the input has {len(readable)} s; pass "
                       rf"--kmeans-seconds {len(readable)} to fit on all of it"):  # fmt: skip
        fitted_on(tmp_path, monkeypatch, few, 3, 1e9)  # not enough audio: refused, with the fix
    assert sorted(fitted_on(tmp_path, monkeypatch, few, 3, len(readable))) == readable


def test_the_fit_holds_no_list_of_references(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "PERMUTED", 100)
    monkeypatch.setattr(run, "load_ref", lambda ref, sr, reader: np.zeros(sr, np.float32))
    fitter = replace(FITTERS["kmeans"], fit=lambda *a: None)
    fit = lambda items: run.fit_or_reuse_codec(  # noqa: E731
        fitter, str(tmp_path / "km"), items, FitSettings(2, 8, 0), 30.0, False, False) and items  # fmt: skip
    per_item = growth(audio_items, fit, 4_000, 16_000)
    print(f"k-means fit bytes per item: {per_item:.2f}")
    assert per_item < 2  # the references per chunk: 8 bytes per 1,024 items


def test_spilled_items_stay_unpicklable():
    with pytest.raises(TypeError, match="stays in the process"):
        pickle.dumps(split_items(mixed_items(random.Random(0), 10, 0, 0), 0.5).dev)


def test_spilled_slices_read_whole_chunks_and_equal_a_list_s():
    items = SpilledItems()
    for i in range(3 * CHUNK + 7):
        items.append(i)
    items.seal()
    listed = list(range(3 * CHUNK + 7))
    rng = random.Random(0)
    ends = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, len(listed), len(listed) + 5, -1, -CHUNK]
    for _ in range(300):
        a, b = rng.choice(ends + [None]), rng.choice(ends + [None])
        step = rng.choice([None, 1, 2, -1])
        assert items[a:b:step] == listed[a:b:step], (a, b, step)


@pytest.mark.parametrize("later", ['"turns": 3', '"audio": 5', '"text": "x", "speaker": []'])
def test_a_repeated_id_on_a_line_with_another_problem_is_named_as_the_repeat(tmp_path, later):
    """The repeat is named before the line's own problem, as the reader that kept a set of ids
    named it (its id is hashed before the rest of the line is read, its item never made)."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"id": "p", "text": "hi"}\n{"id": "q", "text": "ok"}\n'
                    f'{{"id": "p", {later}}}\n')  # fmt: skip
    with pytest.raises(ManifestError, match=r"m.jsonl:3: duplicate id 'p' \(first on line 1\)"):
        read_source("manifest", str(path), {})
    path.write_text(f'{{"id": "p", "text": "hi"}}\n{{"id": "r", {later}}}\n')
    with pytest.raises(ManifestError, match=r"m.jsonl:2: (?!duplicate)"):
        read_source("manifest", str(path), {})
