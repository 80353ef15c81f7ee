"""One data stream for every parallel layout, end to end (`torchtitan train`, gloo, FSDP2).

On a corpus unlike the demo's (espeak-ng speech of very different lengths, a Kaldi dir with
segments, a Llama backbone), 1 x 4, 2 x 2 and 4 x 1 (processes x gradient accumulation) at the
same global batch must train on the same multiset of samples in every optimizer step (content
hashes logged by the loader) and give the same loss and grad norm (fp32), for both batchings.
A checkpoint written by 2 ranks continues on 1 and on 4 ranks with exactly the samples the
2-rank run used next.
"""

import json
import shutil

import pytest

from tests.data_fixtures import needs_espeak
from tests.helpers import make_varied_kaldi_assets, read_metrics, run_train, write_tiny_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not needs_espeak, reason="espeak-ng binary not installed"),
]

GLOBAL_ROWS, LOCAL_ROWS = 8, 2


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_varied_kaldi_assets(tmp_path_factory.mktemp("varied"))


def step_samples(dump, nproc: int, accum: int) -> list[list[str]]:
    """Per optimizer step: the sorted content hashes of every sample of every rank."""
    logs = []
    for rank in range(nproc):
        with open(dump / "batch_hashes" / f"rank{rank}.jsonl") as f:
            logs.append([json.loads(line)["samples"] for line in f])
    n_steps = len(logs[0]) // accum
    assert all(len(log) == n_steps * accum for log in logs)
    return [
        sorted(h for log in logs for mb in log[s * accum : (s + 1) * accum] for h in mb)
        for s in range(n_steps)
    ]


def train(assets, tmp_path, name, nproc, batching, steps, *extra):
    dump = tmp_path / name
    cfg = write_tiny_config(tmp_path / f"{name}.toml", assets, dump)
    r = run_train(
        cfg,
        "--training.steps",
        str(steps),
        "--training.seq_len",
        "384",
        "--training.local_batch_size",
        str(LOCAL_ROWS),
        "--training.global_batch_size",
        str(GLOBAL_ROWS),
        "--speechlm_data.batching",
        batching,
        "--speechlm_data.log_batch_hashes",
        "true",
        "--validation.enable",
        "false",
        *extra,
        nproc=nproc,
        timeout=400,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = {m["step"]: m for m in read_metrics(dump) if "grad_norm" in m}
    return dump, rows


def assert_same_steps(a: dict, b: dict, steps) -> None:
    for s in steps:
        assert b[s]["loss_metrics/global_avg_loss"] == pytest.approx(
            a[s]["loss_metrics/global_avg_loss"], rel=1e-5
        ), s
        assert b[s]["grad_norm"] == pytest.approx(a[s]["grad_norm"], rel=1e-5), s
        assert b[s]["train/loss_frames"] == a[s]["train/loss_frames"], s


# bucketed: make faults (the packed variant keeps the invariant in make test)
@pytest.mark.parametrize("batching", ["pack", pytest.param("bucket", marks=pytest.mark.long)])
def test_every_layout_trains_on_the_same_samples(assets, tmp_path, batching):
    no_ckpt = ("--checkpoint.enable", "false")
    runs = {}
    for nproc in (1, 2, 4):
        accum = GLOBAL_ROWS // (LOCAL_ROWS * nproc)
        dump, rows = train(assets, tmp_path, f"{batching}{nproc}", nproc, batching, 3, *no_ckpt)
        runs[nproc] = (step_samples(dump, nproc, accum), rows)
    ref_samples, ref_rows = runs[1]
    assert len(ref_samples) == 3 and all(len(s) >= 4 for s in ref_samples)
    for nproc in (2, 4):
        samples, rows = runs[nproc]
        assert samples == ref_samples, f"{nproc} processes trained on other samples"
        assert_same_steps(ref_rows, rows, (1, 2, 3))
    assert (
        ref_rows[3]["loss_metrics/global_avg_loss"] != ref_rows[1]["loss_metrics/global_avg_loss"]
    )


CKPT = (
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "2",
    "--lr_scheduler.total_steps",
    "4",
)


@pytest.fixture(scope="module")
def two_rank_run(assets, tmp_path_factory):
    """4 steps on 2 ranks x accumulation 2, checkpoints at steps 2 and 4."""
    return train(assets, tmp_path_factory.mktemp("two_rank"), "full", 2, "pack", 4, *CKPT)


# 4 ranks: make faults (test_checkpointing continues on 4 ranks in make test)
@pytest.mark.parametrize("new_nproc", [1, pytest.param(4, marks=pytest.mark.long)])
def test_a_two_rank_checkpoint_continues_on_another_degree(
    assets, tmp_path, two_rank_run, new_nproc
):
    full, full_rows = two_rank_run
    expected = step_samples(full, 2, 2)[2:]
    # the same run, stopped after step 2: keep only its step-2 checkpoint
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoint" / "step-4")
    shutil.rmtree(part / "batch_hashes")
    (part / "metrics.jsonl").unlink()
    _, rows = train(assets, tmp_path, "part", new_nproc, "pack", 4, *CKPT)
    assert sorted(rows) == [3, 4]
    assert step_samples(part, new_nproc, 4 // new_nproc) == expected
    assert_same_steps(full_rows, rows, (3, 4))
