"""Every task (tts, asr, continuation, text, dialogue) from one prepared manifest, trained
through `torchtitan train` with packing; the per-task counters show each in the batches."""

import json

import numpy as np
import pytest
import soundfile as sf

from tests.helpers import make_tiny_run_assets, read_metrics, run_train, write_tiny_config

pytestmark = pytest.mark.slow


def test_all_tasks_train_together(tmp_path):
    from torchtitan_speechlm.prepare.pipeline import prepare_dataset

    assets = make_tiny_run_assets(tmp_path / "assets", n_items=8)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(24):
        wav = tmp_path / f"w{i}.wav"
        sf.write(wav, (0.2 * rng.standard_normal(4000 + 200 * i)).astype(np.float32), 16000)
        if i % 4 == 0:
            lines.append({"id": f"s{i}", "audio": str(wav), "text": "hello there friend"})
        elif i % 4 == 1:
            lines.append({"id": f"t{i}", "text": f"a text only line number {i}"})
        elif i % 4 == 2:
            lines.append(
                {
                    "id": f"d{i}",
                    "turns": [
                        {"role": "system", "text": "be brief"},
                        {"role": "user", "audio": str(wav)},
                        {"role": "assistant", "text": "sure thing"},
                        {"role": "user", "text": "say it"},
                        {"role": "assistant", "audio": str(wav)},
                    ],
                }
            )
        else:
            lines.append({"id": f"a{i}", "audio": str(wav), "text": "audio and text again"})
    manifest = tmp_path / "mixed.jsonl"
    manifest.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    prepared = tmp_path / "mixed_prepared"
    prepare_dataset(
        str(manifest), assets["codec"], assets["tokenizer"], str(prepared), progress=False
    )
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", dict(assets, prepared=str(prepared)), dump)
    text = (
        open(cfg)
        .read()
        .replace(
            'train = ["tts:tiny:0.5", "asr:tiny:0.5"]',
            'train = ["tts:tiny", "asr:tiny", "continuation:tiny", "text:tiny", "dialogue:tiny"]',
        )
        .replace('valid = ["asr:tiny"]', 'valid = ["dialogue:tiny"]')
        .replace("seq_len = 160", "seq_len = 512")
    )
    open(cfg, "w").write(text)
    r = run_train(
        cfg,
        "--training.steps",
        "4",
        "--checkpoint.enable",
        "false",
        "--validation.freq",
        "4",
        "--speechlm_data.cfg_dropout",
        "0.5",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(dump)
    train = [m for m in rows if "train/loss" in m]
    for task in ("tts", "asr", "continuation", "text", "dialogue"):
        assert sum(m[f"train/data/task_{task}"] for m in train) > 0, task
    assert all(np.isfinite(m["train/loss"]) for m in train)
    assert any("val/dialogue_tiny/loss" in m for m in rows)
    assert train[-1]["train/data/padding_ratio"] < 0.5


def test_flatten_pattern_trains_end_to_end(tmp_path):
    """Single-stream models (Orpheus/Llasa style): every codebook in stream 0, which then
    predicts over the whole vocabulary; only stream 0 carries loss."""
    assets = make_tiny_run_assets(tmp_path / "assets", n_items=24)
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    r = run_train(
        cfg,
        "--training.steps",
        "8",
        "--speechlm.pattern",
        "flatten",
        "--training.seq_len",
        "512",
        "--checkpoint.enable",
        "false",
        "--validation.freq",
        "8",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    train = [m for m in read_metrics(dump) if "train/loss" in m]
    # the per-frame CE of stream 0 (the weighted loss moves with each step's ASR/TTS mix)
    assert train[-1]["train/ce_stream0"] < 0.9 * train[0]["train/ce_stream0"]
    for m in train:
        assert "train/ce_stream0" in m
        assert not any(f"train/ce_stream{k}" in m for k in (1, 2, 3))
        # every audio frame's 4 codes were predicted in stream 0, per codebook
        assert m["train/data/audio_frames"] > 0
    usage = [m for m in train if "train/codes/stream3/target_usage" in m]
    assert usage and all(m["train/codes/stream3/target_usage"] > 0 for m in usage)
