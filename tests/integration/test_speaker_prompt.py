"""Speaker-prompted TTS end to end: a tiny model trained a few steps with the tts_prompt task
on a small multi-speaker corpus, then `torchtitan generate --task tts --prompt ref.wav` (one
request and a batch file); a model trained without the task refuses a prompt with the
reason; `torchtitan eval --valid tts_prompt:DIR --report` scores it and its page plays each
item's prompt beside the reference and the generated speech."""

import contextlib
import io
import json
import os
import re
from html import unescape
from urllib.parse import unquote, urlparse

import numpy as np
import pytest
import soundfile as sf

from tests.browser import browse, chromium_or_skip
from tests.helpers import make_tiny_run_assets, train_mixture
from torchtitan_speechlm.commands.generate import generate_main
from torchtitan_speechlm.judges import register_judge
from torchtitan_speechlm.judges.base import SpeakerJudge

pytestmark = [pytest.mark.slow, pytest.mark.long]  # end-to-end runs of prompted TTS: make faults

STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prompted")
    assets = make_tiny_run_assets(tmp / "assets", n_items=13, speakers=4)  # s0 has 4, s1-s3 3
    prompted, log = train_mixture(
        tmp, assets, "prompted", ["tts_prompt:tiny:0.5", "asr:tiny:0.5"], STEPS
    )
    plain, _ = train_mixture(tmp, assets, "plain", ["tts:tiny:0.5", "asr:tiny:0.5"], STEPS)
    ref = tmp / "ref.wav"  # 5 s, stereo, 22.05 kHz: resampled, downmixed, cut to 3 s
    t = np.arange(int(22050 * 5.0)) / 22050
    tone = (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)
    sf.write(ref, np.stack([tone, tone], 1), 22050)
    return {"prompted": prompted, "plain": plain, "ref": str(ref), "tmp": tmp, "log": log,
            "prepared": assets["prepared"]}  # fmt: skip


def test_training_records_the_prompt_budget(runs):
    with open(os.path.join(runs["prompted"], "..", "..", "speechlm_run.json")) as f:
        assert json.load(f)["model_args"]["prompt_seconds"] == 3.0
    with open(os.path.join(runs["plain"], "..", "..", "speechlm_run.json")) as f:
        assert json.load(f)["model_args"]["prompt_seconds"] == 0.0


def test_generate_with_a_prompt(runs, capsys):
    out = runs["tmp"] / "out.wav"
    argv = ["--model", runs["prompted"], "--task", "tts", "--text", "hello there"]
    rc = generate_main([*argv, "--prompt", runs["ref"], "--out", str(out), "--max-frames", "12"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "5.00 s, cut to its first 3 s" in captured.err
    assert sf.info(str(out)).frames > 0
    # a missing prompt file: one line naming it
    rc = generate_main([*argv, "--prompt", str(runs["tmp"] / "nope.wav"), "--max-frames", "4"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert rc == 2 and len(errors) == 1 and "nope.wav" in errors[0]
    # a prompt file that is not audio: the same
    (runs["tmp"] / "text.wav").write_text("not a wav\n")
    rc = generate_main([*argv, "--prompt", str(runs["tmp"] / "text.wav"), "--max-frames", "4"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert rc == 2 and len(errors) == 1 and "text.wav" in errors[0], err


def test_a_batch_file_takes_prompts(runs, capsys):
    batch = runs["tmp"] / "requests.jsonl"
    with open(batch, "w") as f:
        f.write(json.dumps({"id": "a", "task": "tts", "text": "hi", "prompt": runs["ref"]}) + "\n")
        f.write(json.dumps({"id": "b", "task": "tts", "text": "hello"}) + "\n")
    out = runs["tmp"] / "batch_out"
    rc = generate_main(
        ["--model", runs["prompted"], "--batch", str(batch), "--out-dir", str(out)]
        + ["--max-frames", "8"]
    )
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in open(out / "results.jsonl")]
    assert [r["id"] for r in rows] == ["a", "b"] and not any("error" in r for r in rows)


def test_a_model_trained_without_prompts_refuses_one(runs, capsys):
    rc = generate_main(
        ["--model", runs["plain"], "--task", "tts", "--text", "hello", "--prompt", runs["ref"]]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "trained without speaker prompts" in err and "tts_prompt" in err


@register_judge("band-speaker")
class BandSpeaker(SpeakerJudge):
    """A speaker "embedding" of 8 log band energies: cheap, and the same on a 16-bit wav."""

    name = "band-speaker"

    def embed(self, wav: np.ndarray, rate: int) -> np.ndarray:
        spec = np.abs(np.fft.rfft(np.asarray(wav, np.float64)))
        return np.log1p(np.array([b.mean() for b in np.array_split(spec, 8)]) * 100)


@pytest.fixture(scope="module")
def prompted_eval(runs, tmp_path_factory):
    """One ``eval --valid tts_prompt:DIR --out --report`` of the prompted model (the tests below
    read its JSON, page and wavs), with the prompts as the model heard them recomputed here."""
    from torchtitan_speechlm.commands.generate import eval_main
    from torchtitan_speechlm.data.catalog import open_prepared
    from torchtitan_speechlm.generation.loading import load_model

    tmp = tmp_path_factory.mktemp("prompted_eval")
    out, report = tmp / "r.json", tmp / "report"
    spec = f"tts_prompt:{runs['prepared']}"
    argv = ["--model", runs["prompted"], "--valid", spec, "--max-frames", "30",
            "--judge-asr", "none", "--judge-speaker", "band-speaker", "--judge-quality", "none",
            "--out", str(out), "--report", str(report)]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert eval_main(argv) == 0
    res = json.loads(out.read_text())[spec]
    ds = open_prepared(runs["prepared"])
    loaded = load_model(runs["prompted"])
    ids = {ds.ids[i]: i for i in range(len(ds))}
    rows = [ids[r["id"]] for r in res["per_item"]]
    speaker = [int(ds.speaker_of(i)) for i in rows]
    same = {s: [i for i, t in zip(rows, speaker, strict=True) if t == s] for s in set(speaker)}
    prompt = [
        same[s][(same[s].index(i) + 1) % len(same[s])] for i, s in zip(rows, speaker, strict=True)
    ]
    heard = [loaded.codec.decode(loaded.builder.cut_prompt(ds[p].audio_codes)) for p in prompt]
    return {"argv": argv, "spec": spec, "res": res, "printed": printed.getvalue(), "ds": ds,
            "rows": rows, "speaker": speaker, "prompt": prompt, "heard": heard,
            "report": report, "rate": int(loaded.codec.sample_rate)}  # fmt: skip


def test_eval_scores_prompted_tts_against_the_prompts_and_other_speakers(
    prompted_eval, tmp_path, capsys
):
    """``eval --valid tts_prompt:DIR``: each item prompted with another utterance of its
    speaker; SIM(generated, prompt), SIM(generated, other speakers) and speaker-ID accuracy
    recomputed here from the report's wavs and the prompts as the model heard them."""
    from torchtitan_speechlm.commands.generate import eval_main

    ev = prompted_eval
    res, ds, spec, report, printed = ev["res"], ev["ds"], ev["spec"], ev["report"], ev["printed"]
    rows, speaker, prompt, heard = ev["rows"], ev["speaker"], ev["prompt"], ev["heard"]
    q = res["prompted"]
    assert q["speakers"] == 4 and q["skipped"] == 0 and len(res["per_item"]) == len(ds)
    judge = BandSpeaker()
    assert all(
        p != i and int(ds.speaker_of(p)) == int(ds.speaker_of(i))
        for p, i in zip(prompt, rows, strict=True)
    )
    unit = lambda v: v / np.linalg.norm(v)  # noqa: E731
    p_emb = [unit(judge.embed(w, 16000)) for w in heard]
    enrol = {
        s: unit(np.mean([e for e, t in zip(p_emb, speaker, strict=True) if t == s], 0))
        for s in set(speaker)
    }
    own, other, hits = [], [], []
    for r, e, s in zip(res["per_item"], p_emb, speaker, strict=True):
        wav, rate = sf.read(report / r["audio"]["generated"])
        g = unit(judge.embed(wav, rate))
        own.append(float(e @ g))
        other += [float(enrol[t] @ g) for t in enrol if t != s]
        hits.append(max(enrol, key=lambda t: float(enrol[t] @ g)) == s)
        assert r["sim_prompt"] == pytest.approx(own[-1], abs=2e-3)
    assert q["sim_prompt"] == pytest.approx(np.mean(own), abs=2e-3)
    assert q["sim_other"] == pytest.approx(np.mean(other), abs=2e-3)
    assert q["speaker_id_accuracy"] == pytest.approx(np.mean(hits))
    assert f"{spec}: SIM(generated, prompt)" in printed
    no_speakers = make_tiny_run_assets(tmp_path / "plain_assets", n_items=4)["prepared"]
    argv = ev["argv"]
    assert eval_main([*argv[:2], "--valid", f"tts_prompt:{no_speakers}", *argv[4:]]) == 2
    assert "need speaker labels" in capsys.readouterr().err


def _items(page: str) -> list[str]:
    """The page's TTS items, one HTML chunk each."""
    return page.split('<div class="item">')[1:]


def test_the_report_plays_each_prompt_beside_the_reference_and_the_generated_speech(
    prompted_eval,
):
    """Per item, the page plays the prompt as the model heard it (cut to prompt_seconds,
    resynthesised: its wav is exactly that long), the prompt's original recording, the
    reference and the generated speech, shows SIM to the prompt and the speaker ID; the JSON
    names the prompt wavs (relative to the report folder) and which item prompted."""
    ev = prompted_eval
    res, ds, report, rate = ev["res"], ev["ds"], ev["report"], ev["rate"]
    page = (report / "index.html").read_text()
    chunks = _items(page)
    assert len(chunks) == len(res["per_item"])
    assert "speaker prompts: SIM to prompt" in page
    for r, chunk, p, heard in zip(res["per_item"], chunks, ev["prompt"], ev["heard"], strict=True):
        a = r["audio"]
        assert r["prompt_id"] == ds.ids[p] and r["prompt_seconds"] == pytest.approx(
            len(heard) / rate
        )
        srcs = [unquote(x) for x in re.findall(r'<audio[^>]* src="([^"]*)"', chunk)]
        # prompt heard, prompt recording, reference, generated, item recording: in that order
        assert srcs == [a["prompt"], a["prompt_recording"], a["reference"], a["generated"],
                        a["recording"]]  # fmt: skip
        assert a["prompt"].endswith(".prompt.wav") and a["prompt_recording"].endswith(
            ".prompt-rec.wav"
        )
        for rel in srcs:
            assert (report / rel).is_file() and sf.info(str(report / rel)).format == "WAV", rel
        info = sf.info(str(report / a["prompt"]))
        assert info.samplerate == rate and info.frames == len(heard)  # exactly what was heard
        original = sf.info(r["prompt_recording"])  # the prompt item's own recording, whole
        assert r["prompt_recording"].endswith(f"/{ds.ids[p]}.wav")
        assert sf.info(str(report / a["prompt_recording"])).duration == pytest.approx(
            original.duration, abs=1e-3
        )
        meta = unescape(re.search(r'<p class="meta prompt">([^<]*)</p>', chunk).group(1))
        who = "correct" if r["speaker_id_correct"] else "wrong"
        assert f"prompt {ds.ids[p]} " in meta and f"SIM to prompt {r['sim_prompt']:.3f}" in meta
        assert f"speaker ID {who}" in meta
        assert "prompt (as the model heard it)</figcaption>" in chunk


def test_the_prompted_report_plays_in_headless_chromium(prompted_eval):
    """The prompted page renders in a real browser without an error, and every player's
    duration is its wav's (five per item)."""
    chromium = chromium_or_skip()
    report = prompted_eval["report"]
    page = browse(chromium, (report / "index.html").as_uri())
    assert page["errors"] == [], page["errors"]
    assert len(page["audio"]) == 5 * len(prompted_eval["res"]["per_item"])
    for a in page["audio"]:
        path = unquote(urlparse(a["src"]).path)
        assert "error" not in a, a
        assert a["duration"] == pytest.approx(sf.info(path).duration, abs=0.05), path
    assert len(page["images"]) == len(page["audio"])
    assert all(img["width"] > 0 for img in page["images"]), page["images"]


def test_training_samples_of_a_prompted_run_are_spoken_in_a_prompt_voice(tmp_path):
    """``speechlm.sample_every`` on a ``tts_prompt`` run: each TTS sample is prompted with the
    next utterance of its item's speaker in the validation split (as eval draws it), and the
    prompt, as the model heard it, is written beside the sample."""
    from tests.helpers import run_train, write_tiny_config
    from torchtitan_speechlm.codecs import load_codec
    from torchtitan_speechlm.data.catalog import open_prepared, split_indices

    assets = make_tiny_run_assets(tmp_path / "assets", n_items=24, speakers=4)
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    text = (
        open(cfg)
        .read()
        .replace('train = ["tts:tiny:0.5", "asr:tiny:0.5"]', 'train = ["tts_prompt:tiny:1.0"]')
    )
    open(cfg, "w").write(text)
    r = run_train(
        cfg,
        "--training.steps", "2", "--speechlm.sample_every", "2", "--speechlm.sample_count", "2",
        "--checkpoint.enable", "false", "--validation.enable", "false",
        "--speechlm_data.valid_fraction", "0.5",
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    ds = open_prepared(assets["prepared"])
    valid = [int(i) for i in split_indices(ds.ids, 0.5, "valid") if ds.kinds[i] == "speech"]
    codec = load_codec(assets["codec"])
    frames = max(1, round(3.0 * codec.frame_rate))  # prompt_seconds = 3, as the run cuts it
    out = dump / "samples" / "step-2"
    for k, item in enumerate(valid[:2]):
        same = [i for i in valid if ds.speaker_of(i) == ds.speaker_of(item)]
        assert len(same) > 1  # 6 utterances per speaker, about half of them held out
        want = codec.decode(ds[same[(same.index(item) + 1) % len(same)]].audio_codes[:frames])
        heard, rate = sf.read(out / f"tts_{k}_prompt.wav", dtype="float32")
        assert rate == codec.sample_rate and heard.shape == want.shape
        assert np.abs(heard - want).max() < 2e-4  # the wav's 16-bit rounding
        assert sf.info(str(out / f"tts_{k}.wav")).frames > 0


def test_an_export_keeps_the_prompt_budget_and_speaks_as_its_checkpoint(runs, capsys):
    """``torchtitan export`` of a prompted checkpoint: the folder records ``prompt_seconds``,
    so ``generate --prompt`` from it takes the prompt and speaks exactly what the
    checkpoint speaks."""
    from torchtitan_speechlm.commands.export import export
    from torchtitan_speechlm.generation.loading import load_model

    folder = runs["tmp"] / "exported"
    if not folder.exists():
        export(runs["prompted"], str(folder))
    assert load_model(str(folder)).prompt_seconds == 3.0
    wavs = []
    for model in (runs["prompted"], str(folder)):
        out = runs["tmp"] / f"export_check_{len(wavs)}.wav"
        argv = ["--model", model, "--task", "tts", "--text", "hello there", "--prompt",
                runs["ref"], "--out", str(out), "--max-frames", "10"]  # fmt: skip
        assert generate_main(argv) == 0, capsys.readouterr().err
        wavs.append(sf.read(out)[0])
    assert wavs[0].shape == wavs[1].shape and np.array_equal(wavs[0], wavs[1])
