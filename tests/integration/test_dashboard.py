"""The dashboard: the same exact numbers in metrics.jsonl, offline wandb files and TensorBoard."""

import glob
import os

import pytest

from tests.helpers import make_tiny_run_assets, read_metrics, run_train, write_tiny_config

pytestmark = pytest.mark.slow

REQUIRED = (
    [
        "train/loss",
        "train/ce_loss",
        "train/z_loss",
        "train/z_loss_s0",
        "train/z_loss_mm",
        "train/load_balance_loss",
        "train/acc_layer0",
        "lr",
        "grad_norm",
        "throughput(tps)",
        "throughput/audio_seconds_per_second",
        "time_metrics/data_loading(%)",
        "memory/max_reserved(GiB)",
        "tflops",  # (mfu(%): not on a CPU, which has no peak FLOPS: utils/compat.py fix 13)
        "train/data/padding_ratio",
        "train/data/examples",
    ]
    + [f"train/{s}_stream{k}" for s in ("ce", "acc") for k in range(4)]
    + [f"train/codes/stream{k}/pred_usage" for k in range(4)]
    + [f"val/asr_tiny/{key}" for key in ("loss", "ce_loss", "acc_layer0", "acc_stream0")]
)
# ASR validation: the audio streams carry no loss, so they have no mean, in no sink; and no
# MFU on a CPU (no peak FLOPS: utils/compat.py fix 13)
ABSENT = [f"val/asr_tiny/{s}_stream{k}" for s in ("ce", "acc") for k in (1, 2, 3)] + ["mfu(%)"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    assets = make_tiny_run_assets(tmp / "assets")
    dump = tmp / "run"
    cfg = write_tiny_config(tmp / "c.toml", assets, dump)
    r = run_train(
        cfg,
        "--training.steps",
        "4",
        "--metrics.log_freq",
        "2",
        "--metrics.enable_wandb",
        "true",
        "--metrics.enable_tensorboard",
        "true",
        "--speechlm.code_usage_interval",
        "2",
        "--validation.freq",
        "2",
        "--checkpoint.enable",
        "false",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return dump


def merged(rows):
    out = {}
    for row in rows:
        out.setdefault(row.get("step", row.get("_step")), {}).update(row)
    return out


def test_offline_wandb_run_reads_back_with_every_key(run_dir):
    from torchtitan_speechlm.commands.wandb_offline import read_history

    runs = glob.glob(os.path.join(run_dir, "tb", "*", "wandb", "offline-run-*"))
    assert len(runs) == 1, "wandb must default to offline files under the dump folder"
    wb = merged(read_history(runs[0]))
    local = merged(read_metrics(run_dir))
    assert set(wb) == set(local) == {1, 2, 4}
    for key in REQUIRED:
        assert any(key in wb[s] for s in wb), key
    for key in ABSENT:
        assert not any(key in wb[s] or key in local[s] for s in wb), key
    for step in wb:
        for key, value in local[step].items():
            if key != "step":
                assert wb[step][key] == pytest.approx(value, rel=1e-9), (step, key)


def test_tensorboard_events_hold_the_same_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tb,) = glob.glob(os.path.join(run_dir, "tb", "*"))
    acc = EventAccumulator(tb)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for key in REQUIRED:
        assert key in tags, key
    assert not tags & set(ABSENT)
    local = merged(read_metrics(run_dir))
    for event in acc.Scalars("train/ce_loss"):
        assert event.value == pytest.approx(local[event.step]["train/ce_loss"], rel=1e-6)


def test_training_goes_on_when_wandb_cannot_start(tmp_path):
    assets = make_tiny_run_assets(tmp_path / "assets", n_items=12)
    cfg = write_tiny_config(tmp_path / "c.toml", assets, tmp_path / "run")
    os.environ["WANDB_MODE"] = "not-a-mode"
    try:
        r = run_train(
            cfg,
            "--training.steps",
            "2",
            "--metrics.enable_wandb",
            "true",
            "--checkpoint.enable",
            "false",
            "--validation.enable",
            "false",
        )
    finally:
        os.environ.pop("WANDB_MODE")
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert log.count("Failed to create WandB logger") == 1
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]
