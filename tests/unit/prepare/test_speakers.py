"""Speakers through `torchtitan prepare`: each source's speaker labels (JSONL ``speaker``, Kaldi
``utt2spk`` / ``spk2utt``, an HF column, lhotse ``supervision.speaker``, Shar), unlabelled items
as their own speakers, the prepared index's speaker table, the summary and metadata.json counts,
and preparations without speakers unchanged (same plan hashes, files and resume)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import soundfile as sf

from tests.data_fixtures import build_assets, tone, write_manifest
from torchtitan_speechlm.commands.prepare import main
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.prepare.items import AudioRef, ManifestError, ManifestItem, TurnSpec
from torchtitan_speechlm.prepare.pipeline import format_speakers, prepare_dataset
from torchtitan_speechlm.prepare.plan import PlanMismatchError, _item_key
from torchtitan_speechlm.prepare.sources.hf import read_hf_items
from torchtitan_speechlm.prepare.sources.jsonl import read_jsonl_manifest
from torchtitan_speechlm.prepare.sources.kaldi import read_kaldi_dir
from torchtitan_speechlm.utils.fileio import json_hash


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("speakers"))


def prepare(assets, out, **kw) -> dict:
    manifest = kw.pop("manifest", None)
    return prepare_dataset(manifest, assets["codec"], assets["tok"], str(out), progress=False,
                           **kw)  # fmt: skip


def corpus_rows(assets, speakers) -> list[dict]:
    """The tone corpus' rows (absolute audio paths) with ``speaker`` set where not None."""
    base = os.path.dirname(assets["manifest"])
    rows = [dict(r, audio=os.path.join(base, r["audio"])) for r in assets["rows"]]
    return [dict(r, speaker=s) if s is not None else r for r, s in zip(rows, speakers, strict=True)]


def items_lines(out) -> list[dict]:
    lines = []
    for shard in sorted(os.listdir(os.path.join(out, "shards"))):
        with open(os.path.join(out, "shards", shard, "items.jsonl")) as f:
            lines += [json.loads(x) for x in f]
    return lines


# --- JSONL ----------------------------------------------------------------------------------


def test_jsonl_speakers_reach_the_index_summary_and_metadata(assets, tmp_path, capsys):
    """Named, integer and missing speakers (an unlabelled item is its own speaker, named by its
    id, even when that id is also a speaker's name); the CLI prints the counts."""
    rows = corpus_rows(assets, ["ann", "bob", "ann", 7, None, "a4"])
    m = write_manifest(tmp_path / "m.jsonl", rows)
    out = tmp_path / "out"
    assert main(["--manifest", m, "--codec", assets["codec"], "--tokenizer", assets["tok"],
                 "--out-dir", str(out), "--shard-size", "4", "--no-progress"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert ("speakers: 5 (4 named + 1 items without one, each its own); utterances per "
            "speaker: min 1, median 1, max 2; 4 with a single utterance") in printed  # fmt: skip
    ds = PreparedDataset(str(out))
    assert ds.has_speakers
    assert ds.speakers == ["ann", "bob", "7", "a4", "a4"]  # a4 (the item) and a4 (the speaker)
    assert ds.speaker_labelled.tolist() == [True, True, True, False, True]
    assert ds.item_speakers.tolist() == [0, 1, 0, 2, 3, 4]
    assert [ds.speaker_of(i) for i in range(6)] == [0, 1, 0, 2, 3, 4]
    assert ds.items_of_speaker(0).tolist() == [0, 2] and ds.items_of_speaker(3).tolist() == [4]
    assert ds.utterances_per_speaker.tolist() == [2, 1, 1, 1, 1]
    want = {"count": 5, "labelled": 4, "unlabelled_items": 1, "utterances_min": 1,
            "utterances_median": 1, "utterances_max": 2, "single_utterance": 4}  # fmt: skip
    assert ds.metadata["speakers"] == want == ds.speaker_table.summary()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["speakers"] == want
    shard0 = json.loads((out / "shards" / "00000" / "shard.json").read_text())
    assert shard0["speakers"] == {"7": 1, "ann": 2, "bob": 1}
    assert [r.get("speaker") for r in items_lines(out)] == ["ann", "bob", "ann", "7", None, "a4"]
    assert json.loads((out / "plan.json").read_text())["speakers"] is True
    with pytest.raises(IndexError, match="speaker 5 out of range"):
        ds.items_of_speaker(5)


def test_jsonl_without_speakers_is_prepared_as_before(assets, tmp_path, capsys):
    """No speaker anywhere: items.jsonl lines, shard.json, plan.json and metadata.json carry no
    speaker key (files as before speakers existed); each item is its own speaker."""
    out = tmp_path / "out"
    assert main(["--manifest", assets["manifest"], "--codec", assets["codec"], "--tokenizer",
                 assets["tok"], "--out-dir", str(out), "--no-progress"]) == 0  # fmt: skip
    assert "speakers: none named by the source (each of the 6 items is its own)" in (
        capsys.readouterr().out
    )
    ds = PreparedDataset(str(out))
    assert not ds.has_speakers and ds.speakers == ds.ids
    assert not ds.speaker_labelled.any() and ds.item_speakers.tolist() == list(range(6))
    assert ds.utterances_per_speaker.tolist() == [1] * 6
    keys = ["id", "kind", "text", "source", "text_offset", "text_len", "audio_offset",
            "audio_frames", "seconds"]  # fmt: skip
    assert all(list(r) == keys for r in items_lines(out))
    for name in ("metadata.json", "plan.json", "shards/00000/shard.json"):
        assert "speakers" not in json.loads((out / name).read_text()), name
    assert json.loads((out / "summary.json").read_text())["speakers"]["single_utterance"] == 6


def test_unlabelled_items_keep_their_plan_hash():
    """The plan hashes items without a speaker as before speakers existed (the value computed
    by the code before them), so resuming an older preparation keeps its shards."""
    items = [
        ManifestItem("t1", None, "hello there"),
        ManifestItem("u1", "/nonexistent/u1.wav", "the cat", 2, "m:2"),
        ManifestItem("d1", None, "", 3, "m:3", turns=[
            TurnSpec("user", audio=AudioRef(path="/nonexistent/q.wav", start=0.5, end=1.0)),
            TurnSpec("assistant", text="yes")]),
    ]  # fmt: skip
    assert json_hash([_item_key(it) for it in items]) == "21967546ba692878"
    items[0].speaker = "ann"
    assert json_hash([_item_key(it) for it in items]) != "21967546ba692878"


def test_speakers_added_to_a_prepared_corpus_are_a_new_preparation(assets, tmp_path):
    """Rerunning a finished unlabelled preparation with labels is refused, naming the key;
    with --overwrite it is re-prepared with them."""
    out = tmp_path / "out"
    prepare(assets, out, manifest=assets["manifest"])
    m = write_manifest(tmp_path / "m.jsonl", corpus_rows(assets, ["x", "y"] * 3))
    with pytest.raises(PlanMismatchError, match=r"speakers differs.*--overwrite"):
        prepare(assets, out, manifest=m)
    prepare(assets, out, manifest=m, overwrite=True)
    assert PreparedDataset(str(out)).speakers == ["x", "y"]


@pytest.mark.parametrize(
    "value, message",
    [
        ('""', "empty speaker"),
        ('"  "', "empty speaker"),
        ("[1]", "speaker must be a string or an integer, got list"),
        ("true", "speaker must be a string or an integer, got bool"),
        ("1.5", "speaker must be a string or an integer, got float"),
    ],
)
def test_bad_jsonl_speakers_name_the_line(tmp_path, value, message):
    m = tmp_path / "m.jsonl"
    m.write_text('{"id": "a", "text": "hi", "speaker": "s"}\n'
                 f'{{"id": "b", "text": "hi", "speaker": {value}}}\n')  # fmt: skip
    with pytest.raises(ManifestError, match=f"m.jsonl:2: {message}"):
        read_jsonl_manifest(str(m))


def test_jsonl_dialogue_and_null_speakers(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text(
        '{"id": "d", "speaker": "s1", "turns": [{"role": "user", "text": "hi"}]}\n'
        '{"id": "t", "text": "hi", "speaker": null}\n'
    )
    assert [it.speaker for it in read_jsonl_manifest(str(m))] == ["s1", None]


# --- Kaldi ----------------------------------------------------------------------------------


def make_kaldi(root, rows) -> str:
    d = root / "kaldi"
    d.mkdir()
    (d / "wav.scp").write_text("".join(f"{r['id']} {r['audio']}\n" for r in rows))
    (d / "text").write_text("".join(f"{r['id']} {r['text']}\n" for r in rows))
    return d


def test_kaldi_utt2spk_prepares_with_speakers(assets, tmp_path):
    rows = corpus_rows(assets, [None] * 6)
    d = make_kaldi(tmp_path, rows)
    (d / "utt2spk").write_text("a0 spkA\na1 spkB\na2 spkA\na3 spkB\na5 spkA\n")  # a4: none
    out = tmp_path / "out"
    s = prepare(assets, out, kaldi=str(d))
    ds = PreparedDataset(str(out))
    assert ds.speakers == ["spkA", "spkB", "a4"] and ds.item_speakers.tolist() == [0, 1, 0, 1, 2, 0]
    assert s["speakers"]["labelled"] == 2 and s["speakers"]["utterances_max"] == 3
    assert ds.metadata["speakers"]["unlabelled_items"] == 1


def test_kaldi_spk2utt_alone_and_with_utt2spk(assets, tmp_path):
    rows = corpus_rows(assets, [None] * 6)
    d = make_kaldi(tmp_path, rows)
    assert [it.speaker for it in read_kaldi_dir(str(d))] == [None] * 6  # no speaker files
    (d / "spk2utt").write_text("spkA a0 a2 a5\nspkB a1 a3\n")
    want = ["spkA", "spkB", "spkA", "spkB", None, "spkA"]
    assert [it.speaker for it in read_kaldi_dir(str(d))] == want
    (d / "utt2spk").write_text("a0 spkA\na1 spkB\na2 spkA\na3 spkB\na5 spkA\n")
    assert [it.speaker for it in read_kaldi_dir(str(d))] == want  # the two agree
    (d / "utt2spk").write_text("a0 spkA\na1 spkB\na2 spkB\na3 spkB\na5 spkA\n")
    with pytest.raises(ManifestError, match=r"spk2utt:1: utterance 'a2' is under speaker "
                                            r"'spkA' here but utt2spk says 'spkB'"):  # fmt: skip
        read_kaldi_dir(str(d))
    (d / "utt2spk").write_text("a0 spkA\na1 spkB\na2 spkA\na3 spkB\na5 spkA\na4 spkC\n")
    with pytest.raises(ManifestError, match=r"spk2utt: utterance 'a4' of utt2spk is not in it"):
        read_kaldi_dir(str(d))
    (d / "spk2utt").unlink()
    (d / "utt2spk").write_text("a0 spkA\na0 spkB\n")
    with pytest.raises(ManifestError, match=r"utt2spk:2: duplicate utterance id 'a0'"):
        read_kaldi_dir(str(d))
    (d / "utt2spk").write_text("a0 spk A\n")
    with pytest.raises(ManifestError, match=r"utt2spk:1: expected <utterance-id> <speaker-id>"):
        read_kaldi_dir(str(d))


# --- HF datasets ----------------------------------------------------------------------------


def save_hf(tmp_path, columns: dict) -> str:
    from datasets import Audio, Dataset

    tmp_path.mkdir(exist_ok=True)
    cells = [{"bytes": None, "path": str(tmp_path / f"w{i}.wav")} for i in range(3)]
    for i in range(3):
        sf.write(tmp_path / f"w{i}.wav", tone(i, 0.5, 16000), 16000)
    ds = Dataset.from_dict({"audio": cells, "text": ["one", "two", "three"], **columns})
    path = str(tmp_path / "hf")
    ds.cast_column("audio", Audio()).save_to_disk(path)
    return path


def test_hf_speaker_id_column_by_default(assets, tmp_path):
    path = save_hf(tmp_path, {"speaker_id": [19, 250, 19], "speaker": ["a", "b", "c"]})
    assert [it.speaker for it in read_hf_items(path)] == ["19", "250", "19"]  # speaker_id first
    assert [it.speaker for it in read_hf_items(path, speaker_column="speaker")] == ["a", "b", "c"]
    assert [it.speaker for it in read_hf_items(path, speaker_column="none")] == [None] * 3
    with pytest.raises(ManifestError, match=r"no speaker column 'spk'.*--speaker-column"):
        read_hf_items(path, speaker_column="spk")
    out = tmp_path / "out"
    assert main(["--hf-dataset", path, "--codec", assets["codec"], "--tokenizer", assets["tok"],
                 "--out-dir", str(out), "--no-progress"]) == 0  # fmt: skip
    ds = PreparedDataset(str(out))
    assert ds.speakers == ["19", "250"] and ds.metadata["source"]["speaker_column"] == "speaker_id"


def test_hf_speaker_column_option_nulls_and_bad_values(assets, tmp_path):
    path = save_hf(tmp_path, {"who": ["a", None, "a"]})
    assert [it.speaker for it in read_hf_items(path)] == [None] * 3  # no conventional column
    out = tmp_path / "out"
    prepare(assets, out, hf_dataset=path, source_options={"speaker_column": "who"})
    ds = PreparedDataset(str(out))
    assert ds.speakers == ["a", "row-00000001"] and ds.speaker_labelled.tolist() == [True, False]
    none = tmp_path / "none"
    prepare(assets, none, hf_dataset=path)
    assert "speaker_column" not in PreparedDataset(str(none)).metadata["source"]
    bad = save_hf(tmp_path / "bad", {"speaker": [1.5, 2.5, 3.5]})
    with pytest.raises(ManifestError, match=r"row 0: column 'speaker': speaker must be"):
        read_hf_items(bad)


# --- lhotse cuts and Shar -------------------------------------------------------------------


def lhotse_cuts(tmp_path):
    lhotse = pytest.importorskip("lhotse")
    from lhotse import MonoCut, SupervisionSegment

    sf.write(tmp_path / "rec.wav", tone(0, 3.0, 16000), 16000)
    rec = lhotse.Recording.from_file(str(tmp_path / "rec.wav"), recording_id="rec")

    def cut(cid, start, sups):
        return MonoCut(cid, start, 0.5, 0, recording=rec, supervisions=[
            SupervisionSegment(f"{cid}{k}", "rec", start + 0.1 * k, 0.2, channel=0, text=t,
                               speaker=s) for k, (t, s) in enumerate(sups)])  # fmt: skip

    return lhotse.CutSet.from_cuts([
        cut("c0", 0.0, [("hello there", "spk1")]),
        cut("c1", 0.5, [("the cat", "spk2"), ("sat", "spk2")]),
        cut("c2", 1.0, [("on the", "spk1"), ("mat", "spk2")]),  # two speakers: unlabelled
        cut("c3", 1.5, [("hello", None)]),
        cut("c4", 2.0, [("there", "spk1")]),
    ])  # fmt: skip


def test_lhotse_and_shar_supervision_speakers(assets, tmp_path):
    cuts = lhotse_cuts(tmp_path)
    want = ["spk1", "spk2", None, None, "spk1"]
    manifest = str(tmp_path / "cuts.jsonl.gz")
    cuts.to_file(manifest)
    from torchtitan_speechlm.prepare.sources.lhotse import read_lhotse_cuts

    assert [it.speaker for it in read_lhotse_cuts(manifest)] == want
    assert [it.speaker for it in read_lhotse_cuts(cuts)] == want
    shar = tmp_path / "shar"
    shar.mkdir()
    cuts.to_shar(str(shar), fields={"recording": "flac"}, shard_size=3)
    out = tmp_path / "out"
    prepare(assets, out, source=("lhotse_shar", str(shar)), shard_size=2)
    ds = PreparedDataset(str(out))
    assert ds.speakers == ["spk1", "spk2", "c2", "c3"]
    assert ds.item_speakers.tolist() == [0, 1, 2, 3, 0]
    assert ds.metadata["speakers"]["labelled"] == 2


# --- the summary line -----------------------------------------------------------------------


def test_summary_lines():
    from torchtitan_speechlm.data.format import speaker_summary

    assert format_speakers(speaker_summary({}, 3)) == (
        "speakers: none named by the source (each of the 3 items is its own)"
    )
    v = speaker_summary({"a": 4, "b": 1, "c": 2, "d": 9}, 0)
    assert v["utterances_median"] == 3 and v["single_utterance"] == 1
    assert format_speakers(v) == (
        "speakers: 4 (4 named); utterances per speaker: min 1, median 3, max 9; "
        "1 with a single utterance"
    )
    v = speaker_summary({"a": 4, "b": 2, "c": 3}, 0)
    assert v["utterances_median"] == 3
    assert speaker_summary({"a": 4, "b": 3}, 0)["utterances_median"] == 3.5
    assert np.isclose(speaker_summary({"a": 4}, 1)["utterances_median"], 2.5)
