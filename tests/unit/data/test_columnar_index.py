"""The columnar index (issue 38): prepare's ``columns.npy`` per shard, the dataset's mapped
``index/`` folder, lazy ids and texts, the bounded shard cache, verification once per dataset,
and the errors of a damaged index or a process limit."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.data_fixtures import build_assets, write_manifest
from torchtitan_speechlm.data import format as fmt
from torchtitan_speechlm.data.collation import batch_hash
from torchtitan_speechlm.data.format import COLUMN_DTYPE, CorruptDatasetError
from torchtitan_speechlm.data.item_index import columns_from_items
from torchtitan_speechlm.data.mixing import Source
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.data.shard_files import ShardLimitError, limit_error
from torchtitan_speechlm.data.stream import SpeechLMDataset
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.prepare.pipeline import prepare_dataset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

pytestmark = pytest.mark.long  # in make faults (make test budget)


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """Speech (some with speakers), text, audio-only and dialogue items in shards of 3."""
    root = tmp_path_factory.mktemp("columns")
    a = build_assets(root)
    rows = [dict(r, speaker=f"s{i % 2}") if i % 3 else dict(r) for i, r in enumerate(a["rows"])]
    rows += [
        {"id": "t0", "text": a["sentences"][10]},
        {"id": "t1", "text": "Zürich — ünïcode text, \"quoted\"."},
        {"id": "au0", "audio": a["rows"][0]["audio"]},
        {"id": "d0", "turns": [
            {"role": "system", "text": "Be brief."},
            {"role": "user", "audio": a["rows"][1]["audio"]},
            {"role": "assistant", "text": a["sentences"][11]},
            {"role": "assistant", "audio": a["rows"][2]["audio"]},
        ]},
    ]  # fmt: skip
    manifest = write_manifest(os.path.join(os.path.dirname(a["manifest"]), "varied.jsonl"), rows)
    out = str(root / "prepared")
    prepare_dataset(manifest, a["codec"], a["tok"], out, progress=False, shard_size=3,
                    allow_audio_only=True)  # fmt: skip
    return out


def items_jsonl(path: str) -> list[dict]:
    """Every item's line, as the code before columns read them."""
    meta = json.load(open(os.path.join(path, "metadata.json")))
    return [json.loads(line) for e in meta["shards"]
            for line in open(os.path.join(path, "shards", e["name"], "items.jsonl"), "rb")]  # fmt: skip


def as_old(path: str, dst: str) -> str:
    """A copy of the dataset as the code before the columnar index wrote it."""
    shutil.copytree(path, dst, ignore=shutil.ignore_patterns("index", "columns.npy"))
    meta_path = os.path.join(dst, "metadata.json")
    meta = json.load(open(meta_path))
    for e in meta["shards"]:
        e["files"].pop("columns.npy")
    json.dump(meta, open(meta_path, "w"))
    return dst


def stream_hashes(ds, n: int = 12) -> list[str]:
    layout = VocabLayout(text_size=int(ds.metadata["tokenizer"]["vocab_size"]),
                         num_streams=ds.num_streams,
                         codebook_size=int(ds.metadata["codec"]["codebook_size"]))  # fmt: skip
    tasks = (("tts", 0.4), ("asr", 0.3), ("text", 0.2), ("continuation", 0.1))
    sources = [Source(t, "d", w, ds, np.arange(len(ds))) for t, w in tasks]
    builder = TemplateBuilder(layout, "delay", LossWeights(1.0, 1.0, (0.5,) * ds.num_streams))
    stream = SpeechLMDataset(sources, builder, seq_len=256, local_batch_size=2, mode="pack",
                             window=8, dp_rank=1, dp_world_size=2, seed=3, shuffle=True,
                             infinite=True, cfg_dropout=0.1)  # fmt: skip
    return [batch_hash(b[0]) for b in itertools.islice(iter(stream), n)]


def test_prepare_writes_the_columns_of_items_jsonl(varied):
    meta = json.load(open(os.path.join(varied, "metadata.json")))
    assert len(meta["shards"]) > 3
    for e in meta["shards"]:
        sdir = os.path.join(varied, "shards", e["name"])
        cols = np.load(os.path.join(sdir, "columns.npy"))
        assert cols.dtype == COLUMN_DTYPE and "columns.npy" in e["files"]
        np.testing.assert_array_equal(cols, columns_from_items(os.path.join(sdir, "items.jsonl")))


def test_the_index_reads_what_items_jsonl_says(varied, tmp_path):
    rows = items_jsonl(varied)
    old = as_old(varied, str(tmp_path / "old"))
    for path in (varied, old):
        ds = PreparedDataset(path)
        assert len(ds) == len(rows) and list(ds.ids) == [r["id"] for r in rows]
        assert list(ds.texts) == [r["text"] for r in rows]
        assert list(ds.kinds) == [r["kind"] for r in rows]
        assert set(ds.kinds) == {"speech", "text", "audio", "dialogue"}
        assert ds.text_lengths.tolist() == [r["text_len"] for r in rows]
        assert ds.audio_lengths.tolist() == [r["audio_frames"] for r in rows]
        assert ds.num_turns.tolist() == [len(r.get("turns", [])) for r in rows]
        assert ds.num_audio_turns.tolist() == [
            sum(t["modality"] == "audio" for t in r.get("turns", [])) for r in rows
        ]
        assert ds.index.speaker_labels == [r.get("speaker") for r in rows] and ds.has_speakers
        assert [ds.ids[i] for i in (0, -1, len(rows) // 2)] == [
            rows[i]["id"] for i in (0, -1, len(rows) // 2)
        ]
        hashes = [fmt.id_hash(r["id"]) for r in rows]
        assert ds.id_hashes.tolist() == hashes
        d = next(i for i, r in enumerate(rows) if r["kind"] == "dialogue")
        assert [t.text for t in ds[d].turns] == [t["text"] for t in rows[d]["turns"]]
    a, b = PreparedDataset(varied), PreparedDataset(old)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert (x.id, x.text, x.seconds) == (y.id, y.text, y.seconds)
        np.testing.assert_array_equal(x.text_tokens, y.text_tokens)
        np.testing.assert_array_equal(x.audio_codes, y.audio_codes)


def test_an_old_dataset_trains_the_same_batches_and_says_so_once(varied, tmp_path, monkeypatch):
    from torchtitan_speechlm.data import index_store

    said = []
    monkeypatch.setattr(index_store.logger, "warning", said.append)
    old = as_old(varied, str(tmp_path / "old"))
    first = PreparedDataset(old)
    assert first.index_info.built and first.index_info.from_items == first.index.num_shards
    assert len(said) == 1 and "have no columns.npy" in said[0] and "later opens map it" in said[0]
    second = PreparedDataset(old)
    assert not second.index_info.built and len(said) == 1  # converted once, said once
    assert stream_hashes(second) == stream_hashes(PreparedDataset(varied))


def test_descriptors_stay_bounded_with_more_shards_than_the_cache(varied):
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    ds = PreparedDataset(varied, shard_cache=2)
    before = fds()
    for _ in range(2):
        for i in range(len(ds)):
            ds[i]
            assert len(ds.shards) <= 2 and fds() <= before + 2 * 2
    assert ds.shards.opened > 2 * ds.index.num_shards - 1  # shards were closed and reopened
    stream_hashes(ds, 4)  # a stream over every shard through the same cache
    assert fds() <= before + 2 * 2


def test_full_verification_is_done_once_per_dataset(varied, tmp_path, monkeypatch):
    copy = str(tmp_path / "copy")
    shutil.copytree(varied, copy, ignore=shutil.ignore_patterns("index"))
    hashed = []
    real = fmt.file_digest
    monkeypatch.setattr(fmt, "file_digest", lambda p: hashed.append(p) or real(p))
    assert PreparedDataset(copy, verify="full").index_info.verified_full
    n = len(hashed)
    assert n >= 3 * PreparedDataset(copy, verify="size").index.num_shards
    again = PreparedDataset(copy, verify="full")
    assert again.index_info.verified_full and len(hashed) == n  # recorded: not hashed again
    codes = os.path.join(copy, "shards", "00002", "audio_codes.npy")
    with open(codes, "ab") as f:  # sizes are checked by every open
        f.write(b"\0")
    with pytest.raises(CorruptDatasetError, match=r"00002/audio_codes.npy has \d+ bytes"):
        PreparedDataset(copy, verify="full")


def test_ranks_take_the_launchers_checked_key_and_check_sizes_when_they_open_a_shard(
    varied, tmp_path, monkeypatch
):
    """The launcher stats every shard file (index_key) and hands its keys to the ranks
    (CHECKED_ENV): a rank does not stat them again, and a shard array changed after that
    check is refused when the rank opens that shard, naming the file and both sizes."""
    from torchtitan_speechlm.data import index_store

    copy = str(tmp_path / "copy")
    shutil.copytree(varied, copy, ignore=shutil.ignore_patterns("index"))
    monkeypatch.delenv(index_store.CHECKED_ENV, raising=False)
    monkeypatch.setattr(index_store, "_CHECKED", {})
    keyed = []
    real = index_store.index_key
    monkeypatch.setattr(
        index_store, "index_key", lambda *a, **k: keyed.append(a[0]) or real(*a, **k)
    )
    PreparedDataset(copy, verify="size")  # the launcher
    assert keyed == [copy]
    index_store.export_checked_indexes()
    assert json.loads(os.environ[index_store.CHECKED_ENV])[copy][1].startswith("2:")
    codes = os.path.join(copy, "shards", "00002", "audio_codes.npy")
    with open(codes, "ab") as f:  # changed after the launcher's check
        f.write(b"\0")
    rank = PreparedDataset(copy, verify="size")
    assert keyed == [copy]  # no stat of every shard file
    rank.shards.get(1)  # an unchanged shard opens
    with pytest.raises(CorruptDatasetError, match=r"00002/audio_codes.npy has \d+ bytes, metadata"):
        rank.shards.get(2)
    monkeypatch.delenv(index_store.CHECKED_ENV)  # another launcher: its own check refuses it
    with pytest.raises(CorruptDatasetError, match=r"00002/audio_codes.npy has \d+ bytes"):
        PreparedDataset(copy, verify="size")


def test_a_damaged_index_names_the_shard_and_the_file(varied, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(varied, bad, ignore=shutil.ignore_patterns("index"))
    cols = os.path.join(bad, "shards", "00001", "columns.npy")
    size = os.path.getsize(cols)
    with open(cols, "r+b") as f:  # same size, garbage header
        f.write(b"garbage!" * 4)
    assert os.path.getsize(cols) == size
    with pytest.raises(CorruptDatasetError, match=r"shard .*00001: its index .*00001/columns.npy"):
        PreparedDataset(bad, verify="none")
    os.remove(cols)
    with pytest.raises(CorruptDatasetError, match=r"00001/columns.npy is missing"):
        PreparedDataset(bad, verify="size")
    # the dataset's mapped index: a damaged column names its file and the fix
    ok = PreparedDataset(varied)
    col = os.path.join(ok.index_info.folder, "text_len.npy")
    saved = open(col, "rb").read()
    try:
        open(col, "wb").write(saved[:-4])
        with pytest.raises(CorruptDatasetError, match=r"index/text_len.npy: the dataset's index"):
            PreparedDataset(varied)
    finally:
        open(col, "wb").write(saved)


def test_a_limit_of_the_process_is_named_not_corruption(varied):
    import errno

    e = limit_error("/d/shards/00001/audio_codes.npy", OSError(errno.ENOMEM, "no"))
    assert "vm.max_map_count" in str(e) and "re-create" not in str(e)
    code = textwrap.dedent(f"""
        import os, resource
        from torchtitan_speechlm.data.reader import PreparedDataset
        ds = PreparedDataset({varied!r}, shard_cache=1000)
        n = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        try:
            for i in range(len(ds)):
                ds[i]
        except Exception as e:
            print(type(e).__name__, e)
    """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=120).stdout  # fmt: skip
    assert out.startswith(ShardLimitError.__name__), out
    assert "RLIMIT_NOFILE" in out and "ulimit -n" in out and "re-create" not in out
