"""Speaker-prompted TTS end to end: a tiny model trained a few steps with the tts_prompt task
on a small multi-speaker corpus, then `torchtitan generate --task tts --prompt ref.wav` (one
request and a batch file); a model trained without the task refuses a prompt with the
reason."""

import json
import os

import numpy as np
import pytest
import soundfile as sf

from tests.helpers import make_tiny_run_assets, run_train, write_tiny_config
from torchtitan_speechlm.commands.generate import generate_main

pytestmark = pytest.mark.slow

STEPS = 4


def train(tmp, assets, name, mixture):
    dump = tmp / name
    cfg = write_tiny_config(tmp / f"{name}.toml", assets, dump)
    text = (
        open(cfg)
        .read()
        .replace('train = ["tts:tiny:0.5", "asr:tiny:0.5"]', f"train = {json.dumps(mixture)}")
    )
    open(cfg, "w").write(text)
    r = run_train(
        cfg,
        "--training.steps", str(STEPS),
        "--checkpoint.interval", str(STEPS),
        "--validation.enable", "false",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return str(dump / "checkpoint" / f"step-{STEPS}"), r.stdout + r.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prompted")
    assets = make_tiny_run_assets(tmp / "assets", n_items=13, speakers=4)  # s0 has 4, s1-s3 3
    prompted, log = train(tmp, assets, "prompted", ["tts_prompt:tiny:0.5", "asr:tiny:0.5"])
    plain, _ = train(tmp, assets, "plain", ["tts:tiny:0.5", "asr:tiny:0.5"])
    ref = tmp / "ref.wav"  # 5 s, stereo, 22.05 kHz: resampled, downmixed, cut to 3 s
    t = np.arange(int(22050 * 5.0)) / 22050
    tone = (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)
    sf.write(ref, np.stack([tone, tone], 1), 22050)
    return {"prompted": prompted, "plain": plain, "ref": str(ref), "tmp": tmp, "log": log}


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
