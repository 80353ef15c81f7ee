"""Preference training through `torchtitan train` (docs/preference.md): DPO on tts and asr
pairs prepared by `torchtitan prepare --preference`, its reference log-probs computed before
step 1 by the starting weights; 2 processes equal 1, a resume continues exactly, SimPO runs,
and a DPO resume without its reference is refused."""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest

from tests.helpers import read_metrics, run_train, tiny_model_assets, write_tiny_config
from tests.preference_fixtures import prepare_pairs
from torchtitan_speechlm.demo.assets import load_sentences

pytestmark = pytest.mark.slow  # ~25 s: in make test

PREF = ["--training.seq_len", "512", "--validation.seq_len", "512", "--training.steps", "4",
        "--training.global_batch_size", "4", "--checkpoint.interval", "2",
        "--validation.freq", "2", "--optimizer.lr", "3e-3"]  # fmt: skip
TP = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")
PP = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
      "1", "--parallelism.pipeline_parallel_microbatch_size", "1")  # fmt: skip
NATIVE = ("--model.flavor", "native", "--validation.enable", "false")
STATS = ("train/loss", "train/preference_loss", "train/rewards/margins",
         "train/rewards/accuracies", "train/logps/chosen", "train/logps/rejected",
         "train/preference_pairs", "grad_norm")  # fmt: skip


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    paths = tiny_model_assets(root / "assets")
    assets = {"root": str(root), "codec": paths["codec"], "tok": paths["tokenizer"],
              "sentences": load_sentences()}  # fmt: skip
    prepared, rows = prepare_pairs(assets, str(root / "prepared"))
    return root, dict(paths, prepared=prepared)


def config(root, paths: dict, name: str, loss: str = "dpo") -> tuple[str, str]:
    dump = os.path.join(str(root), name)
    cfg = write_tiny_config(os.path.join(str(root), f"{name}.toml"), paths, dump)
    with open(cfg) as f:
        text = f.read()
    text = text.replace('datasets = ["tiny=', 'datasets = ["pairs=')
    text = text.replace('train = ["tts:tiny:0.5", "asr:tiny:0.5"]',
                        'train = ["tts_pref:pairs:0.6", "asr_pref:pairs:0.4"]')  # fmt: skip
    text = text.replace('valid = ["asr:tiny"]', 'valid = ["tts_pref:pairs"]')
    text = text.replace("z_loss_weight = 1e-3", f'z_loss_weight = 1e-3\npreference_loss = "{loss}"')
    with open(cfg, "w") as f:
        f.write(text)
    return cfg, dump


def train_rows(dump) -> list[dict]:
    return [r for r in read_metrics(dump) if "train/preference_loss" in r]


@pytest.fixture(scope="module")
def one_rank(pairs):
    root, paths = pairs
    cfg, dump = config(root, paths, "one")
    r = run_train(cfg, *PREF)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return dump, r.stdout + r.stderr


def test_dpo_starts_at_log_2_with_the_reference_of_every_pair(one_rank, pairs):
    dump, out = one_rank
    rows = train_rows(dump)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # step 1: the policy is the reference, so every margin is 0 and the loss log 2 exactly
    assert rows[0]["train/preference_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[0]["train/rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert rows[0]["loss_metrics/global_avg_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[-1]["train/preference_loss"] < rows[0]["train/preference_loss"]  # it learns
    # the pair of two copies of one file is prepared (its tokens are equal) and never trained
    assert sum(r["train/data/pref_identical"] for r in rows) >= 1
    ref = np.load(os.path.join(dump, "preference_reference", "logps.npz"))
    scored = ref["pairs"]
    # every pair scored (9 of the 10 prepared: the two copies of one file are never trained)
    assert scored.shape == (9, 2) and np.isfinite(scored).all() and (scored < 0).all()
    val = [r for r in read_metrics(dump) if any(k.startswith("val/") for k in r)]
    assert val and all(np.isfinite(v) for r in val for k, v in r.items()
                       if k.startswith("val/") and k.endswith("preference_loss"))  # fmt: skip
    # the console shows the pair statistics at every log step, as metrics.jsonl has them
    for r in rows:
        line = next(
            ln for ln in out.splitlines() if f"step: {r['step']:2}  preference_loss: " in ln
        )
        for key, fmt in (("preference_loss", ".4f"), ("rewards/chosen", ".4f"),
                         ("rewards/margins", ".4f"), ("rewards/accuracies", ".3f"),
                         ("logps/chosen", ".2f")):  # fmt: skip
            assert f"{key}: {format(r[f'train/{key}'], fmt)}  " in line, (key, line)
        assert f"pairs: {int(r['train/preference_pairs'])}" in line


def test_two_ranks_train_the_same_steps_as_one(one_rank, pairs):
    root, paths = pairs
    cfg, dump = config(root, paths, "two")
    r = run_train(cfg, *PREF, nproc=2)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    one, two = train_rows(one_rank[0]), train_rows(dump)
    for a, b in zip(one, two, strict=True):
        for key in STATS:
            assert b[key] == pytest.approx(a[key], rel=2e-4, abs=2e-5), (a["step"], key)
    ref1 = np.load(os.path.join(one_rank[0], "preference_reference", "logps.npz"))["pairs"]
    ref2 = np.load(os.path.join(dump, "preference_reference", "logps.npz"))["pairs"]
    np.testing.assert_allclose(ref1, ref2, rtol=1e-5, atol=1e-5)


def test_a_resume_continues_exactly_and_keeps_its_reference(one_rank, pairs):
    root, paths = pairs
    cfg, dump = config(root, paths, "resumed")
    r = run_train(cfg, *PREF, "--training.steps", "2")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    r = run_train(cfg, *PREF)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    full, resumed = train_rows(one_rank[0]), train_rows(dump)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full[2:], resumed[2:], strict=True):
        for key in STATS:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    # the reference is the starting weights': a resume without it cannot rebuild it
    shutil.rmtree(os.path.join(dump, "preference_reference"))
    r = run_train(cfg, *PREF, "--training.steps", "5")
    assert r.returncode != 0
    assert "reference log-probs from its first start, is missing" in r.stdout + r.stderr


def test_simpo_trains_without_a_reference(pairs):
    root, paths = pairs
    cfg, dump = config(root, paths, "simpo", loss="simpo")
    r = run_train(cfg, *PREF, "--training.steps", "2", "--validation.enable", "false")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = train_rows(dump)
    assert len(rows) == 2 and all(math.isfinite(r["train/preference_loss"]) for r in rows)
    assert not os.path.exists(os.path.join(dump, "preference_reference"))


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """DPO on the native backbone (torchtitan's llama3 blocks, which tensor and pipeline
    parallelism split): the pairs, and one process's run."""
    root = tmp_path_factory.mktemp("native")
    paths = tiny_model_assets(root / "assets", family="llama")
    assets = {"root": str(root), "codec": paths["codec"], "tok": paths["tokenizer"],
              "sentences": load_sentences()}  # fmt: skip
    paths["prepared"] = prepare_pairs(assets, str(root / "prepared"))[0]
    cfg, dump = config(root, paths, "one")
    r = run_train(cfg, *PREF, *NATIVE)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return root, paths, dump


def assert_same_steps_as_one_rank(native, name: str, flags: tuple, nproc: int) -> str:
    root, paths, one_dump = native
    cfg, dump = config(root, paths, name)
    r = run_train(cfg, *PREF, *NATIVE, *flags, nproc=nproc)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    one, got = train_rows(one_dump), train_rows(dump)
    assert one[0]["train/preference_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert [r["step"] for r in got] == [r["step"] for r in one] == [1, 2, 3, 4]
    for a, b in zip(one, got, strict=True):
        for key in STATS:
            assert b[key] == pytest.approx(a[key], rel=2e-4, abs=2e-5), (a["step"], key)
    ref1 = np.load(os.path.join(one_dump, "preference_reference", "logps.npz"))["pairs"]
    ref2 = np.load(os.path.join(dump, "preference_reference", "logps.npz"))["pairs"]
    np.testing.assert_allclose(ref1, ref2, rtol=1e-5, atol=1e-5)
    return log


def test_tensor_parallel_trains_the_same_steps_as_one_rank(native):
    """TP=2 equals one process, reference pass included."""
    assert_same_steps_as_one_rank(native, "tp", TP, nproc=2)


@pytest.mark.long  # a second layout beside TP's equivalence (make faults)
def test_a_pipeline_trains_the_same_steps_as_one_rank(native):
    """PP=2 (1F1B, one row per microbatch) equals one process: each microbatch finds its
    pairs from its rows, and the reference pass runs through the schedule."""
    log = assert_same_steps_as_one_rank(native, "pp", PP, nproc=2)
    assert "runs stage" in log  # no silent fallback


def test_lora_dpo_starts_at_its_reference_and_learns(pairs):
    pytest.importorskip("peft")
    root, paths = pairs
    cfg, dump = config(root, paths, "lora")
    lora = ("--model.converters", "lora", "--lora.rank", "4", "--lora.target_modules",
            "q_proj,v_proj", "--optimizer.lr", "3e-2")  # fmt: skip
    r = run_train(cfg, *PREF, *lora, "--validation.enable", "false")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = train_rows(dump)
    assert rows[0]["train/preference_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[-1]["train/preference_loss"] < rows[0]["train/preference_loss"]
