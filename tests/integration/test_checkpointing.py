"""Checkpoints across layouts and torchtitan's checkpoint options on CPU: a checkpoint written by
2 FSDP ranks continues on 1 rank and on 4 (HSDP 2x2) ranks, and an HSDP checkpoint on 2 FSDP
ranks, each giving the parameters the uninterrupted run has; async saves with keep_latest_k;
a half-written checkpoint is skipped with a warning naming it."""

import shutil

import pytest
import torch

from tests.helpers import (
    HSDP,
    make_tiny_run_assets,
    params,
    read_metrics,
    run_train,
    write_tiny_config,
)
from torchtitan_speechlm.utils.checkpoint_manifest import verify

pytestmark = pytest.mark.slow
COMMON = (
    "--validation.enable",
    "false",
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.total_steps",
    "4",
    "--checkpoint.interval",
    "1",
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("ckpt_assets"), n_items=32)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """6 steps on 2 FSDP ranks, a checkpoint after every step."""
    root = tmp_path_factory.mktemp("ckpt")
    dump = root / "ref"
    r = run_train(
        write_tiny_config(root / "ref.toml", assets, dump),
        "--training.steps",
        "6",
        *COMMON,
        nproc=2,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return dump


def continue_from(assets, tmp_path, source_dump, step: int, name: str, nproc: int, *flags):
    """A copy of ``source_dump`` cut back to ``step``, continued one step on another layout."""
    dump = tmp_path / name
    shutil.copytree(source_dump, dump)
    for d in (dump / "checkpoint").iterdir():
        if int(d.name.split("-")[1]) > step:
            shutil.rmtree(d)
    (dump / "metrics.jsonl").unlink()
    r = run_train(
        write_tiny_config(tmp_path / f"{name}.toml", assets, dump),
        "--training.steps",
        str(step + 1),
        *COMMON,
        *flags,
        nproc=nproc,
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert f"Training starts at step {step + 1}" in log
    return dump


def assert_same_params(a, b) -> None:
    pa, pb = params(a), params(b)
    assert set(pa) == set(pb) and "head.stream_emb.weight" in pa
    for name in pa:
        torch.testing.assert_close(pb[name], pa[name], atol=2e-6, rtol=1e-5, msg=name)


def test_two_rank_checkpoint_continues_on_one_and_on_four_ranks(assets, reference, tmp_path):
    one = continue_from(assets, tmp_path, reference, 2, "one", 1)
    assert_same_params(reference / "checkpoint" / "step-3", one / "checkpoint" / "step-3")
    four = continue_from(assets, tmp_path, reference, 2, "four", 4, *HSDP)
    assert_same_params(reference / "checkpoint" / "step-3", four / "checkpoint" / "step-3")
    # that checkpoint was written by 4 HSDP ranks: it continues on 2 FSDP ranks
    back = continue_from(assets, tmp_path, four, 3, "back", 2)
    assert_same_params(reference / "checkpoint" / "step-4", back / "checkpoint" / "step-4")
    ref_loss = {m["step"]: m["loss_metrics/global_avg_loss"] for m in read_metrics(reference)}
    assert read_metrics(back)[0]["loss_metrics/global_avg_loss"] == pytest.approx(
        ref_loss[4], rel=1e-5
    )


def test_async_saves_keep_latest_k_and_half_written_checkpoints(assets, reference, tmp_path):
    dump = tmp_path / "async"
    cfg = write_tiny_config(tmp_path / "async.toml", assets, dump)
    flags = ("--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "2")
    r = run_train(cfg, "--training.steps", "6", *COMMON, *flags, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    # torchtitan purges when a save starts, among the saves already complete (an async save
    # may still be in flight), and not at the last step: k=2 plus up to 2 more remain
    kept = sorted(d.name for d in (dump / "checkpoint").iterdir())
    assert {"step-5", "step-6"} <= set(kept) and "step-1" not in kept and len(kept) <= 4, kept
    for step in ("step-5", "step-6"):  # step 5 was saved asynchronously
        assert_same_params(reference / "checkpoint" / step, dump / "checkpoint" / step)
        # the async save's manifest is written when its future completes: sizes and CRC-32Cs
        problem = verify(str(dump / "checkpoint" / step))
        assert problem == "", problem
    # an interrupted save: step-7 without .metadata; the rerun resumes from step-6, says so
    half = dump / "checkpoint" / "step-7"
    shutil.copytree(dump / "checkpoint" / "step-6", half)
    (half / ".metadata").unlink()
    r = run_train(cfg, "--training.steps", "7", *COMMON, *flags, nproc=2)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert f"{half} has no .metadata" in log and "Training starts at step 7" in log
