"""`torchtitan eval` with independent judges, and its HTML report: a tiny model trained two steps
through `torchtitan train` is scored from its checkpoint and from its export with the same
numbers, transcripts and report; the report opens in a real headless Chromium without a console
error, every audio player's duration equal to its wav's; a judge that cannot be built is a
one-line error before anything is generated; an empty generation or audio a judge refuses is a
recorded failure of that item; the original recordings of a JSONL manifest's items are found
(relative and absolute paths) and judged beside the resynthesis, and an item whose wav is gone
falls back to the resynthesis alone. The judges here are small deterministic stand-ins registered
under test names (functions of the exact waveform, so equal numbers mean equal audio)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from urllib.parse import unquote, urlparse

import numpy as np
import pytest
import soundfile as sf

from tests.browser import browse, chromium_or_skip
from tests.helpers import (
    build_speechlm,
    make_tiny_run_assets,
    run_train,
    spoken_qa_dataset,
    write_tiny_config,
)
from torchtitan_speechlm.judges.base import (
    ASRJudge,
    JudgeError,
    QualityJudge,
    SpeakerJudge,
    register_judge,
)

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")
DECODE = ["--max-frames", "12", "--max-text-tokens", "8", "--limit", "3"]
JUDGE_FLAGS = ["--judge-asr", "test-asr", "--judge-speaker", "test-speaker"]
JUDGE_FLAGS += ["--judge-quality", "test-quality"]


@register_judge("test-asr")
class EnergyASR(ASRJudge):
    """Words picked by each 0.05 s chunk's mean level (a function of the exact samples)."""

    name = "test-asr"

    def transcribe(self, wav: np.ndarray, rate: int) -> str:
        hop = rate // 20
        if len(wav) < hop:
            raise JudgeError("shorter than the test judge's 0.05 s")
        levels = np.abs(wav[: len(wav) // hop * hop]).reshape(-1, hop).mean(1)
        return " ".join(WORDS[int(v * 1e5) % len(WORDS)] for v in levels[:6])


@register_judge("test-speaker")
class MomentsSpeaker(SpeakerJudge):
    name = "test-speaker"

    def embed(self, wav: np.ndarray, rate: int) -> np.ndarray:
        return np.array([np.abs(wav).mean(), wav.std(), np.abs(wav).max(), 1e-3])


@register_judge("test-quality")
class LevelQuality(QualityJudge):
    name = "test-quality"

    def score(self, wav: np.ndarray, rate: int) -> dict[str, float]:
        return {"dnsmos_ovrl": float(1 + 4 * np.tanh(wav.std())), "dnsmos_sig": 3.0}


@register_judge("test-refuses")
class RefusingQuality(QualityJudge):
    name = "test-refuses"

    def score(self, wav: np.ndarray, rate: int) -> dict[str, float]:
        raise JudgeError("this judge takes no audio at all")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Two training steps (a checkpoint at step 2) and the export of that checkpoint."""
    from torchtitan_speechlm.commands.export import export

    root = tmp_path_factory.mktemp("eval_judges")
    assets = make_tiny_run_assets(root / "assets", n_items=4)
    dump = root / "run"
    cfg = write_tiny_config(root / "c.toml", assets, dump)
    r = run_train(cfg, "--training.steps", "2", "--validation.enable", "false")
    assert r.returncode == 0, r.stderr[-3000:]
    step = str(dump / "checkpoint" / "step-2")
    exported = str(root / "exported")
    export(step, exported)
    return {
        "step": step,
        "export": exported,
        "prepared": assets["prepared"],
        "root": root,
        "assets": assets,
    }


def codec_rate(prepared) -> int:
    with open(os.path.join(prepared, "metadata.json")) as f:
        return int(json.load(f)["codec"]["sample_rate"])


def check_recording_floor(tts: dict, rate: int) -> None:
    """Each found item's recording transcript, WER / CER and harmonicity are the test ASR
    judge's and harmonicity's on the file itself (read at the codec's rate), and the set's
    recording floor their mean / pooled."""
    from torchtitan_speechlm.evaluation.harmonicity import harmonicity
    from torchtitan_speechlm.judges import error_rates, item_errors
    from torchtitan_speechlm.utils.audio import load_audio

    found = [r for r in tts["per_item"] if r["recording"] is not None]
    assert tts["recordings_found"] == len(found) > 0
    for r in found:
        wav = load_audio(r["recording"], rate)
        said = EnergyASR().transcribe(wav, rate)
        assert r["recording_transcript"] == said
        e = item_errors(r["text"], said)
        assert r["recording_wer"] == pytest.approx(e["wer"])
        assert r["recording_cer"] == pytest.approx(e["cer"])
        assert r["recording_seconds"] == pytest.approx(len(wav) / rate)
        assert -1 <= r["sim_recording"] <= 1
        assert r["harmonicity"]["recording"] == pytest.approx(harmonicity(wav, rate))
    floor = tts["floor_recording"]
    assert floor["wer"] == pytest.approx(np.mean([r["recording_wer"] for r in found]))
    assert floor["cer"] == pytest.approx(np.mean([r["recording_cer"] for r in found]))
    pooled = error_rates([r["text"] for r in found], [r["recording_transcript"] for r in found])
    assert floor["wer_corpus"] == pytest.approx(pooled["wer"])
    assert tts["sim_recording"] == pytest.approx(np.mean([r["sim_recording"] for r in found]))
    for what in ("generated", "reference", "recording"):  # means over the items that have one
        have = [r["harmonicity"][what] for r in tts["per_item"] if r["harmonicity"][what]]
        assert tts["harmonicity"][what] == pytest.approx(np.mean(have))
    assert all(r["harmonicity"]["recording"] is None for r in tts["per_item"] if r not in found)


def run_eval(model: dict, kind: str, *extra: str) -> int:
    """``torchtitan eval`` of ``model[kind]`` on the prepared folder (an export names no run
    datasets), as sets ``tts`` and ``asr``."""
    from torchtitan_speechlm.commands.generate import eval_main

    data = model["prepared"]
    args = ["--model", model[kind], "--valid", f"tts:{data}", "--valid", f"asr:{data}", *extra]
    return eval_main(args)


@pytest.fixture(scope="module")
def evaluated(model):
    """`torchtitan eval` with a report, on the checkpoint and on the export."""
    out = {}
    for kind in ("step", "export"):
        report, results = model["root"] / f"report-{kind}", model["root"] / f"{kind}.json"
        rc = run_eval(
            model, kind, *JUDGE_FLAGS, *DECODE, "--out", str(results), "--report", str(report)
        )
        assert rc == 0
        res = json.loads(results.read_text())
        out[kind] = {"report": report, "results": {k.split(":")[0]: v for k, v in res.items()}}
    return out


def test_eval_of_the_export_equals_eval_of_its_checkpoint(model, evaluated):
    a, b = evaluated["step"]["results"], evaluated["export"]["results"]
    assert a == b
    tts, asr = a["tts"], a["asr"]
    assert tts["items"] == 3 and len(tts["per_item"]) == 3 and asr["items"] == 3
    assert tts["judges"] == {
        "asr": "test-asr",
        "speaker": "test-speaker",
        "quality": "test-quality",
    }
    assert tts["reference_audio"] == "recording+resynthesised" and tts["recordings_found"] == 3
    wavs = os.path.join(str(model["root"] / "assets"), "wavs")
    for r in tts["per_item"]:  # the fixture's manifest names its wavs by absolute paths
        assert r["recording"] == os.path.join(wavs, f"{r['id']}.wav")
    check_recording_floor(tts, codec_rate(model["prepared"]))
    for r in tts["per_item"]:
        assert (
            r["transcript"]
            and r["reference_transcript"]
            and set(r["transcript"].split()) <= set(WORDS)
        )
        assert 0 <= r["wer"] and r["frames"] == 12 and r["ended"] is False  # two steps: no end yet
        assert r["seconds"] > 0 and r["duration_ratio"] == pytest.approx(
            r["seconds"] / r["reference_seconds"]
        )
        assert -1 <= r["sim"] <= 1 and 1 <= r["dnsmos"]["dnsmos_ovrl"] <= 5 and r["failures"] == []
        assert "self_transcript" in r and 0 <= r["self_wer"]
    assert tts["wer"] == pytest.approx(np.mean([r["wer"] for r in tts["per_item"]]))
    assert tts["floor"]["wer"] == pytest.approx(
        np.mean([r["reference_wer"] for r in tts["per_item"]])
    )
    assert tts["eos_rate"] == 0.0 and tts["failures"] == []
    assert 0 <= tts["self"]["token_accuracy"] <= 1 and "asr_of_tts" in tts["self"]
    assert {"id", "text", "transcript", "wer", "cer"} <= set(asr["per_item"][0])


def test_dialogue_sets_score_the_answers_on_checkpoint_and_export(model, tmp_path, capsys):
    """``--valid dialogue:QA`` (spoken QA on codec tokens): the answers of the checkpoint and
    of its export are the same, each is what ``torchtitan generate --task answer`` prints for
    the dialogue's wav and question, and WER / exact are computed from them against the
    dialogues' last turns. A set of another kind has no dialogue to score."""
    from torchtitan_speechlm.commands.generate import eval_main, generate_main
    from torchtitan_speechlm.judges import item_errors

    manifest, qa = spoken_qa_dataset(tmp_path, model["assets"], n=3)
    dialogues = [json.loads(line) for line in open(manifest)]
    decode = ["--max-text-tokens", "4"]
    results = {}
    for kind in ("step", "export"):
        out = tmp_path / f"{kind}.json"
        args = ["--model", model[kind], "--valid", f"dialogue:{qa}", *decode, "--out", str(out)]
        assert eval_main([*args, "--report", str(tmp_path / f"report-{kind}")]) == 0
        assert "answers exactly right" in capsys.readouterr().out
        results[kind] = json.loads(out.read_text())[f"dialogue:{qa}"]
    r = results["step"]
    assert results["export"] == r and r["task"] == "dialogue" and r["items"] == 3
    for d, x in zip(dialogues, r["per_item"], strict=True):
        audio, question, answer = (t.get("audio") or t.get("text") for t in d["turns"])
        assert x["id"] == d["id"] and x["text"] == answer
        argv = [
            "--model",
            model["export"],
            "--task",
            "answer",
            "--audio",
            audio,
            "--text",
            question,
        ]
        assert generate_main([*argv, *decode]) == 0
        assert capsys.readouterr().out.rstrip("\n") == x["transcript"]
        assert x["wer"] == pytest.approx(item_errors(answer, x["transcript"])["wer"])
    assert r["exact"] == pytest.approx(np.mean([x["wer"] == 0 for x in r["per_item"]]))
    assert "model's answer" in (tmp_path / "report-step" / "index.html").read_text()
    rc = eval_main(["--model", model["export"], "--valid", f"dialogue:{model['prepared']}"])
    assert rc == 2 and "no dialogue items to evaluate" in capsys.readouterr().err


def test_report_files_exist_and_link_only_inside(evaluated):
    report = evaluated["step"]["report"]
    page = (report / "index.html").read_text()
    links = re.findall(r'(?:src|href)="([^"]*)"', page)
    local = [unquote(x) for x in links if not x.startswith("data:")]
    # 3 items x (reference, generated, original recording)
    assert len([x for x in local if x.endswith(".wav")]) == 9
    assert len([x for x in local if x.endswith(".png")]) == 9
    assert len([x for x in local if x.endswith(".rec.wav")]) == 3
    assert page.count("original recording</figcaption>") == 3
    for rel in local:
        assert not urlparse(rel).scheme and not rel.startswith("/"), rel
        assert (report / rel).is_file(), rel
    assert "http://" not in page and "https://" not in page
    assert '<span class="sub"' in page or '<span class="del"' in page or '<span class="ins"' in page


def test_report_plays_in_headless_chromium(evaluated):
    chromium = chromium_or_skip()
    report = evaluated["step"]["report"]
    page = browse(chromium, (report / "index.html").as_uri())
    assert page["errors"] == [], page["errors"]
    assert all(u.startswith(("file:", "data:")) for u in page["requests"]), page["requests"]
    assert len(page["audio"]) == 9 and len(page["images"]) == 9
    for a in page["audio"]:
        path = unquote(urlparse(a["src"]).path)
        assert "error" not in a, a
        assert a["duration"] == pytest.approx(sf.info(path).duration, abs=0.05), path
    assert all(img["width"] > 0 for img in page["images"]), page["images"]


def test_the_default_judges_score_the_export(model, tmp_path, capsys):
    """pocketsphinx over the set's words, resemblyzer and DNSMOS (the eval extra): real
    transcripts within the set's vocabulary, DNSMOS in range, refusals recorded per item."""
    from torchtitan_speechlm.evaluation.judge_setup import vocabulary_words

    out = tmp_path / "defaults.json"
    rc = run_eval(model, "export", *DECODE, "--limit", "2", "--out", str(out))
    if rc == 2 and "pip install" in (err := capsys.readouterr().err):
        pytest.skip(f"the eval extra is not installed: {err.strip()}")
    assert rc == 0
    tts = next(v for k, v in json.loads(out.read_text()).items() if k.startswith("tts"))
    assert "pocketsphinx" in tts["judges"]["asr"] and "words" in tts["judges"]["asr"]
    assert "resemblyzer" in tts["judges"]["speaker"] and "dnsmos" in tts["judges"]["quality"]
    vocab = set(vocabulary_words([r["text"] for r in tts["per_item"]]))
    for r in tts["per_item"]:
        for said in (r["transcript"], r["reference_transcript"]):
            assert said is not None and set(said.split()) <= vocab
        assert (
            1 <= r["dnsmos"]["dnsmos_ovrl"] <= 5 and 1 <= r["reference_dnsmos"]["dnsmos_ovrl"] <= 5
        )
        assert r["sim"] is not None or any("speaker judge" in f for f in r["failures"])


def test_the_word_loop_judges_beside_another_asr_judge(model, tmp_path, capsys):
    """--judge-word-loop: a second ASR judge (pocketsphinx over each set's words) beside the
    main one; each item's WERs are its transcripts' against the text, the set's its means."""
    pytest.importorskip("pocketsphinx", reason="the eval extra (pocketsphinx) is not installed")
    from torchtitan_speechlm.evaluation.judge_setup import vocabulary_words
    from torchtitan_speechlm.judges import item_errors

    out = tmp_path / "loop.json"
    rc = run_eval(model, "export", *DECODE, "--limit", "2", "--judge-asr", "test-asr",
                  "--judge-speaker", "none", "--judge-quality", "none", "--judge-word-loop",
                  "--out", str(out))  # fmt: skip
    assert rc == 0
    tts = next(v for k, v in json.loads(out.read_text()).items() if k.startswith("tts"))
    assert "test-asr" in tts["judges"]["asr"] and "pocketsphinx" in tts["judges"]["word_loop"]
    vocab = set(vocabulary_words([r["text"] for r in tts["per_item"]]))
    for r in tts["per_item"]:
        loop = r["word_loop"]
        assert set(loop["transcript"].split()) <= vocab
        assert loop["wer"] == pytest.approx(item_errors(r["text"], loop["transcript"])["wer"])
        assert loop["transcript"] != r["transcript"] or not r["transcript"]  # another judge
    assert tts["word_loop"]["wer"] == pytest.approx(
        np.mean([r["word_loop"]["wer"] for r in tts["per_item"]])
    )
    assert tts["word_loop"]["floor_wer"] == pytest.approx(
        np.mean([r["word_loop"]["reference_wer"] for r in tts["per_item"]])
    )
    assert "--judge-word-loop" in capsys.readouterr().out


def test_judge_flags_choose_the_judges(tmp_path):
    """--judge-vocabulary eval (one loop per set, its own words), FILE (shared), open; a model
    folder that is not one; pocketsphinx options on another judge."""
    pytest.importorskip("pocketsphinx", reason="the eval extra (pocketsphinx) is not installed")
    from torchtitan_speechlm.evaluation.judge_setup import JudgeOptions, build_judges

    sets = {"tts:a": ["The cat saw a dog."], "tts:b": ["A dog!"]}
    off = {"speaker": "none", "quality": "none"}
    per_set = build_judges(JudgeOptions(**off), sets)
    assert per_set["tts:a"].asr is not per_set["tts:b"].asr
    assert "5 words" in per_set["tts:a"].asr.describe()
    assert "2 words" in per_set["tts:b"].asr.describe()
    words = tmp_path / "words.txt"
    words.write_text("cat dog\nbird\n")
    shared = build_judges(JudgeOptions(vocabulary=str(words), **off), sets)
    assert (
        shared["tts:a"].asr is shared["tts:b"].asr and "3 words" in shared["tts:a"].asr.describe()
    )
    assert (
        "open" in build_judges(JudgeOptions(vocabulary="open", **off), sets)["tts:a"].asr.describe()
    )
    with pytest.raises(JudgeError, match="config.json"):
        build_judges(JudgeOptions(asr=str(tmp_path), **off), sets)  # a folder, not a model's
    with pytest.raises(JudgeError, match="pocketsphinx options"):
        build_judges(JudgeOptions(asr="test-asr", vocabulary="open", **off), sets)


def error_line(err: str) -> str:
    """The one error line of ``torchtitan eval``'s stderr: progress lines (loading the model,
    the judges) may precede it, nothing else (no traceback, no second error line)."""
    lines = err.strip().splitlines()
    assert all(line.startswith("torchtitan eval: ") for line in lines), err
    errors = [line for line in lines if line.startswith("torchtitan eval: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


def test_bad_judge_is_one_line_before_generation(model, tmp_path, capsys, monkeypatch):
    from torchtitan_speechlm.evaluation import tts_scores

    def no_generation(*a, **k):
        raise AssertionError("generated before the judges were checked")

    monkeypatch.setattr(tts_scores.tasks, "tts_with_ends", no_generation)
    assert run_eval(model, "export", "--judge-asr", "/nonexistent", *DECODE) == 2
    err = error_line(capsys.readouterr().err)
    assert "/nonexistent" in err and "no such folder" in err
    assert run_eval(model, "export", *JUDGE_FLAGS[:4], "--judge-quality", "nosuch") == 2
    err = error_line(capsys.readouterr().err)
    assert "nosuch" in err and "test-quality" in err  # lists the registered
    grammar = ["--judge-grammar", str(tmp_path / "none.jsgf")]
    assert (
        run_eval(model, "export", "--judge-speaker", "none", "--judge-quality", "none", *grammar)
        == 2
    )
    assert "none.jsgf: no such file" in capsys.readouterr().err
    # as a user runs it: the exit status and no traceback
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torchtitan_speechlm.cli", "eval", "--model", model["export"]]
    r = subprocess.run(
        [*cmd, "--valid", f"tts:{model['prepared']}", "--judge-asr", "/nonexistent"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "/nonexistent" in error_line(r.stderr)


def test_judge_flags_are_checked_before_the_model_loads(model, tmp_path, capsys, monkeypatch):
    """Every ``--judge-*`` mistake that needs no judge built is the one error line before the
    model (or any judge) loads; an eval with no TTS set uses no judge and checks none."""
    from torchtitan_speechlm.commands import generate

    def no_loading(*a, **k):
        raise AssertionError("loaded before the judge flags were checked")

    monkeypatch.setattr(generate, "_load", no_loading)
    words = tmp_path / "empty_words.txt"
    words.write_text(" ,. \n")
    bad = {
        ("--judge-grammar", str(tmp_path / "none.jsgf")): "none.jsgf: no such file",
        ("--judge-vocabulary", str(tmp_path / "none.txt")): "none.txt: no such file",
        ("--judge-vocabulary", str(words)): "the file has no words",
        ("--judge-quality", "nosuch"): "registered:",
        ("--judge-asr", "test-speaker"): "that is a speaker judge, not an asr one",
        ("--judge-asr", "none", "--judge-vocabulary", "open"): "pocketsphinx options",
        ("--judge-vocabulary", "open", "--judge-grammar", str(words)): "not both",
        ("--judge-quality-items", "-1"): "give 0 (all) or more",
        ("--judge-speaker", "test-kindless"): "that is a ? judge, not an speaker one",
    }
    register_judge("test-kindless", type("Kindless", (), {}), replace=True)  # no `kind` at all
    for flags, said in bad.items():
        assert run_eval(model, "export", *flags) == 2, flags
        assert said in error_line(capsys.readouterr().err), flags
    # no TTS set: the judges score nothing, and the model is what loads first
    args = ["--model", model["export"], "--valid", f"asr:{model['prepared']}"]
    with pytest.raises(AssertionError, match="loaded before"):
        generate.eval_main([*args, "--judge-grammar", str(tmp_path / "none.jsgf")])


def test_empty_generation_and_refused_audio_are_recorded_failures(model, monkeypatch, tmp_path):
    from torchtitan_speechlm.commands.generate import eval_items
    from torchtitan_speechlm.evaluation import tts_scores
    from torchtitan_speechlm.evaluation.judge_setup import JudgeOptions, build_judges
    from torchtitan_speechlm.evaluation.report import write_report
    from torchtitan_speechlm.evaluation.results_table import summary_rows
    from torchtitan_speechlm.generation.decode import DecodeConfig
    from torchtitan_speechlm.generation.loading import load_model

    loaded = load_model(model["export"])
    items = eval_items(loaded, model["prepared"], 0.0, 3)
    real = tts_scores.tasks.tts_with_ends

    def first_empty(loaded, texts, cfg, **kw):  # items[0]'s generation is empty (by length)
        codes, ended = real(loaded, texts, cfg, **kw)
        k = texts.index(items[0].text)
        codes = [c[:0] if i == k else c for i, c in enumerate(codes)]
        return codes, [True if i == k else e for i, e in enumerate(ended)]

    monkeypatch.setattr(tts_scores.tasks, "tts_with_ends", first_empty)
    opts = JudgeOptions("test-asr", None, None, "test-speaker", "test-refuses")
    judges = build_judges(opts, {"tts:tiny": [it.text for it in items]})["tts:tiny"]
    cfg = DecodeConfig(max_frames=12, max_text_tokens=8)
    res = tts_scores.score_tts(loaded, items, cfg, judges, str(tmp_path), "tts")
    first, second = res["per_item"][0], res["per_item"][1]
    assert first["frames"] == 0 and first["transcript"] is None and first["sim"] is None
    assert first["wer"] == 1.0 and first["cer"] == 1.0 and first["self_wer"] == 1.0
    assert "empty generation (0 frames)" in first["failures"]
    assert first["reference_transcript"] is not None  # the floor is still measured
    assert second["transcript"] is not None and second["dnsmos"] is None
    assert any("takes no audio" in f for f in second["failures"])
    assert {"id": items[0].id, "failure": "empty generation (0 frames)"} in res["failures"]
    assert res["wer"] >= 1.0 / 3 and res["eos_rate"] == pytest.approx(1 / 3)
    row = summary_rows({"tts:tiny": res})[0]
    assert row["failures"] == "3" and row["DNSMOS"] == "-"  # every item: refused by quality
    json.dumps(res)  # the JSON --out writes
    assert first["audio"] == {
        "generated": None,
        "reference": "tts/0000-u0.ref.wav",
        "recording": None,
    }  # no recordings given: the resynthesis alone
    assert res["reference_audio"] == "resynthesised" and res["recordings_found"] == 0
    assert res["floor_recording"]["wer"] is None and res["sim_recording"] is None
    page = open(write_report({"tts": res}, str(tmp_path))).read()
    assert "no audio" in page and "(no transcript)" in page and "empty generation" in page


def test_nothing_decoded_when_nothing_listens(model, monkeypatch, tmp_path):
    """Judges ``none`` and no report (DPO's pair sampling by the model's own ASR): the codec
    decodes nothing (a HiFi-GAN decode is about half real time on a CPU) and every record is
    the one a decoded run gives, durations from the frame counts, harmonicity null."""
    from torchtitan_speechlm.commands.generate import eval_items
    from torchtitan_speechlm.evaluation import tts_scores
    from torchtitan_speechlm.evaluation.judge_setup import Judges
    from torchtitan_speechlm.generation.decode import DecodeConfig
    from torchtitan_speechlm.generation.loading import load_model

    loaded = load_model(model["export"])
    items = eval_items(loaded, model["prepared"], 0.0, 3)
    cfg = DecodeConfig(max_frames=12, max_text_tokens=8)
    decoded = tts_scores.score_tts(loaded, items, cfg, Judges(), str(tmp_path), "tts")
    real = tts_scores.tasks.decode_audio

    def refuse(*args, **kwargs):
        raise AssertionError("decoded audio nobody listens to")

    monkeypatch.setattr(tts_scores.tasks, "decode_audio", refuse)
    quiet = tts_scores.score_tts(loaded, items, cfg, Judges())
    rate, per_frame = loaded.codec.sample_rate, loaded.codec.samples_per_frame
    for a, b, it in zip(quiet["per_item"], decoded["per_item"], items, strict=True):
        wav = real(loaded, [np.asarray(it.audio_codes)])[0]
        assert a["reference_seconds"] == pytest.approx(len(wav) / rate)
        assert a["seconds"] == pytest.approx(a["frames"] * per_frame / rate)
        assert a["harmonicity"] == {"generated": None, "reference": None, "recording": None}
        assert b["harmonicity"]["generated"] is not None
        b = {k: v for k, v in b.items() if k not in ("audio", "harmonicity")}
        assert {k: v for k, v in a.items() if k != "harmonicity"} == b
    assert quiet["harmonicity"] == {"generated": None, "reference": None, "recording": None}


def _tone(path, seconds: float, hz: float) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    t = np.arange(int(16000 * seconds)) / 16000
    sf.write(path, (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), 16000)


def test_recordings_of_a_manifest_and_a_wav_moved_away(model, tmp_path, capsys):
    """A manifest with relative and absolute audio paths (and a blank and a text-only line
    before them): each item's recording is its own wav; one wav moved away after preparing
    makes that item fall back to the resynthesis, with no failure; the rest are judged on
    their files and shown as a third player in the report."""
    from torchtitan_speechlm.commands.generate import eval_main
    from torchtitan_speechlm.demo.assets import load_sentences
    from torchtitan_speechlm.evaluation.recordings import find_recordings
    from torchtitan_speechlm.prepare.pipeline import prepare_dataset

    corpus, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    texts = load_sentences()[:3]
    wavs = [str(corpus / "wavs" / "r0.wav"), str(corpus / "wavs" / "r1.wav")]
    wavs.append(str(elsewhere / "r2.wav"))
    for i, w in enumerate(wavs):
        _tone(w, 0.4 + 0.05 * i, 170 + 30 * i)
    lines = [json.dumps({"id": "t0", "text": "only words here"}), ""]
    lines += [json.dumps({"id": "r0", "audio": "wavs/r0.wav", "text": texts[0]})]
    lines += [json.dumps({"id": "r1", "audio": "./wavs/../wavs/r1.wav", "text": texts[1]})]
    lines += [json.dumps({"id": "r2", "audio": wavs[2], "text": texts[2]})]
    (corpus / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    prepared = str(tmp_path / "prepared")
    assets = model["assets"]
    prepare_dataset(
        str(corpus / "manifest.jsonl"), assets["codec"], assets["tokenizer"], prepared,
        progress=False,
    )  # fmt: skip
    ids = ["r0", "r1", "r2", "t0", "nosuch"]
    want = dict(zip(ids, [*wavs, None, None], strict=True))
    assert find_recordings(prepared, ids) == want

    os.rename(wavs[1], tmp_path / "moved.wav")
    assert find_recordings(prepared, ids) == {**want, "r1": None}
    out, report = tmp_path / "rec.json", tmp_path / "report"
    args = ["--model", model["export"], "--valid", f"tts:{prepared}", *JUDGE_FLAGS, *DECODE]
    assert eval_main([*args, "--out", str(out), "--report", str(report)]) == 0
    assert "rec floor" in (table := capsys.readouterr().out) and "2 of 3 found" in table
    tts = json.loads(out.read_text())[f"tts:{prepared}"]
    assert tts["reference_audio"] == "recording+resynthesised" and tts["recordings_found"] == 2
    assert tts["failures"] == []  # a missing recording is no failure
    items = {r["id"]: r for r in tts["per_item"]}
    assert [items[i]["recording"] for i in ("r0", "r1", "r2")] == [wavs[0], None, wavs[2]]
    gone = items["r1"]
    assert gone["recording_transcript"] is None and gone["recording_wer"] is None
    assert gone["sim_recording"] is None and gone["audio"]["recording"] is None
    assert gone["reference_transcript"] is not None and gone["sim"] is not None
    check_recording_floor(tts, codec_rate(prepared))
    # the floor stays the resynthesis's, over every item
    assert tts["floor"]["wer"] == pytest.approx(
        np.mean([r["reference_wer"] for r in items.values()])
    )
    page = (report / "index.html").read_text()
    assert page.count("original recording</figcaption>") == 2
    for r in (items["r0"], items["r2"]):
        rel = r["audio"]["recording"]
        assert rel.endswith(".rec.wav") and f'src="{rel}"' in page
        assert sf.info(str(report / rel)).duration == pytest.approx(
            r["recording_seconds"], abs=1e-3
        )
        assert (report / (rel[: -len(".wav")] + ".png")).is_file()


def test_only_readable_manifest_lines_name_recordings(tmp_path):
    """Kaldi and HF sources, a line edited since (another id), past the end, a manifest gone,
    a dialogue line: no recording. Another source type in metadata.json: none at all. The
    manifest lines read are cached."""
    from torchtitan_speechlm.evaluation.recordings import find_recordings

    _tone(str(tmp_path / "a.wav"), 0.2, 200)
    manifest, scp = tmp_path / "m.jsonl", tmp_path / "wav.scp"
    manifest.write_text(
        json.dumps({"id": "other", "audio": "a.wav", "text": "x"}) + "\n"
        + json.dumps({"id": "ok", "audio": "a.wav", "text": "x"}) + "\n"
        + json.dumps({"id": "d1", "turns": [{"role": "user", "audio": "a.wav"}]}) + "\n"
    )  # fmt: skip
    scp.write_text(f"k1 {tmp_path / 'a.wav'}\n")
    sources = {
        "k1": f"{scp}:1",
        "h1": f"{tmp_path}/hf[train]:row 3",
        "e1": f"{manifest}:1",
        "ok": f"{manifest}:2",
        "d1": f"{manifest}:3",
        "g1": f"{manifest}:9",
        "m1": f"{tmp_path}/gone.jsonl:1",
    }
    prepared = tmp_path / "prepared"
    (prepared / "shards" / "00000").mkdir(parents=True)
    rows = [{"id": k, "kind": "speech", "source": v} for k, v in sources.items()]
    (prepared / "shards" / "00000" / "items.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    meta = {"source": {"type": "manifest"}, "shards": [{"name": "00000"}]}
    (prepared / "metadata.json").write_text(json.dumps(meta))
    cache: dict = {}
    found = find_recordings(str(prepared), list(sources), cache)
    assert found == {**dict.fromkeys(sources), "ok": str(tmp_path / "a.wav")}
    manifest.unlink()  # lines already read come from the cache
    assert find_recordings(str(prepared), ["ok"], cache) == {"ok": str(tmp_path / "a.wav")}
    assert find_recordings(str(prepared), ["ok"]) == {"ok": None}
    (prepared / "metadata.json").write_text(json.dumps({**meta, "source": {"type": "kaldi"}}))
    assert find_recordings(str(prepared), ["ok"], cache) == {"ok": None}


def test_decoder_says_which_rows_ended_themselves(tmp_path):
    """``Decoder.ended``: True exactly where the model chose the end before max_frames."""
    from tests.helpers import save_tiny_backbone
    from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
    from torchtitan_speechlm.data.template_pieces import Segment
    from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder
    from torchtitan_speechlm.generation.sampling import Sampling

    save_tiny_backbone(tmp_path / "bb", vocab_size=60)
    seen = set()
    for pattern in ("delay", "parallel"):
        model = build_speechlm(tmp_path / "bb", num_streams=3, codebook_size=4, pattern=pattern)
        builder = TemplateBuilder(model.args.layout, pattern, LossWeights(1.0, 1.0, (1 / 3,) * 3))
        prompt = builder.prefix([Segment("user", "text", np.arange(3, 7))], "assistant", "audio")
        for seed in range(4):
            cfg = DecodeConfig(audio=Sampling(1.0), min_frames=0, max_frames=5, seed=seed)
            dec = Decoder(model.eval(), cfg)
            codes = dec.audio([prompt] * 4)
            assert dec.ended == [len(c) < 5 for c in codes]
            seen.update(dec.ended)
    assert seen == {True, False}


def _rates(ref: str, hyp: str | None) -> tuple[float, float]:
    """WER and CER with jiwer on the judges' normalised texts (no speech: 1.0 each)."""
    import jiwer

    from torchtitan_speechlm.judges.text_scoring import normalise_text

    if hyp is None:
        return 1.0, 1.0
    ref, hyp = normalise_text(ref), normalise_text(hyp)
    return jiwer.wer(ref, hyp), jiwer.cer(ref, hyp)


def test_best_of_keeps_the_sample_the_model_reads_back_best(model, tmp_path):
    """``best_of = 3``: per text, the one of its 3 samples (seed + k, each decoded alone here)
    that the model ended itself and transcribes with the lowest WER, then CER, then k; and
    ``eval --best-of 3`` speaks exactly those."""
    from dataclasses import replace

    from torchtitan_speechlm.commands.generate import eval_items, eval_main
    from torchtitan_speechlm.generation import tasks
    from torchtitan_speechlm.generation.decode import DecodeConfig
    from torchtitan_speechlm.generation.loading import load_model
    from torchtitan_speechlm.generation.sampling import Sampling

    loaded = load_model(model["step"])
    items = eval_items(loaded, model["prepared"], 0.0, 3)
    texts = [it.text for it in items]
    cfg = DecodeConfig(audio=Sampling(1.0), min_frames=0, max_frames=12, max_text_tokens=8, seed=5)
    expected, picks = [], []
    for text in texts:
        ranked = []
        for k in range(3):
            (codes,), (ended,) = tasks.tts_with_ends(loaded, [text], replace(cfg, seed=5 + k))
            hyp = tasks.asr(loaded, [codes], cfg)[0] if len(codes) else None
            ranked.append(((not ended, *_rates(text, hyp), k), codes))
        key, codes = min(ranked, key=lambda r: r[0])
        expected.append(codes)
        picks.append(key[-1])
        assert len({c.tobytes() for _, c in ranked}) > 1  # the samples differ
    assert set(picks) != {0}  # the choice is not simply the first sample
    streamed = []  # on_frames (streaming) gets each kept rendition whole, once chosen
    got, _ = tasks.tts_with_ends(
        loaded, texts, replace(cfg, best_of=3), on_frames=lambda i, c: streamed.append((i, c))
    )
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
    assert [(i, c.tolist()) for i, c in streamed] == [
        (i, e.tolist()) for i, e in enumerate(expected) if len(e)
    ]
    out = tmp_path / "best.json"
    args = ["--model", model["step"], "--valid", f"tts:{model['prepared']}", *JUDGE_FLAGS,
            *DECODE, "--min-frames", "0", "--temperature", "1.0", "--seed", "5", "--best-of", "3",
            "--out", str(out)]  # fmt: skip
    assert eval_main(args) == 0
    per_item = json.loads(out.read_text())[f"tts:{model['prepared']}"]["per_item"]
    assert [r["frames"] for r in per_item] == [len(c) for c in expected]


def test_quality_judge_on_the_first_items_only(model, tmp_path):
    """``--judge-quality-items 2``: DNSMOS-like scores for items 0 and 1 (generated and
    reference), none after; the set's mean is theirs and the table says how many."""
    from torchtitan_speechlm.commands.generate import eval_items
    from torchtitan_speechlm.evaluation.judge_setup import JudgeOptions, build_judges
    from torchtitan_speechlm.evaluation.results_table import format_table
    from torchtitan_speechlm.evaluation.tts_scores import score_tts
    from torchtitan_speechlm.generation.decode import DecodeConfig
    from torchtitan_speechlm.generation.loading import load_model
    from torchtitan_speechlm.judges.base import JudgeError

    loaded = load_model(model["export"])
    items = eval_items(loaded, model["prepared"], 0.0, 3)
    assert len(items) == 3
    sets = {"tts:tiny": [it.text for it in items]}
    opts = JudgeOptions("test-asr", None, None, "none", "test-quality", quality_items=2)
    judges = build_judges(opts, sets)["tts:tiny"]
    cfg = DecodeConfig(max_frames=12, max_text_tokens=8)
    res = score_tts(loaded, items, cfg, judges)
    scored = [r["dnsmos"] for r in res["per_item"]]
    refs = [r["reference_dnsmos"] for r in res["per_item"]]
    assert scored[0] and scored[1] and scored[2] is None
    assert refs[0] and refs[1] and refs[2] is None
    assert res["dnsmos_items"] == 2
    assert res["dnsmos"] == pytest.approx(np.mean([s["dnsmos_ovrl"] for s in scored[:2]]))
    assert "quality=test-quality (2 items)" in format_table({"tts:tiny": res})
    with pytest.raises(JudgeError, match="--judge-quality-items -1"):
        build_judges(
            JudgeOptions("test-asr", None, None, "none", "test-quality", quality_items=-1),
            sets,
        )


def test_pairs_from_seeded_judged_samples(model, tmp_path, capsys):
    """`eval --samples 3 --pairs`: sample k is the run with seed + k (its scores and its wav),
    each pair's sides are the best and worst sample by the reward (recomputed here from the test
    judge's transcript of the wav itself), every sample is listed, and prepare reads the pairs."""
    from torchtitan_speechlm.commands.generate import eval_main
    from torchtitan_speechlm.commands.prepare import main as prepare_main
    from torchtitan_speechlm.judges import item_errors
    from torchtitan_speechlm.utils.audio import load_audio

    data, rate = model["prepared"], codec_rate(model["prepared"])
    pairs = tmp_path / "pairs.jsonl"
    args = ["--model", model["step"], "--valid", f"tts:{data}", "--valid", f"asr:{data}",
            *JUDGE_FLAGS, *DECODE, "--temperature", "1.0", "--text-temperature", "1.0"]  # fmt: skip
    rc = eval_main([*args, "--seed", "5", "--samples", "3", "--pairs", str(pairs), "--reward", "asr:wer=-1",
                    "--reward", "tts:cer=-1,dnsmos=1", "--out", str(tmp_path / "all.json")])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    results = json.loads((tmp_path / "all.json").read_text())
    # sample 1 is exactly `eval --seed 6`
    assert eval_main([*args, "--seed", "6", "--out", str(tmp_path / "one.json")]) == 0
    alone = json.loads((tmp_path / "one.json").read_text())
    for spec in (f"tts:{data}", f"asr:{data}"):
        got, want = results[f"{spec} #1"]["per_item"], alone[spec]["per_item"]
        assert [r["transcript"] for r in got] == [r["transcript"] for r in want]
        assert [r["wer"] for r in got] == [r["wer"] for r in want]
    samples = [json.loads(x) for x in pairs.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 3 * 3  # 2 sets x 3 items x 3 samples, all listed
    lines = [json.loads(x) for x in pairs.read_text().splitlines()]
    said = re.search(r"pairs: (\d+) of 6 prompts", out)
    assert said and int(said.group(1)) == len(lines) >= 1
    for line in lines:
        mine = [s for s in samples if s["id"] == line["id"]]
        best, worst = max(s["reward"] for s in mine), min(s["reward"] for s in mine)
        assert line["scores"]["chosen"]["reward"] == best > worst
        assert line["scores"]["rejected"]["reward"] == worst
        for side in ("chosen", "rejected"):
            scores = line["scores"][side]
            if line["task"] == "tts":  # the wav itself, judged again here
                # the judge's transcript gives the CER; the wav itself (16-bit) the quality
                (heard,) = [s["transcript"] for s in mine if s["sample"] == scores["sample"]]
                cer = item_errors(line["text"], heard)["cer"]
                wav = load_audio(line[side]["audio"], rate)
                quality = LevelQuality().score(wav, rate)["dnsmos_ovrl"]
                assert scores["cer"] == pytest.approx(cer)
                assert scores["reward"] == pytest.approx(quality - cer, abs=1e-3)
            else:
                assert scores["reward"] == pytest.approx(-scores["wer"])
    out_dir = tmp_path / "prepared_pairs"
    argv = ["--preference", str(pairs), "--codec", model["assets"]["codec"], "--tokenizer",
            model["assets"]["tokenizer"], "--out-dir", str(out_dir), "--no-progress"]  # fmt: skip
    assert prepare_main(argv) == 0
    meta = json.loads((out_dir / "metadata.json").read_text())
    assert meta["num_items"] == len(lines)


def test_pairs_refuse_greedy_samples_and_one_sample(model, capsys):
    from torchtitan_speechlm.commands.generate import eval_main

    args = ["--model", model["step"], "--valid", f"tts:{model['prepared']}", *JUDGE_FLAGS,
            *DECODE, "--pairs", "/nonexistent/p.jsonl"]  # fmt: skip
    assert eval_main([*args, "--samples", "3"]) == 2
    assert "all the same greedy decode: set --temperature > 0" in capsys.readouterr().err
    assert eval_main([*args, "--samples", "1", "--temperature", "1"]) == 2
    assert "--pairs needs --samples K with K >= 2" in capsys.readouterr().err


@pytest.mark.long  # 21 s: in `make faults` (make test keeps --pairs and the DPO runs)
def test_the_online_loop_runs_its_rounds_and_a_rerun_continues(model, tmp_path):
    """`torchtitan prefer`: round 0 samples from the config's init_from, round 1 from round 0's
    last checkpoint (its samples equal `eval --seed 1000` of that checkpoint); raising --rounds
    continues without redoing round 0; the recorded mean reward is the samples'; other settings
    are refused."""
    from tests.helpers import write_tiny_config
    from torchtitan_speechlm.commands.generate import eval_main
    from torchtitan_speechlm.commands.prefer import run
    from torchtitan_speechlm.commands.prefer_args import build_parser

    data, work = model["prepared"], tmp_path / "loop"
    cfg = write_tiny_config(tmp_path / "dpo.toml", model["assets"], tmp_path / "unused")
    text = open(cfg).read().replace(
        "z_loss_weight = 1e-3", f'z_loss_weight = 1e-3\npreference_loss = "dpo"\n'
        f'init_from = "{model["step"]}"',
    )  # fmt: skip
    open(cfg, "w").write(text)
    sampling = [*JUDGE_FLAGS, *DECODE, "--temperature", "1.0", "--text-temperature", "1.0"]
    args = ["--job.config_file", cfg, "--prompts", f"tts:{data}", "--prompts", f"asr:{data}", "--work",
            str(work), "--steps", "2", "--samples", "3", "--reward", "tts:cer=-1,dnsmos=1",
            "--train-arg", "training.seq_len=512", *sampling]  # fmt: skip
    assert run(build_parser().parse_args([*args, "--rounds", "1"])) == 0
    first = (work / "round-0" / "pairs.jsonl").stat().st_mtime_ns
    assert run(build_parser().parse_args([*args, "--rounds", "2"])) == 0
    assert (work / "round-0" / "pairs.jsonl").stat().st_mtime_ns == first  # not redone
    state = json.loads((work / "loop.json").read_text())
    step0 = str(work / "round-0" / "train" / "checkpoint" / "step-2")
    assert [state["rounds"][r]["model"] for r in ("0", "1")] == [model["step"], step0]
    assert (work / "round-1" / "train" / "checkpoint" / "step-2").is_dir()
    samples = [json.loads(x) for x in (work / "round-1" / "pairs.samples.jsonl").open()]
    rewards = [s["reward"] for s in samples]
    assert state["rounds"]["1"]["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    # round 1 sampled round 0's model with seed 0 + 1000
    out = tmp_path / "alone.json"
    eval_main(["--model", step0, "--valid", f"tts:{data}", *sampling, "--seed", "1000",
               "--out", str(out)])  # fmt: skip
    alone = json.loads(out.read_text())[f"tts:{data}"]["per_item"]
    mine = [s for s in samples if s["sample"] == 0 and s["id"].startswith("tts-")]
    assert [s["transcript"] for s in mine] == [r["transcript"] for r in alone]
    assert run(build_parser().parse_args([*args, "--rounds", "2", "--steps", "3"])) == 2


def test_tts_prompt_pairs_from_seeded_judged_samples(tmp_path, capsys):
    """`eval --valid tts_prompt:DIR --samples 2 --pairs --reward tts_prompt:sim=1,wer=-1` of a
    tiny speaker-prompted model: each line's prompt audio is the prompt as the model heard it
    (recomputed here from the prompt item's codes), its sides' rewards are SIM to that prompt
    (by the test judge on the wavs themselves) minus the WER; prepare reads the lines and the
    prepared pair's documents are the plain tts_prompt task's for the same prompt, text and
    answer."""
    from tests.helpers import train_mixture
    from torchtitan_speechlm.commands.generate import eval_main
    from torchtitan_speechlm.commands.prepare import main as prepare_main
    from torchtitan_speechlm.data.catalog import open_prepared
    from torchtitan_speechlm.data.pairs import PairSide, build_pair
    from torchtitan_speechlm.data.reader import PreparedDataset
    from torchtitan_speechlm.generation.loading import load_model
    from torchtitan_speechlm.utils.audio import load_audio

    assets = make_tiny_run_assets(tmp_path / "assets", n_items=6, speakers=2)
    step, _ = train_mixture(tmp_path, assets, "prompted", ["tts_prompt:tiny:1.0"], 2)
    data, pairs = assets["prepared"], tmp_path / "pairs.jsonl"
    argv = ["--model", step, "--valid", f"tts_prompt:{data}", *JUDGE_FLAGS, *DECODE,
            "--temperature", "1.0", "--samples", "2", "--pairs", str(pairs),
            "--reward", "tts_prompt:sim=1,wer=-1"]  # fmt: skip
    assert eval_main(argv) == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in pairs.read_text().splitlines()]
    samples = [json.loads(x) for x in pairs.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 2 and len(lines) >= 1
    loaded, ds = load_model(step), open_prepared(data)
    rate, spk = int(loaded.codec.sample_rate), MomentsSpeaker()
    ids = {ds.ids[i]: i for i in range(len(ds))}
    for line in lines:
        assert line["task"] == "tts_prompt" and line["id"].startswith("tts_prompt-")
        item = ids[line["id"].removeprefix("tts_prompt-")]
        same = [j for j in range(len(ds)) if ds.speaker_of(j) == ds.speaker_of(item)]
        prompt = same[(same.index(item) + 1) % len(same)]  # as prompted_set draws it
        heard = loaded.codec.decode(loaded.builder.cut_prompt(ds[prompt].audio_codes))
        wav = load_audio(line["audio"], rate)
        np.testing.assert_allclose(wav, np.asarray(heard).reshape(-1)[: len(wav)], atol=1e-3)
        assert line["text"] == ds[item].text
        p = spk.embed(wav, rate)
        for side in ("chosen", "rejected"):
            g = spk.embed(load_audio(line[side]["audio"], rate), rate)
            sim = float(p @ g / np.linalg.norm(p) / np.linalg.norm(g))
            scores = line["scores"][side]
            assert scores["sim"] == pytest.approx(sim, abs=1e-3)
            assert scores["reward"] == pytest.approx(scores["sim"] - scores["wer"])
    out = tmp_path / "prepared_pairs"
    assert prepare_main(["--preference", str(pairs), "--codec", assets["codec"], "--tokenizer",
                         assets["tokenizer"], "--out-dir", str(out), "--no-progress"]) == 0  # fmt: skip
    prepared, b = PreparedDataset(str(out)), loaded.builder
    assert len(prepared) == len(lines)
    for i in range(len(prepared)):
        turns = prepared[i].turns
        pair = build_pair(b, "tts_prompt_pref", prepared[i])
        for doc, answer in zip(pair.documents, turns[2:], strict=True):
            plain = b.build("tts_prompt", PairSide("x", turns[1].tokens, answer.tokens),
                            prompt=PairSide("p", turns[1].tokens, turns[0].tokens))  # fmt: skip
            np.testing.assert_array_equal(doc.frames, plain.frames)
    # DPO with the RPO term on the tts_prompt pairs, from the sampling model (its reference):
    # step 1's loss is log 2 (policy = reference) plus nll_weight x the chosen's NLL
    from tests.helpers import read_metrics, run_train, write_tiny_config

    # (a 2-step model's samples re-encode to the same codes: each rejected side here is
    # another line's prompt audio, so every pair trains)
    for i, line in enumerate(lines):
        line["rejected"]["audio"] = lines[(i + 1) % len(lines)]["audio"]
    pairs2, out2 = tmp_path / "pairs2.jsonl", tmp_path / "prepared_pairs2"
    pairs2.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert prepare_main(["--preference", str(pairs2), "--codec", assets["codec"], "--tokenizer",
                         assets["tokenizer"], "--out-dir", str(out2), "--no-progress"]) == 0  # fmt: skip
    dump = tmp_path / "dpo"
    cfg = write_tiny_config(str(tmp_path / "dpo.toml"), assets, str(dump))
    text = open(cfg).read().replace('datasets = ["tiny=', 'datasets = ["pairs=')
    text = text.replace(assets["prepared"], str(out2))
    text = text.replace(
        'train = ["tts:tiny:0.5", "asr:tiny:0.5"]', 'train = ["tts_prompt_pref:pairs"]'
    )
    text = text.replace(
        "z_loss_weight = 1e-3",
        "z_loss_weight = 1e-3\n"
        f'preference_loss = "dpo"\npreference_nll_weight = 0.5\ninit_from = "{step}"',
    )
    open(cfg, "w").write(text)
    r = run_train(cfg, "--training.steps", "2", "--validation.enable", "false",
                  "--training.seq_len", "384", "--validation.seq_len", "384",
                  "--speechlm_data.valid", "tts_prompt_pref:pairs")  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [m for m in read_metrics(dump) if "train/preference_loss" in m]
    first = rows[0]
    assert first["train/nll_loss"] > 0
    want = np.log(2) + 0.5 * first["train/nll_loss"]
    assert first["train/preference_loss"] == pytest.approx(want, abs=1e-5)
    assert first["train/rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert first["train/preference_pairs"] >= 1 and not first.get("train/data/pref_identical")
