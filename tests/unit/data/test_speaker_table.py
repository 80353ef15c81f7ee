"""The speaker table of a prepared dataset (data/speakers.py): numbering, items per speaker,
datasets prepared before speakers existed (every item its own speaker), bad index values, and
the training stream unchanged by speaker labels."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

from tests.data_fixtures import assert_same_dataset, build_assets, write_manifest
from torchtitan_speechlm.data.collation import batch_hash
from torchtitan_speechlm.data.format import CorruptDatasetError, fingerprint_shard
from torchtitan_speechlm.data.mixing import Source
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.data.speakers import SpeakerTable
from torchtitan_speechlm.data.stream import SpeechLMDataset
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.prepare.pipeline import prepare_dataset


def test_table_numbers_speakers_by_first_item():
    t = SpeakerTable.from_labels(["u0", "u1", "u2", "u3", "u4"], ["b", None, "a", "b", "u1"])
    assert t.names == ["b", "u1", "a", "u1"] and t.labelled.tolist() == [True, False, True, True]
    assert t.of_item.dtype == np.int32 and t.of_item.tolist() == [0, 1, 2, 0, 3]
    assert [t.items_of(s).tolist() for s in range(4)] == [[0, 3], [1], [2], [4]]
    assert t.utterances.tolist() == [2, 1, 1, 1] and t.has_labels and len(t) == 4
    assert t.summary()["count"] == 4 and t.summary()["labelled"] == 3
    empty = SpeakerTable.from_labels([], [])
    assert len(empty) == 0 and not empty.has_labels and empty.summary()["count"] == 0


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The tone corpus prepared twice: without speakers, and with two speakers."""
    root = tmp_path_factory.mktemp("spk")
    a = build_assets(root)
    rows = [dict(r, speaker=f"s{i % 2}") for i, r in enumerate(a["rows"])]
    labelled = write_manifest(os.path.join(os.path.dirname(a["manifest"]), "spk.jsonl"), rows)
    out = {}
    for name, manifest in (("plain", a["manifest"]), ("labelled", labelled)):
        out[name] = str(root / name)
        prepare_dataset(manifest, a["codec"], a["tok"], out[name], progress=False, shard_size=4)
    return out


def batches(path: str, mode: str, n: int = 10) -> list[str]:
    ds = PreparedDataset(path)
    layout = VocabLayout(text_size=int(ds.metadata["tokenizer"]["vocab_size"]),
                         num_streams=ds.num_streams,
                         codebook_size=int(ds.metadata["codec"]["codebook_size"]))  # fmt: skip
    sources = [Source(t, "d", w, ds, np.arange(len(ds))) for t, w in (("tts", 0.6), ("asr", 0.4))]
    builder = TemplateBuilder(layout, "delay", LossWeights(1.0, 1.0, (0.5,) * ds.num_streams))
    stream = SpeechLMDataset(sources, builder, seq_len=256, local_batch_size=2, mode=mode,
                             window=16, dp_rank=0, dp_world_size=1, seed=5, shuffle=True,
                             infinite=True, cfg_dropout=0.1)  # fmt: skip
    return [batch_hash(b[0]) for b in itertools.islice(iter(stream), n)]


@pytest.mark.parametrize("mode", ["pack", "bucket"])
def test_speaker_labels_change_no_item_and_no_batch(prepared, mode):
    assert_same_dataset(prepared["plain"], prepared["labelled"])
    assert batches(prepared["plain"], mode) == batches(prepared["labelled"], mode)


def strip_speakers(path: str) -> None:
    """Make a labelled dataset what the code before speakers wrote: no ``speaker`` keys in
    items.jsonl, shard.json or metadata.json (its files' fingerprints recomputed)."""
    meta_path = os.path.join(path, "metadata.json")
    meta = json.load(open(meta_path))
    for entry in meta["shards"]:
        sdir = os.path.join(path, "shards", entry["name"])
        items = os.path.join(sdir, "items.jsonl")
        rows = [json.loads(x) for x in open(items)]
        with open(items, "w") as f:
            f.writelines(json.dumps({k: v for k, v in r.items() if k != "speaker"},
                                    ensure_ascii=False) + "\n" for r in rows)  # fmt: skip
        shard = json.load(open(os.path.join(sdir, "shard.json")))
        shard.pop("speakers")
        json.dump(shard, open(os.path.join(sdir, "shard.json"), "w"))
        os.remove(os.path.join(sdir, "columns.npy"))  # written since: not by that code either
        entry["files"] = fingerprint_shard(sdir)
    meta.pop("speakers")
    json.dump(meta, open(meta_path, "w"))


def test_a_dataset_from_before_speakers_loads_with_every_item_its_own(prepared, tmp_path):
    import shutil

    old = str(tmp_path / "old")
    shutil.copytree(prepared["labelled"], old)
    strip_speakers(old)
    ds = PreparedDataset(old, verify="full")
    assert not ds.has_speakers and ds.speakers == ds.ids and not ds.speaker_labelled.any()
    assert ds.item_speakers.tolist() == list(range(len(ds)))
    assert [ds.items_of_speaker(s).tolist() for s in range(len(ds))] == [[i] for i in range(6)]
    for shard in ("00000", "00001"):  # what the unlabelled preparation wrote (but the source)
        lines = [open(os.path.join(p, "shards", shard, "items.jsonl")).read()
                 for p in (prepared["plain"], old)]  # fmt: skip
        assert lines[0] == lines[1].replace("spk.jsonl", "manifest.jsonl")
    assert batches(old, "pack") == batches(prepared["plain"], "pack")


def test_a_bad_speaker_in_the_index_names_the_line(prepared, tmp_path):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(prepared["labelled"], bad)
    items = os.path.join(bad, "shards", "00001", "items.jsonl")
    lines = open(items).read().splitlines()
    lines[1] = lines[1].replace('"speaker": "s1"', '"speaker": 5')
    open(items, "w").write("\n".join(lines) + "\n")
    with pytest.raises(CorruptDatasetError, match=r"00001/items.jsonl:2: bad index line"):
        PreparedDataset(bad, verify="none")
