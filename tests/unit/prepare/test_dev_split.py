"""`torchtitan prepare --dev-fraction F` (issue 37): a deterministic dev split, by speaker where
the source names speakers (no speaker in both splits), else by item; two prepared datasets,
OUT/train and OUT/dev, that a training config reads as `train=` and `dev=` (the recipes' lines)."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import soundfile as sf

from tests.data_fixtures import assert_same_dataset
from tests.helpers import TINY_TOML, read_metrics, run_train, tiny_model_assets
from torchtitan_speechlm.commands.prepare import main
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.demo.assets import load_sentences
from torchtitan_speechlm.prepare.items import ManifestItem
from torchtitan_speechlm.prepare.split import SplitError, split_items


def _items(n: int, speakers: int = 0, unlabelled_every: int = 0) -> list[ManifestItem]:
    out = []
    for i in range(n):
        spk = f"s{(i * 7) % speakers}" if speakers else None
        if unlabelled_every and i % unlabelled_every == 0:
            spk = None
        out.append(ManifestItem(id=f"u{i}", audio=None, text=f"t{i}", speaker=spk))
    return out


def _ids(items) -> list[str]:
    return sorted(it.id for it in items)


# --- the split itself ---------------------------------------------------------------------


@pytest.mark.parametrize("speakers", [0, 25])
def test_split_is_a_function_of_ids_speakers_and_seed_not_of_order(speakers):
    items = _items(400, speakers, unlabelled_every=9 if speakers else 0)
    a = split_items(items, 0.1, seed=0)
    shuffled = list(items)
    random.Random(1).shuffle(shuffled)
    b = split_items(shuffled, 0.1, seed=0)
    assert _ids(a.dev) == _ids(b.dev) and _ids(a.train) == _ids(b.train)
    assert a.info == b.info
    assert [it.id for it in b.dev] == [it.id for it in shuffled if it in b.dev]  # source order
    c = split_items(items, 0.1, seed=1)
    assert _ids(c.dev) != _ids(a.dev)  # the seed chooses another dev set
    assert set(_ids(a.dev)).isdisjoint(_ids(a.train)) and len(a.dev) + len(a.train) == 400


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.1, 0.25, 0.5, 0.9])
def test_by_item_the_fraction_is_honoured_within_rounding(fraction):
    s = split_items(_items(203), fraction)
    assert len(s.dev) == max(1, round(fraction * 203))
    assert s.info["by"] == "item" and s.info["dev"]["items"] == len(s.dev)


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.3])
def test_by_speaker_no_speaker_is_in_both_splits(fraction):
    items = _items(300, speakers=30, unlabelled_every=11)  # 10 items a speaker + unlabelled ones
    s = split_items(items, fraction)
    dev_spk = {it.speaker for it in s.dev if it.speaker is not None}
    train_spk = {it.speaker for it in s.train if it.speaker is not None}
    assert dev_spk and dev_spk.isdisjoint(train_spk)
    assert s.info["by"] == "speaker"
    assert (s.info["dev"]["speakers"], s.info["train"]["speakers"]) == (
        len(dev_spk),
        len(train_spk),
    )
    # whole speakers of ~10 items and single unlabelled items: within half a speaker's items
    assert abs(len(s.dev) - round(fraction * len(items))) <= 5


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.0, 1.5])
def test_bad_fractions_are_refused_naming_the_flag(bad):
    with pytest.raises(
        SplitError, match=r"--dev-fraction \(dev_fraction\) must be between 0 and 1"
    ):
        split_items(_items(10), bad)


def test_a_split_that_cannot_hold_both_sides_is_refused():
    with pytest.raises(SplitError, match="cannot carve a dev split.*1 speakers"):
        split_items(_items(10, speakers=1), 0.2)


@pytest.mark.parametrize("bad", ["0", "1", "-0.5", "2"])
def test_cli_refuses_bad_fractions_before_doing_anything(bad, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--manifest", str(tmp_path / "none.jsonl"), "--codec", str(tmp_path / "c"),
            "--tokenizer", str(tmp_path / "t"), "--out-dir", str(out), "--dev-fraction", bad]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: --dev-fraction (dev_fraction) must be between 0 and 1" in err
    assert not out.exists()


def test_cli_refuses_a_dev_seed_without_a_dev_fraction(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--manifest", str(tmp_path / "none.jsonl"), "--codec", str(tmp_path / "c"),
            "--tokenizer", str(tmp_path / "t"), "--out-dir", str(out), "--dev-seed", "3"]  # fmt: skip
    assert main(argv) == 1
    assert "--dev-seed seeds the split of --dev-fraction: give both" in capsys.readouterr().err
    assert not out.exists()


# --- end to end: prepare, then train on train and validate on dev ----------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Tiny tokenizer/codec/backbone and a 24-item manifest of 8 speakers (3 items each)."""
    root = tmp_path_factory.mktemp("devsplit")
    assets = tiny_model_assets(root / "assets")
    rng = np.random.default_rng(0)
    manifest = root / "manifest.jsonl"
    with open(manifest, "w") as f:
        for i, text in enumerate(load_sentences()[:24]):
            t = np.arange(int(16000 * (0.3 + 0.02 * len(text.split())))) / 16000
            wav = 0.3 * np.sin(2 * np.pi * (150 + 20 * (i % 7)) * t) + 0.01 * rng.standard_normal(
                len(t)
            )
            sf.write(root / f"u{i}.wav", wav.astype(np.float32), 16000)
            line = {"id": f"u{i}", "audio": f"u{i}.wav", "text": text, "speaker": f"s{i % 8}"}
            f.write(json.dumps(line) + "\n")
    return {"root": root, "assets": assets, "manifest": str(manifest)}


def _prepare(corpus, out, *extra) -> int:
    a = corpus["assets"]
    return main(["--manifest", corpus["manifest"], "--codec", a["codec"], "--tokenizer",
                 a["tokenizer"], "--out-dir", str(out), "--no-progress", "--shard-size", "4",
                 "--dev-fraction", "0.25", *extra])  # fmt: skip


@pytest.mark.slow
@pytest.mark.long  # in make faults (make test budget)
def test_prepare_writes_train_and_dev_that_training_reads(corpus, capsys):
    root = corpus["root"]
    assert _prepare(corpus, root / "p1") == 0
    printed = capsys.readouterr().out
    assert f"prepared {root / 'p1' / 'train'}: 18 items written" in printed
    assert f"prepared {root / 'p1' / 'dev'}: 6 items written" in printed
    assert (
        "split: train 18 items of 6 speakers, dev 6 items of 2 speakers; dev holds 0.250 of the "
        "24 input items (--dev-fraction 0.25, by speaker, seed 0); no speaker in both"
    ) in printed
    train, dev = (
        PreparedDataset(str(root / "p1" / "train")),
        PreparedDataset(str(root / "p1" / "dev")),
    )
    assert (len(train), len(dev)) == (18, 6)
    assert set(train.speakers).isdisjoint(dev.speakers) and len(dev.speakers) == 2
    assert sorted(train.ids + dev.ids, key=lambda i: int(i[1:])) == [f"u{i}" for i in range(24)]
    info = json.loads((root / "p1" / "split.json").read_text())
    assert info["dev"] == {"items": 6, "speakers": 2} and info["by"] == "speaker"
    assert dev.metadata["source"]["split"] == {"name": "dev", "dev_fraction": 0.25, "seed": 0,
                                               "by": "speaker"}  # fmt: skip

    # two workers (and a rerun, which reuses every shard): the same two datasets, byte for byte
    assert _prepare(corpus, root / "p2", "--workers", "2") == 0
    assert "0 shards written, " not in capsys.readouterr().out
    for name in ("train", "dev"):
        assert_same_dataset(str(root / "p1" / name), str(root / "p2" / name))
    assert _prepare(corpus, root / "p1") == 0
    assert capsys.readouterr().out.count("0 shards written, ") == 2
    # another fraction in the same folder is another preparation: refused without --overwrite
    assert main(["--manifest", corpus["manifest"], "--codec", corpus["assets"]["codec"],
                 "--tokenizer", corpus["assets"]["tokenizer"], "--out-dir", str(root / "p1"),
                 "--no-progress", "--dev-fraction", "0.5"]) == 1  # fmt: skip
    assert "source differs" in capsys.readouterr().err

    # the recipes' lines: datasets = ["train=OUT/train", "dev=OUT/dev"], valid on dev
    dump = root / "run"
    text = TINY_TOML.format(dump=dump, **{**corpus["assets"], "prepared": ""})
    lines = json.dumps([f"train={root / 'p1' / 'train'}", f"dev={root / 'p1' / 'dev'}"])
    text = text.replace('datasets = ["tiny="]', f"datasets = {lines}")
    text = text.replace(
        'train = ["tts:tiny:0.5", "asr:tiny:0.5"]', 'train = ["tts:train:0.7", "asr:train:0.3"]'
    )
    text = text.replace('valid = ["asr:tiny"]', 'valid = ["tts:dev", "asr:dev"]')
    assert "tiny" not in text
    cfg = root / "run.toml"
    cfg.write_text(text)
    r = run_train(str(cfg), "--training.steps", "2", "--validation.freq", "2",
                  "--checkpoint.enable", "false")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(dump)
    for name in ("tts_dev", "asr_dev"):
        assert any(f"val/{name}/loss" in m for m in metrics), name
    assert os.path.isdir(root / "p1" / "dev" / "shards")
