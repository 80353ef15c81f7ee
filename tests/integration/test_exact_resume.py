"""Stop at step k, resume: the same micro-batches in the same order as an uninterrupted run,
with gradient accumulation, loader workers, and a changed training.steps (batch content hashes
logged by the loader as the trainer consumes them)."""

import json

import pytest

from tests.helpers import make_tiny_run_assets, run_train, write_tiny_config

pytestmark = pytest.mark.slow


def hashes(dump, rank):
    with open(dump / "batch_hashes" / f"rank{rank}.jsonl") as f:
        return [json.loads(line)["hash"] for line in f]


COMMON = (
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "8",
    "--training.dataloader.num_workers",
    "2",
    "--speechlm_data.log_batch_hashes",
    "true",
    "--validation.enable",
    "false",
    "--checkpoint.interval",
    "2",
    "--lr_scheduler.total_steps",
    "6",
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("assets"))


def test_stop_and_resume_replays_the_uninterrupted_stream(assets, tmp_path):
    full = tmp_path / "full"
    cfg = write_tiny_config(tmp_path / "full.toml", assets, full)
    r = run_train(cfg, "--training.steps", "5", *COMMON, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]

    part = tmp_path / "part"
    cfg = write_tiny_config(tmp_path / "part.toml", assets, part)
    r = run_train(cfg, "--training.steps", "2", *COMMON, nproc=2)  # stops after step 2
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(cfg, "--training.steps", "5", *COMMON, nproc=2)  # resumes at step 3
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Training starts at step 3" in r.stdout + r.stderr
    for rank in (0, 1):
        expected = hashes(full, rank)
        assert len(expected) == 5 * 2  # 5 steps x 2 micro-batches per rank
        assert hashes(part, rank) == expected, f"rank {rank} saw other batches after resume"
    losses = {}
    for name in ("full", "part"):
        with open(tmp_path / name / "metrics.jsonl") as f:
            losses[name] = {m["step"]: m["train/loss"] for m in map(json.loads, f)}
    assert losses["part"][5] == pytest.approx(losses["full"][5], abs=1e-5)


def test_resume_on_one_rank_from_a_two_rank_checkpoint(assets, tmp_path):
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    r = run_train(cfg, "--training.steps", "2", "--validation.enable", "false", nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(
        cfg,
        "--training.steps",
        "3",
        "--validation.enable",
        "false",
        "--training.local_batch_size",
        "4",
        nproc=1,
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "saved with 2 data-parallel ranks on 1 ranks" in log
    assert "Training starts at step 3" in log
