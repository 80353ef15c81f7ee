"""The preference source of `torchtitan prepare` (--preference): tts and asr pairs prepared by
the real path into items of kind "preference" (prompt, chosen, rejected turns) with their
record and scores in items.jsonl; answers that are the same file or text skipped and recorded;
bad lines refused naming the file and line; a rescored pair is a changed input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.data_fixtures import build_assets
from tests.preference_fixtures import prepare_pairs
from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.commands.prepare import main
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.prepare.items import ManifestError
from torchtitan_speechlm.prepare.sources.preference import read_preference_jsonl
from torchtitan_speechlm.utils.audio import load_audio
from torchtitan_speechlm.utils.text_tokenizer import load_text_tokenizer


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    assets = build_assets(tmp_path_factory.mktemp("pref"))
    out, rows = prepare_pairs(assets, os.path.join(assets["root"], "prepared"))
    return {"assets": assets, "out": out, "rows": rows}


def items_jsonl(out: str) -> list[dict]:
    meta = json.load(open(os.path.join(out, "metadata.json")))
    return [json.loads(line) for e in meta["shards"]
            for line in open(os.path.join(out, "shards", e["name"], "items.jsonl"))]  # fmt: skip


def test_pairs_are_prepared_with_their_record_and_scores(prepared):
    out, rows = prepared["out"], prepared["rows"]
    kept = [r for r in rows if not r["id"].startswith("same_")]
    lines = items_jsonl(out)
    assert [x["id"] for x in lines] == [r["id"] for r in kept]
    for line, row in zip(lines, kept, strict=True):
        assert line["kind"] == "preference"
        assert line["preference"] == {"task": row["task"], "chosen": 1, "rejected": 2,
                                      "scores": row["scores"]}  # fmt: skip
        answer = "audio" if row["task"] == "tts" else "text"
        prompt = "text" if answer == "audio" else "audio"
        assert [(t["role"], t["modality"]) for t in line["turns"]] == [
            ("user", prompt), ("assistant", answer), ("assistant", answer)]  # fmt: skip
        assert line.get("speaker") == row.get("speaker")
    meta = json.load(open(os.path.join(out, "metadata.json")))
    assert meta["kinds"] == {"preference": len(kept)} and meta["source"]["type"] == "preference"


def test_the_turns_hold_the_prompt_and_both_answers(prepared):
    """Checked against the codec and tokenizer run on the input files here."""
    a = prepared["assets"]
    codec, tok = load_codec(a["codec"]), load_text_tokenizer(a["tok"])
    base = os.path.join(a["root"], "pairs")

    def codes(path):
        return codec.encode([load_audio(os.path.join(base, path), codec.sample_rate)])[0]

    def tokens(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    ds = PreparedDataset(prepared["out"])
    by_id = {r["id"]: r for r in prepared["rows"]}
    for i in range(len(ds)):
        item, row = ds[i], by_id[ds.ids[i]]
        if row["task"] == "tts":
            want = [tokens(row["text"]), codes(row["chosen"]["audio"]),
                    codes(row["rejected"]["audio"])]  # fmt: skip
        else:
            want = [codes(row["audio"]), tokens(row["chosen"]["text"]),
                    tokens(row["rejected"]["text"])]  # fmt: skip
        for turn, w in zip(item.turns, want, strict=True):
            np.testing.assert_array_equal(turn.tokens, np.asarray(w))


def test_answers_that_are_the_same_file_or_text_are_skipped_and_recorded(prepared):
    failed = [json.loads(x) for x in open(os.path.join(prepared["out"], "failures.jsonl"))]
    assert {f["id"]: f["reason"] for f in failed} == {
        "same_tts": "identical_pair", "same_asr": "identical_pair"}  # fmt: skip
    detail = {f["id"]: f["detail"] for f in failed}
    assert "same audio" in detail["same_tts"] and "t0c.wav" in detail["same_tts"]
    assert "same text" in detail["same_asr"]
    assert all(f["source"].endswith(f"pairs.jsonl:{11 if f['id'] == 'same_tts' else 12}")
               for f in failed)  # fmt: skip


GOOD = {"id": "p", "task": "tts", "text": "hi", "chosen": {"audio": "c.wav"},
        "rejected": {"audio": "r.wav"}, "scores": {"chosen": {"wer": 0}, "rejected": {"wer": 1}}}  # fmt: skip


def without(key):
    return {k: v for k, v in GOOD.items() if k != key and k != "id"} | {"id": "q"}


@pytest.mark.parametrize(
    "bad, message",
    [
        (without("scores"), "a preference pair without 'scores'"),
        (without("rejected"), "needs 'rejected'"),
        (without("chosen"), "needs 'chosen'"),
        ({**GOOD, "id": "q", "chosen": {"text": "x"}}, "chosen: 'audio' must be a non-empty string"),
        ({**GOOD, "id": "q", "task": "tts_pref"}, "task 'tts_pref' is not one of tts, asr, tts_prompt"),
        ({**GOOD, "id": "q", "task": "tts_prompt"},
         "a tts_prompt pair needs 'audio': its speaker prompt (a file)"),
        ({**GOOD, "id": "q", "task": "tts_prompt", "audio": "p.wav", "text": ""},
         "'text' must be a non-empty string"),
        ({**GOOD, "id": "q", "scores": {"chosen": {"wer": "low"}, "rejected": {"wer": 1}}},
         "scores['chosen'] must be a non-empty object of finite numbers"),
        ({**GOOD, "id": "q", "scores": {"chosen": {"wer": 0}}}, "'scores' must be an object with"),
        ({**GOOD, "id": "q", "task": "asr"}, "'audio' must be a non-empty string (missing)"),
        (GOOD, "duplicate id 'p' (first on line 1)"),
        (without("scores") | {"id": "p"}, "a preference pair without 'scores'"),
    ],
)  # fmt: skip
def test_bad_lines_are_refused_naming_the_file_and_line(tmp_path, bad, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(ManifestError) as e:
        read_preference_jsonl(str(path))
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value)


def test_the_cli_refuses_a_file_without_scores(prepared, tmp_path, capsys):
    a = prepared["assets"]
    row = {k: v for k, v in prepared["rows"][0].items() if k != "scores"}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(row) + "\n")
    argv = ["--preference", str(path), "--codec", a["codec"], "--tokenizer", a["tok"],
            "--out-dir", str(tmp_path / "out"), "--no-progress"]  # fmt: skip
    assert main(argv) == 1
    assert f"{path}:1: a preference pair without 'scores'" in capsys.readouterr().err


def test_rescoring_a_pair_changes_its_shard_inputs(prepared, tmp_path, capsys):
    """The record is part of a shard's inputs: new scores are not a finished shard."""
    a = prepared["assets"]
    rows = [dict(r) for r in prepared["rows"] if r["id"] in ("t0", "a1")]
    here = os.path.join(a["root"], "pairs")  # the audio, by absolute paths
    for key in ("chosen", "rejected"):
        rows[0][key] = {"audio": os.path.join(here, rows[0][key]["audio"])}
    rows[1]["audio"] = os.path.join(here, rows[1]["audio"])
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "out")
    argv = ["--preference", str(path), "--codec", a["codec"], "--tokenizer", a["tok"],
            "--out-dir", out, "--no-progress"]  # fmt: skip
    assert main(argv) == 0 and main(argv) == 0  # unchanged: reused
    rows[1] = {**rows[1], "scores": {"chosen": {"wer": 0.0}, "rejected": {"wer": 0.9}}}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(argv) == 1 and "inputs of shard 00000 changed" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    assert items_jsonl(out)[1]["preference"]["scores"] == rows[1]["scores"]


def test_a_repeat_before_a_bad_line_is_named_first(tmp_path):
    path = tmp_path / "pairs.jsonl"
    bad = {k: v for k, v in GOOD.items() if k != "scores"} | {"id": "q"}
    path.write_text("".join(json.dumps(r) + "\n" for r in (GOOD, GOOD, bad)))
    with pytest.raises(ManifestError, match=r"pairs.jsonl:2: duplicate id 'p' \(first on line 1\)"):
        read_preference_jsonl(str(path))


def test_tts_prompt_pairs_hold_the_speaker_prompt_then_the_text(tmp_path, capsys):
    """A tts_prompt pair's turns: its speaker prompt's audio and its text (user), the chosen
    and rejected audio (assistant), equal to the codec and tokenizer run on the input files
    here; a line without its prompt audio is refused by the CLI naming file and line."""
    import soundfile as sf

    from tests.data_fixtures import SR, tone

    a = build_assets(tmp_path / "assets")
    for i, name in enumerate(("p.wav", "c.wav", "r.wav")):
        sf.write(tmp_path / name, tone(i + 7, 0.4 + 0.3 * i, SR), SR)
    row = {**GOOD, "task": "tts_prompt", "audio": "p.wav", "text": a["sentences"][2]}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(row) + "\n")
    out = str(tmp_path / "out")
    argv = ["--preference", str(path), "--codec", a["codec"], "--tokenizer", a["tok"],
            "--out-dir", out, "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    (line,) = items_jsonl(out)
    assert line["kind"] == "preference"
    assert line["preference"] == {"task": "tts_prompt", "chosen": 2, "rejected": 3,
                                  "scores": row["scores"]}  # fmt: skip
    assert [(t["role"], t["modality"]) for t in line["turns"]] == [
        ("user", "audio"), ("user", "text"), ("assistant", "audio"), ("assistant", "audio")]  # fmt: skip
    codec, tok = load_codec(a["codec"]), load_text_tokenizer(a["tok"])
    want = [codec.encode([load_audio(str(tmp_path / n), codec.sample_rate)])[0]
            for n in ("p.wav", "c.wav", "r.wav")]  # fmt: skip
    want.insert(1, tok(row["text"], add_special_tokens=False)["input_ids"])
    (item,) = [PreparedDataset(out)[0]]
    for turn, w in zip(item.turns, want, strict=True):
        np.testing.assert_array_equal(turn.tokens, np.asarray(w))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n" + json.dumps({**row, "id": "q", "audio": None}) + "\n")
    argv[1], argv[-2] = str(bad), str(tmp_path / "o2")
    assert main(argv) == 1
    assert (
        f"{bad}:2: a tts_prompt pair needs 'audio': its speaker prompt" in capsys.readouterr().err
    )
