"""Sharded, parallel, resumable preparation: interrupt + rerun, 1 vs 2 workers, failures.jsonl,
summary.json, mismatching reruns and shard/global metadata disagreement."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import soundfile as sf

from tests.data_fixtures import assert_same_dataset, build_assets, write_manifest, write_tone_corpus
from tests.tiny_codecs import build_codec
from torchtitan_speechlm.commands.prepare import main
from torchtitan_speechlm.data.format import CorruptDatasetError, ShardMismatchError
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.demo import assets as demo_assets
from torchtitan_speechlm.prepare import run as prepare_run
from torchtitan_speechlm.prepare.pipeline import NoItemsError, prepare_dataset
from torchtitan_speechlm.prepare.plan import PlanMismatchError


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny assets plus a 14-item tone corpus (7 shards of 2)."""
    a = build_assets(tmp_path_factory.mktemp("resume"))
    corpus = os.path.join(a["root"], "corpus14")
    durations = [0.3 + 0.1 * (i % 5) for i in range(14)]
    write_tone_corpus(corpus, durations, a["sentences"])
    a["m14"] = os.path.join(corpus, "manifest.jsonl")
    a["clean"] = os.path.join(a["root"], "clean")
    prepare_dataset(a["m14"], a["codec"], a["tok"], a["clean"], progress=False, shard_size=2)
    return a


def shard_files(out) -> dict:
    """{relative path: (mtime_ns, bytes)} of every file under shards/."""
    res = {}
    for d, _, files in os.walk(os.path.join(out, "shards")):
        for f in files:
            p = os.path.join(d, f)
            res[os.path.relpath(p, out)] = (os.stat(p).st_mtime_ns, open(p, "rb").read())
    return res


def test_interrupted_run_resumes_without_redoing_shards(assets, tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    real = prepare_run.run_shard

    def crash_at_shard_3(task, out_dir):
        if task.index == 3:
            raise KeyboardInterrupt  # as if Ctrl-C arrived while shard 3 was being written
        return real(task, out_dir)

    monkeypatch.setattr(prepare_run, "run_shard", crash_at_shard_3)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(assets["m14"], assets["codec"], assets["tok"], out, progress=False,
                        shard_size=2)  # fmt: skip
    assert sorted(os.listdir(os.path.join(out, "shards"))) == ["00000", "00001", "00002"]
    assert not os.path.exists(os.path.join(out, "metadata.json"))  # not a finished dataset
    with pytest.raises(CorruptDatasetError, match="metadata.json is missing"):
        PreparedDataset(out)
    before = shard_files(out)
    # A worker killed mid-shard leaves a temp dir; the rerun must clear it.
    stale = os.path.join(out, "shards", ".tmp-00004-999")
    os.makedirs(stale)
    open(os.path.join(stale, "items.jsonl"), "w").write('{"id": "half"}\n')
    monkeypatch.setattr(prepare_run, "run_shard", real)
    s = prepare_dataset(assets["m14"], assets["codec"], assets["tok"], out, progress=False,
                        shard_size=2)  # fmt: skip
    assert (s["shards_reused"], s["shards_written"], s["num_items"]) == (3, 4, 14)
    after = shard_files(out)
    assert all(after[k] == v for k, v in before.items())  # finished shards untouched
    assert not os.path.exists(stale)
    assert_same_dataset(out, assets["clean"])
    # A rerun of a finished dataset does nothing.
    s = prepare_dataset(assets["m14"], assets["codec"], assets["tok"], out, progress=False,
                        shard_size=2)  # fmt: skip
    assert (s["shards_reused"], s["shards_written"]) == (7, 0) and shard_files(out) == after


def test_two_workers_give_the_same_dataset(assets, tmp_path, capsys):
    out = tmp_path / "w2"
    rc = main(["--manifest", assets["m14"], "--codec", assets["codec"], "--tokenizer",
               assets["tok"], "--out-dir", str(out), "--shard-size", "2", "--workers", "2"])  # fmt: skip
    assert rc == 0
    assert "prepare: 14/14 items" in capsys.readouterr().err
    assert_same_dataset(str(out), assets["clean"])
    for name in os.listdir(out / "shards"):  # byte-identical arrays and index
        for f in ("items.jsonl", "text_tokens.npy", "audio_codes.npy"):
            a = (out / "shards" / name / f).read_bytes()
            assert a == open(os.path.join(assets["clean"], "shards", name, f), "rb").read()


def test_failures_are_recorded_and_skipped(assets, tmp_path, capsys):
    base = os.path.dirname(assets["m14"])
    sf.write(tmp_path / "empty.wav", np.zeros(0, dtype=np.float32), 16000)
    (tmp_path / "junk.wav").write_bytes(b"RIFF not really")
    good = [json.loads(x) for x in open(assets["m14"])][:4]
    rows = [dict(r, audio=os.path.join(base, r["audio"])) for r in good]
    rows[1:1] = [{"id": "missing", "audio": str(tmp_path / "nope.wav"), "text": "a"},
                 {"id": "junk", "audio": str(tmp_path / "junk.wav"), "text": "b"},
                 {"id": "empty", "audio": str(tmp_path / "empty.wav"), "text": "c"},
                 {"id": "notext", "audio": rows[0]["audio"], "text": ""},
                 {"id": "blank_text_only", "text": "   "}]  # fmt: skip
    m = write_manifest(tmp_path / "m.jsonl", rows)
    out = tmp_path / "out"
    rc = main(["--manifest", m, "--codec", assets["codec"], "--tokenizer", assets["tok"],
               "--out-dir", str(out), "--shard-size", "3", "--no-progress"])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "4 items written" in printed and "5 skipped" in printed
    fails = [json.loads(x) for x in open(out / "failures.jsonl")]
    assert [(f["id"], f["reason"], f["source"]) for f in fails] == [
        ("missing", "missing_audio", f"{m}:2"), ("junk", "unreadable_audio", f"{m}:3"),
        ("empty", "empty_audio", f"{m}:4"), ("notext", "empty_text", f"{m}:5"),
        ("blank_text_only", "empty_text", f"{m}:6")]  # fmt: skip
    assert PreparedDataset(str(out)).ids == [r["id"] for r in good]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["items_written"] == 4 and summary["items_skipped"] == 5
    assert summary["skipped_by_reason"] == {"empty_audio": 1, "empty_text": 2, "missing_audio": 1,
                                            "unreadable_audio": 1}  # fmt: skip
    ds = PreparedDataset(str(out))
    assert summary["audio_tokens_per_stream"] == int(ds.audio_lengths.sum())
    assert summary["total_text_tokens"] == int(ds.text_lengths.sum())
    assert summary["hours"] == pytest.approx(summary["total_audio_seconds"] / 3600)
    # Every item bad: non-zero exit, failures listed, no metadata.json.
    m2 = write_manifest(tmp_path / "bad.jsonl", rows[1:5])
    with pytest.raises(NoItemsError, match="all 4 items failed"):
        prepare_dataset(m2, assets["codec"], assets["tok"], str(tmp_path / "o2"), progress=False)
    assert len(open(tmp_path / "o2" / "failures.jsonl").readlines()) == 4
    assert not (tmp_path / "o2" / "metadata.json").exists()
    assert main(["--manifest", m2, "--codec", assets["codec"], "--tokenizer", assets["tok"],
                 "--out-dir", str(tmp_path / "o3"), "--no-progress"]) == 1  # fmt: skip
    assert "all 4 items failed" in capsys.readouterr().err


def test_rerun_with_other_settings_is_refused(assets, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(assets["clean"], out)
    tok2 = demo_assets.build_tokenizer(str(tmp_path / "tok2"), assets["sentences"], vocab_size=280)
    with pytest.raises(PlanMismatchError, match=r"tokenizer\.hash differs.*--overwrite"):
        prepare_dataset(assets["m14"], assets["codec"], tok2, str(out), progress=False,
                        shard_size=2)  # fmt: skip
    with pytest.raises(PlanMismatchError, match="shard_size differs"):
        prepare_dataset(assets["m14"], assets["codec"], assets["tok"], str(out), progress=False)
    mimi = build_codec(str(tmp_path / "mimi"), "mimi")
    with pytest.raises(PlanMismatchError, match=r"codec\.name differs"):
        prepare_dataset(assets["m14"], mimi, assets["tok"], str(out), progress=False, shard_size=2)
    rows = [json.loads(x) for x in open(assets["m14"])]
    rows[5]["text"] = "an edited transcript"
    base = os.path.dirname(assets["m14"])
    m = write_manifest(os.path.join(base, "edited.jsonl"), rows)
    with pytest.raises(PlanMismatchError, match=r"inputs of shard 00002 changed"):
        prepare_dataset(m, assets["codec"], assets["tok"], str(out), progress=False, shard_size=2)
    assert_same_dataset(str(out), assets["clean"])  # refused runs changed nothing
    s = prepare_dataset(assets["m14"], assets["codec"], tok2, str(out), progress=False,
                        shard_size=2, overwrite=True)  # fmt: skip
    assert s["shards_written"] == 7
    assert PreparedDataset(str(out)).metadata["tokenizer"]["vocab_size"] == 280


def test_shard_metadata_disagreeing_with_global_is_an_error(assets, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(assets["clean"], out)
    sj = out / "shards" / "00003" / "shard.json"
    meta = json.loads(sj.read_text())
    sj.write_text(json.dumps(dict(meta, codec=dict(meta["codec"], config_hash="0" * 16))))
    with pytest.raises(ShardMismatchError, match=r"shards/00003: codec\.config_hash is '0000"):
        PreparedDataset(str(out))
    sj.write_text(json.dumps(dict(meta, tokenizer=dict(meta["tokenizer"], hash="f" * 16))))
    with pytest.raises(ShardMismatchError, match=r"shards/00003: tokenizer\.hash"):
        PreparedDataset(str(out))
    # A rerun does not trust such a shard either: it is redone.
    s = prepare_dataset(assets["m14"], assets["codec"], assets["tok"], str(out), progress=False,
                        shard_size=2)  # fmt: skip
    assert (s["shards_reused"], s["shards_written"]) == (6, 1)
    assert_same_dataset(str(out), assets["clean"])


def test_strict_error_in_a_worker_process_stops_the_run(assets, tmp_path):
    rows = [json.loads(x) for x in open(assets["m14"])]
    (tmp_path / "junk.wav").write_bytes(b"RIFF junk")  # passes the up-front checks
    rows[9]["audio"] = str(tmp_path / "junk.wav")  # shard 4 of 7
    m = write_manifest(os.path.join(os.path.dirname(assets["m14"]), "strict.jsonl"), rows)
    from torchtitan_speechlm.prepare.pipeline import BadItemError

    with pytest.raises(BadItemError, match=r"strict\.jsonl:10: item 'a9'.*unreadable"):
        prepare_dataset(m, assets["codec"], assets["tok"], str(tmp_path / "o"), progress=False,
                        shard_size=2, workers=2, strict=True)  # fmt: skip
    done = os.listdir(tmp_path / "o" / "shards")  # finished shards stay for a rerun, no temp dirs
    assert "00004" not in done and not any(d.startswith(".tmp") for d in done)


def test_untokenizable_text_is_recorded(assets, tmp_path, monkeypatch):
    from torchtitan_speechlm.prepare import pipeline, worker

    real_load = worker.load_text_tokenizer

    class Picky:
        """The real tokenizer, except that it fails on one text and returns nothing for another."""

        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __len__(self):
            return len(self.tok)

        def __call__(self, text, **kw):
            if text == "boom":
                raise ValueError("cannot handle this")
            return {"input_ids": []} if text == "void" else self.tok(text, **kw)

    for module in (pipeline, worker):  # where prepare looks the loader up
        monkeypatch.setattr(module, "load_text_tokenizer", lambda p: Picky(real_load(p)))
    m = write_manifest(tmp_path / "m.jsonl", [{"id": "ok", "text": "fine text"},
                                              {"id": "b", "text": "boom"},
                                              {"id": "v", "text": "void"}])  # fmt: skip
    prepare_dataset(m, assets["codec"], assets["tok"], str(tmp_path / "o"), progress=False)
    fails = [json.loads(x) for x in open(tmp_path / "o" / "failures.jsonl")]
    assert [(f["id"], f["reason"]) for f in fails] == [("b", "untokenizable_text"),
                                                       ("v", "untokenizable_text")]  # fmt: skip
    assert "ValueError: cannot handle this" in fails[0]["detail"]
    assert PreparedDataset(str(tmp_path / "o")).ids == ["ok"]
