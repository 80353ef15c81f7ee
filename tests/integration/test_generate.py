"""Generation and evaluation end to end: a tiny model overfit on a handful of utterances through
`torchtitan train` regenerates their exact codec tokens greedily (TTS) and their exact text
(ASR), from the checkpoint folder and from an export; `torchtitan eval` scores WER 0 on them;
files read back at the codec's rate and length; bad requests are refused."""

import json

import numpy as np
import pytest
import soundfile as sf

from tests.helpers import make_tiny_run_assets, run_train, write_tiny_config
from torchtitan_speechlm.commands.generate import eval_main, generate_main
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import load_model

pytestmark = pytest.mark.slow
N_ITEMS = 4


@pytest.fixture(scope="module")
def overfit(tmp_path_factory):
    root = tmp_path_factory.mktemp("overfit")
    assets = make_tiny_run_assets(root / "assets", n_items=N_ITEMS)
    dump = root / "run"
    cfg = write_tiny_config(root / "c.toml", assets, dump)
    r = run_train(
        cfg,
        "--training.steps",
        "300",
        "--validation.enable",
        "false",
        "--checkpoint.interval",
        "300",
        "--optimizer.weight_decay",
        "0",
        "--metrics.log_freq",
        "50",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {
        "assets": assets,
        "step": str(dump / "checkpoint" / "step-300"),
        "root": root,
        "data": PreparedDataset(assets["prepared"]),
    }


def test_overfit_model_regenerates_its_data(overfit, tmp_path):
    loaded = load_model(overfit["step"])
    ds = overfit["data"]
    cfg = DecodeConfig(max_frames=200)
    items = [ds[i] for i in range(N_ITEMS)]
    codes = tasks.tts(loaded, [it.text for it in items], cfg)  # batched, greedy
    for it, c in zip(items, codes, strict=True):
        np.testing.assert_array_equal(c, it.audio_codes)
    texts = tasks.asr(loaded, [it.audio_codes for it in items], cfg)
    assert texts == [it.text for it in items]


def test_generate_command_writes_files_that_read_back(overfit, tmp_path):
    ds, step = overfit["data"], overfit["step"]
    item = ds[1]
    wav = tmp_path / "tts.wav"
    assert (
        generate_main(["--model", step, "--task", "tts", "--text", item.text, "--out", str(wav)])
        == 0
    )
    audio, rate = sf.read(wav)
    codec = load_model(step).codec
    assert rate == codec.sample_rate
    assert len(audio) == len(item.audio_codes) * codec.samples_per_frame
    manifest = [json.loads(x) for x in open(overfit["root"] / "assets" / "manifest.jsonl")]
    transcript = tmp_path / "asr.txt"
    assert (
        generate_main(
            [
                "--model",
                step,
                "--task",
                "asr",
                "--audio",
                manifest[1]["audio"],
                "--out",
                str(transcript),
            ]
        )
        == 0
    )
    assert transcript.read_text().strip() == item.text
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "a", "task": "tts", "text": ds[0].text},
                {"id": "b", "task": "asr", "audio": manifest[2]["audio"]},
                {"id": "c", "task": "continuation", "audio": manifest[3]["audio"]},
                {"id": "d", "task": "sing", "text": "la"},
            ]
        )
        + "\n"
    )
    out = tmp_path / "batch"
    assert generate_main(["--model", step, "--batch", str(requests), "--out-dir", str(out)]) == 1
    rows = {r["id"]: r for r in map(json.loads, open(out / "results.jsonl"))}
    assert rows["b"]["text"] == ds[2].text and (out / "a.wav").is_file()
    assert rows["c"]["frames"] >= len(ds[3].audio_codes)  # the prompt, then its continuation
    assert "unknown task 'sing'" in rows["d"]["error"]


def test_generate_creates_the_out_folder_or_says_in_one_line_why_not(overfit, tmp_path, capsys):
    step, ds = overfit["step"], overfit["data"]
    wav = tmp_path / "some" / "new" / "dir" / "out.wav"
    tts = ["--model", step, "--task", "tts", "--text", ds[0].text, "--max-frames", "200"]
    assert generate_main([*tts, "--out", str(wav)]) == 0
    assert len(sf.read(wav)[0]) == len(ds[0].audio_codes) * load_model(step).codec.samples_per_frame
    manifest = [json.loads(x) for x in open(overfit["root"] / "assets" / "manifest.jsonl")]
    transcript = tmp_path / "other" / "new" / "asr.txt"
    asr = ["--model", step, "--task", "asr", "--audio", manifest[0]["audio"]]
    assert generate_main([*asr, "--out", str(transcript)]) == 0
    assert transcript.read_text().strip() == ds[0].text
    capsys.readouterr()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for args in (tts, asr):
        out = blocker / "sub" / "out.wav"
        assert generate_main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err  # after the model's loading lines: one line
        assert err.endswith(
            f"\ntorchtitan generate: error: cannot write {out}: its folder cannot be created "
            f"because {blocker} is a file\n"
        )
        assert all(line.startswith("torchtitan generate: ") for line in err.splitlines())
        assert err.count(": error: ") == 1
    assert generate_main([*tts, "--out", str(tmp_path)]) == 2  # a folder, not a file name
    assert f"cannot write {tmp_path}: it is a folder" in capsys.readouterr().err


def test_eval_scores_wer_zero_on_the_memorised_set(overfit, tmp_path):
    out = tmp_path / "results.json"
    assert (
        eval_main(
            [
                "--model",
                overfit["step"],
                "--valid",
                "asr:tiny",
                "--valid",
                "tts:tiny",
                "--out",
                str(out),
                *("--judge-asr", "none", "--judge-speaker", "none", "--judge-quality", "none"),
            ]
        )
        == 0
    )  # (the judges themselves: tests/integration/test_eval.py)
    res = json.loads(out.read_text())
    assert res["asr:tiny"]["wer"] == 0.0 and res["asr:tiny"]["items"] == N_ITEMS
    tts = res["tts:tiny"]
    assert tts["self"]["asr_of_tts"]["wer"] == 0.0
    assert tts["self"]["token_accuracy"] > 0.95
    # the memorised codes exactly: each utterance ended by the model at the reference's length
    assert tts["eos_rate"] == 1.0 and tts["failures"] == []
    assert all(r["duration_ratio"] == 1.0 and r["ended"] for r in tts["per_item"])


def test_generate_from_an_export_and_bad_requests(overfit, tmp_path, capsys):
    from torchtitan_speechlm.commands.export import export

    folder = tmp_path / "exported"
    export(overfit["step"], str(folder))
    ds = overfit["data"]
    loaded = load_model(str(folder))
    codes = tasks.tts(loaded, [ds[0].text], DecodeConfig(max_frames=200))[0]
    np.testing.assert_array_equal(codes, ds[0].audio_codes)
    assert generate_main(["--model", str(folder), "--task", "tts", "--text", " "]) == 2
    assert "text to speak is empty" in capsys.readouterr().err
    assert generate_main(["--model", str(folder), "--task", "asr"]) == 2
    assert "needs an audio file" in capsys.readouterr().err
    stereo = tmp_path / "stereo.wav"  # another rate and two channels: resampled, downmixed
    mono, rate = sf.read(
        json.loads(open(overfit["root"] / "assets" / "manifest.jsonl").readline())["audio"]
    )
    from scipy.signal import resample_poly

    sf.write(stereo, np.stack([resample_poly(mono, 3, 1)] * 2, 1), rate * 3)
    assert generate_main(["--model", str(folder), "--task", "asr", "--audio", str(stereo)]) == 0


def test_samples_during_training_on_two_ranks(overfit, tmp_path):
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", overfit["assets"], dump)
    r = run_train(
        cfg,
        "--training.steps",
        "2",
        "--speechlm.sample_every",
        "2",
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        "--speechlm_data.valid_fraction",
        "0.5",
        "--metrics.enable_tensorboard",
        "true",
        nproc=2,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = dump / "samples" / "step-2"
    wav, rate = sf.read(out / "tts_0.wav")
    assert rate == 16000 and len(wav) % 320 == 0 and len(wav) > 0
    assert (out / "tts_0.txt").read_text().strip()
    assert (out / "asr_0.txt").read_text().startswith("ref: ")
    assert not (dump / "samples" / "step-1").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tb,) = (dump / "tb").iterdir()
    acc = EventAccumulator(str(tb), size_guidance={"audio": 0, "tensors": 0})
    acc.Reload()
    assert "samples/tts_0" in acc.Tags()["audio"]


def test_a_batch_file_runs_batched_like_one_request_at_a_time(overfit, tmp_path):
    """``generate --batch``: the requests, mixed tasks in a shuffled order with bad lines among
    them, give at --batch-size 8 exactly what each gives alone (--batch-size 1), in the file's
    order; each bad line fails alone with its reason."""
    ds = overfit["data"]
    manifest = [json.loads(x) for x in open(overfit["root"] / "assets" / "manifest.jsonl")]
    noise = tmp_path / "noise.wav"
    noise.write_bytes(b"RIFF not really a wav")
    lines = [
        json.dumps({"id": "t3", "task": "tts", "text": ds[3].text}),
        json.dumps({"id": "a1", "task": "asr", "audio": manifest[1]["audio"]}),
        "{not json",
        json.dumps({"id": "t0", "task": "tts", "text": ds[0].text, "seed": 4}),
        json.dumps({"id": "empty", "task": "tts", "text": ""}),
        json.dumps({"id": "a0", "task": "asr", "audio": manifest[0]["audio"]}),
        json.dumps({"id": "noise", "task": "asr", "audio": str(noise)}),
        json.dumps({"id": "t2", "task": "tts", "text": ds[2].text}),
        json.dumps({"id": "c1", "task": "continuation", "audio": manifest[1]["audio"]}),
        json.dumps({"id": "t1", "task": "tts", "text": ds[1].text}),
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    rows = {}
    for b in (8, 1):
        out = tmp_path / f"b{b}"
        argv = ["--model", overfit["step"], "--batch", str(requests), "--out-dir", str(out)]
        assert generate_main([*argv, "--batch-size", str(b), "--max-frames", "200"]) == 1
        rows[b] = [json.loads(x) for x in open(out / "results.jsonl")]
        assert [r["id"] for r in rows[b]] == [
            "t3", "a1", "line3", "t0", "empty", "a0", "noise", "t2", "c1", "t1"
        ]  # fmt: skip
        for r in rows[b]:
            if r["id"].startswith("t"):
                assert sf.read(out / f"{r['id']}.wav")[0].shape[0] == r["samples"]
    assert [{k: v for k, v in r.items() if k != "out"} for r in rows[8]] == [
        {k: v for k, v in r.items() if k != "out"} for r in rows[1]
    ]
    by_id = {r["id"]: r for r in rows[8]}
    for i in range(N_ITEMS):  # the memorised data, through the batched path
        assert by_id[f"t{i}"]["frames"] == len(ds[i].audio_codes)
    assert by_id["a0"]["text"] == ds[0].text and by_id["a1"]["text"] == ds[1].text
    assert "not a JSON request" in by_id["line3"]["error"]
    assert "task tts needs a text" in by_id["empty"]["error"]
    assert str(noise) in by_id["noise"]["error"]


def test_stream_writes_the_same_length_of_audio_as_it_is_generated(overfit, tmp_path):
    """``--stream``: the wav has the whole decode's length, the same spectrum within the stream
    decoder's tolerance (Griffin-Lim per window: other phases, the same magnitudes), and the
    result line reports the time to first audio; a batch file streams each row."""
    from scipy.signal import stft

    ds = overfit["data"]
    base = ["--model", overfit["step"], "--task", "tts", "--text", ds[2].text]
    whole, streamed = tmp_path / "whole.wav", tmp_path / "streamed.wav"
    assert generate_main([*base, "--out", str(whole)]) == 0
    assert generate_main([*base, "--out", str(streamed), "--stream"]) == 0
    a, b = sf.read(whole)[0], sf.read(streamed)[0]
    assert (
        len(a)
        == len(b)
        == len(ds[2].audio_codes) * load_model(overfit["step"]).codec.samples_per_frame
    )
    spec_a, spec_b = (np.log1p(np.abs(stft(x, nperseg=512)[2])).ravel() for x in (a, b))
    assert np.corrcoef(spec_a, spec_b)[0, 1] > 0.8
    requests = tmp_path / "r.jsonl"
    requests.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "task": "tts", "text": ds[i].text}) + "\n" for i in range(3)
        )
    )
    out = tmp_path / "out"
    argv = ["--model", overfit["step"], "--batch", str(requests), "--out-dir", str(out), "--stream"]
    assert generate_main(argv) == 0
    rows = [json.loads(x) for x in open(out / "results.jsonl")]
    for i, r in enumerate(rows):
        assert 0 < r["first_audio_s"] and r["samples"] == len(sf.read(out / f"t{i}.wav")[0])
        assert r["frames"] == len(ds[i].audio_codes)


def test_generate_and_eval_say_their_progress_and_the_frame_limit(
    overfit, tmp_path, capsys, monkeypatch
):
    """What a user waits on is never silent (utils/progress.py: here a line every 0.02 s of
    silence, each decode step made 0.02 s slower, so the decode shows its frames), eval says
    each item done; a
    generation the --max-frames limit cut says so, in its result and in one line."""
    import time

    from torchtitan_speechlm.model.model import SpeechLM
    from torchtitan_speechlm.utils import progress

    monkeypatch.setattr(progress, "EVERY_S", 0.02)
    step = SpeechLM.decode_step

    def slow_step(self, *args, **kwargs):  # a model as slow per frame as a large one
        time.sleep(0.02)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(SpeechLM, "decode_step", slow_step)
    text = overfit["data"][0].text
    argv = ["--model", overfit["step"], "--task", "tts", "--text", text, "--max-frames", "6"]
    assert generate_main([*argv, "--out", str(tmp_path / "a.wav")]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    said = [  # ours (transformers' loading bars aside), the heartbeat's repeats left out
        ln for ln in lines if ln.startswith("torchtitan ") and not ln.endswith("s elapsed)")
    ]
    assert said[0] == f"torchtitan generate: loading {overfit['step']}"
    assert said[1].startswith(f"torchtitan generate: loaded {overfit['step']} in ")
    assert said[2] == "torchtitan generate: tts: decoding (at most --max-frames 6)"
    frames = [ln for ln in lines if ln.startswith("torchtitan generate: decoding: ")]
    assert frames and all(" s of audio) (" in ln for ln in frames), lines
    rate = load_model(overfit["step"]).codec.frame_rate
    assert lines[-1] == (
        f"torchtitan generate: 1 of 1 generated utterance(s) reached --max-frames 6 "
        f"({6 / rate:.1f} s) without the model ending the speech: they stop at the limit, so "
        "their duration and end-of-speech figures measure it, not the model; raise "
        "--max-frames if the speech is longer, else the model has not learnt to end it"
    )
    result = json.loads(out)
    assert result["frames"] == 6 and result["ended"] is False
    # --quiet: only the frame limit's line, the result on stdout as before
    assert generate_main([*argv, "--out", str(tmp_path / "b.wav"), "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert [ln for ln in err.splitlines() if ln.startswith("torchtitan ")] == [lines[-1]]
    assert json.loads(out)["ended"] is False

    res = tmp_path / "r.json"
    judges = ("--judge-asr", "none", "--judge-speaker", "none", "--judge-quality", "none")
    assert eval_main(["--model", overfit["step"], "--valid", "tts:tiny", "--max-frames", "6",
                      "--out", str(res), *judges]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    items = [ln for ln in err.splitlines() if ln.startswith("torchtitan eval: tts:tiny: ")]
    done = [  # each item's line once: the heartbeat may repeat the last one, "(Ns elapsed)"
        ln.split(": ")[2].split(",")[0]
        for ln in items
        if " items, " in ln and not ln.endswith("s elapsed)")
    ]
    assert done == [f"{k}/{N_ITEMS} items" for k in range(1, N_ITEMS + 1)], err  # per item
    assert any(": generate: " in ln and " frames (" in ln for ln in items), err
    tts = json.loads(res.read_text())["tts:tiny"]
    assert tts["hit_max_frames"] == N_ITEMS and tts["eos_rate"] == 0.0
    assert (tts["max_frames"], tts["frame_rate"]) == (6, rate)
    assert f"tts:tiny: {N_ITEMS} of {N_ITEMS} generated utterance(s) reached --max-frames 6" in out
