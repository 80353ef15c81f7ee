"""Every extension point used from outside the package, end to end: tests/toy_extension.py
registers a codec, a prepare source, an interleave pattern, a task and a backbone with its own
TrainSpec; `torchtitan prepare --import` and `torchtitan train` (custom_import) use them."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from tests.data_fixtures import tone
from tests.helpers import TINY_BACKBONE, TINY_TOML, read_metrics, run_train
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.utils.audio import load_audio

pytestmark = pytest.mark.slow
EXT = "tests.toy_extension"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Tone clips listed in a TSV, prepared with the toy codec through the toy source (2
    workers, which import the extension themselves); an HF and a toy-MLP backbone."""
    from transformers import AutoTokenizer

    from tests import toy_extension
    from torchtitan_speechlm.demo.assets import build_backbone, build_tokenizer, load_sentences

    root = tmp_path_factory.mktemp("toy")
    sentences = load_sentences()
    tok = build_tokenizer(str(root / "tok"), sentences)
    vocab = len(AutoTokenizer.from_pretrained(tok))
    hf = build_backbone(str(root / "hf"), vocab_size=vocab, **TINY_BACKBONE)
    mlp = root / "mlp"
    mlp.mkdir()
    (mlp / "config.json").write_text(
        json.dumps({"vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 2})
    )
    os.makedirs(root / "wavs")
    lines = []
    for i in range(32):
        sf.write(root / "wavs" / f"t{i}.wav", tone(i, 0.2 + 0.05 * (i % 7), 16000), 16000)
        lines.append(f"t{i}\twavs/t{i}.wav\t{sentences[i]}")
    (root / "corpus.tsv").write_text("\n".join(lines) + "\n")
    codec = toy_extension.save_tone_codec(str(root / "codec"))
    out = root / "prepared"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_speechlm.cli",
            "prepare",
            "--import",
            EXT,
            "--tsv",
            str(root / "corpus.tsv"),
            "--codec",
            codec,
            "--tokenizer",
            tok,
            "--out-dir",
            str(out),
            "--workers",
            "2",
            "--shard-size",
            "8",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {
        "root": root,
        "tok": tok,
        "hf": hf,
        "mlp": str(mlp),
        "prepared": str(out),
        "codec": codec,
    }


def test_prepared_with_the_toy_source_and_codec(toy):
    from tests.toy_extension import ToneCodec

    ds = PreparedDataset(toy["prepared"])
    assert ds.metadata["codec"]["name"] == "toy_tone" and ds.metadata["source"] == {"type": "tsv"}
    assert len(ds) == 32 and ds.metadata["codec"]["num_streams"] == 3
    codec = ToneCodec(toy["codec"], {"num_codebooks": 3})
    for i in (0, 13, 31):
        wav = load_audio(str(toy["root"] / "wavs" / f"t{i}.wav"), 16000)
        np.testing.assert_array_equal(ds[i].audio_codes, codec.encode([wav])[0])


def toml(toy, dump, **over) -> str:
    text = TINY_TOML.format(dump=dump, backbone=toy["hf"], prepared=toy["prepared"])
    text = text.replace('custom_import = "torchtitan_speechlm"', f'custom_import = "{EXT}"')
    text = text.replace('datasets = ["tiny=', 'datasets = ["toy=').replace(":tiny", ":toy")
    for old, new in over.items():
        assert old in text, old
        text = text.replace(old, new)
    path = dump.parent / f"{dump.name}.toml"
    path.write_text(text)
    return str(path)


def losses(dump) -> dict[int, float]:
    return {
        m["step"]: m["loss_metrics/global_avg_loss"]
        for m in read_metrics(dump)
        if "loss_metrics/global_avg_loss" in m
    }


def test_toy_pattern_and_task_train(toy, tmp_path):
    dump = tmp_path / "run"
    cfg = toml(
        toy,
        dump,
        **{
            'pattern = "delay"': 'pattern = "reverse_delay"',
            'train = ["tts:toy:0.5", "asr:toy:0.5"]': 'train = ["asr_then_tts:toy:1", "tts:toy:1"]',
        },
    )
    r = run_train(
        cfg, "--training.steps", "6", "--training.seq_len", "256", "--checkpoint.enable", "false"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(dump)
    assert sum(m.get("train/data/task_asr_then_tts", 0) for m in rows) > 0
    assert any("val/asr_toy/loss" in m for m in rows)
    # learning, on the fixed validation set (each training step has other samples)
    val = [m["val/asr_toy/loss"] for m in rows if "val/asr_toy/loss" in m]
    assert len(val) >= 2 and val[-1] < val[0], val


def test_toy_backbone_spec_trains_under_fsdp(toy, tmp_path):
    dump = tmp_path / "run"
    cfg = toml(
        toy,
        dump,
        **{
            'name = "speechlm"': 'name = "speechlm_toy"',
            'flavor = "hf"': 'flavor = "toy_mlp"',
            f'hf_assets_path = "{toy["hf"]}"': f'hf_assets_path = "{toy["mlp"]}"',
        },
    )
    r = run_train(
        cfg,
        "--training.steps",
        "6",
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        nproc=2,
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "Model speechlm_toy toy_mlp" in log and "Applied FSDP to the SpeechLM" in log
    loss = losses(dump)
    assert loss[6] < 0.95 * loss[1]  # no attention: it learns frame statistics only


def test_unknown_extension_names_fail_before_any_rank_with_the_registered_ones(toy, tmp_path):
    cfg = toml(toy, tmp_path / "run", **{'pattern = "delay"': 'pattern = "revers_delay"'})
    r = run_train(cfg, "--training.steps", "1")
    assert r.returncode == 2
    assert "unknown interleave pattern 'revers_delay'" in r.stderr
    assert "Did you mean 'reverse_delay'?" in r.stderr
    cfg = toml(
        toy, tmp_path / "run", **{'train = ["tts:toy:0.5"': 'train = ["tts_then_asr:toy:0.5"'}
    )
    r = run_train(cfg, "--training.steps", "1")
    assert r.returncode == 2 and "unknown task 'tts_then_asr'" in r.stderr
    assert "asr_then_tts" in r.stderr and not (tmp_path / "run").exists()
