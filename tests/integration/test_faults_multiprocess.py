"""The fault suite's slow half (`make faults`, also run by CI): real `torchtitan train` runs on
2 gloo ranks, with faults injected at a chosen step through SPEECHLM_FAULTS
(tests/fault_injection.py, a plugin the runs import through torchtitan's
experimental.custom_import): processes really killed or stopped mid-save or
mid-collective, NaN/Inf numbers, a full disk. After each, what survives is compared with an
uninterrupted run: the losses of every step bit for bit, and the checkpoints' tensors.
docs/errors.md lists each fault with the test that injects it.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import pytest
import torch

from tests.fault_injection import RUN_ARGS
from tests.helpers import make_tiny_run_assets, read_metrics, run_train, write_tiny_config

ROOT = Path(__file__).resolve().parents[2]  # on PYTHONPATH: the ranks import the plugin

pytestmark = [pytest.mark.slow, pytest.mark.faults]
COMMON = (
    "--validation.enable",
    "false",
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.total_steps",
    "6",
    "--checkpoint.interval",
    "1",
    "--training.steps",
    "5",
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("fault_assets"), n_items=32)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The uninterrupted run: 5 steps on 2 FSDP ranks, a checkpoint after every step."""
    root = tmp_path_factory.mktemp("fault_ref")
    r = run_train(write_tiny_config(root / "ref.toml", assets, root / "ref"), *COMMON, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return root / "ref"


def losses(dump) -> dict[int, float]:
    """Each step's logged loss; a step trained twice (before a crash, after the rerun) must
    have logged the same value both times."""
    out: dict[int, float] = {}
    for row in read_metrics(dump):
        step, loss = row["step"], row["loss_metrics/global_avg_loss"]
        before = out.get(step, loss)
        same = before == loss or (math.isnan(before) and math.isnan(loss))
        assert same, f"step {step} trained twice with different losses"
        out[step] = loss
    return out


def tensors(step_dir) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer state), loaded back."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchtitan_speechlm.commands.export import load_checkpoint_state

    meta = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    keys = {k for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}
    return dict(_flat(load_checkpoint_state(str(step_dir), keys)))


def _flat(value, prefix=""):
    """(dotted name, tensor) pairs of DCP's nested optimizer state."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], value


def assert_same_tensors(a, b, *, model_only: bool = False) -> None:
    ta, tb = tensors(a), tensors(b)
    if model_only:
        ta = {k: v for k, v in ta.items() if not k.startswith(("optimizer", "lr_scheduler"))}
        tb = {k: v for k, v in tb.items() if not k.startswith(("optimizer", "lr_scheduler"))}
    assert set(ta) == set(tb) and len(ta) > 10
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def run_with_faults(monkeypatch, cfg, faults: str, *extra, nproc=2, timeout=300):
    """`torchtitan train` with the fault plugin as its custom_import and ``faults`` armed."""
    monkeypatch.setenv("SPEECHLM_FAULTS", faults)
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), path) if p))
    try:
        return run_train(cfg, *COMMON, *RUN_ARGS, *extra, nproc=nproc, timeout=timeout)
    finally:
        monkeypatch.delenv("SPEECHLM_FAULTS")


def complete_steps(dump) -> list[int]:
    from torchtitan_speechlm.utils.checkpoint_folders import complete_checkpoints

    return complete_checkpoints(str(dump / "checkpoint"))


# ---- 1. kill during checkpoint save -------------------------------------------------------------
@pytest.mark.parametrize("rank", ["both", "1"])
def test_kill_during_save_loses_only_that_save_and_resumes_bit_exactly(
    assets, reference, tmp_path, monkeypatch, rank
):
    """Proves: SIGKILL of both ranks (or rank 1 only) halfway through writing checkpoint
    step-4, with keep_latest_k = 2: the partial step-4 is never loaded, step-3 (the newest
    complete one) was not purged and holds the reference's tensors, and a rerun resumes from it
    and reproduces the uninterrupted run's losses and final checkpoint bit for bit."""
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    fault = "kill_in_save@4" if rank == "both" else f"kill_in_save@4:{rank}"
    keep = ("--checkpoint.keep_latest_k", "2")
    r = run_with_faults(monkeypatch, cfg, fault, *keep)
    assert r.returncode != 0
    assert "was killed by SIGKILL" in r.stderr, r.stderr[-2000:]
    # the partial step-4 is left (both killed), or removed by rank 0, which saw its peer die
    # during the save (one killed) and says so unless the launcher ended it first; either way
    # it is not a checkpoint, and k = 2 complete ones are kept
    partial = dump / "checkpoint" / "step-4"
    if "CheckpointSaveError" in r.stderr:
        assert "step-4 failed on rank(s)" in r.stderr and not partial.exists()
    assert "looking for the silent peer" not in r.stderr  # the save's error is not rewritten
    assert complete_steps(dump) == [2, 3]
    assert_same_tensors(reference / "checkpoint" / "step-3", dump / "checkpoint" / "step-3")

    left = partial.is_dir()
    r = run_train(cfg, *COMMON, *keep, nproc=2)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert ("step-4 has no .metadata" in log) == left and "Training starts at step 4" in log
    assert f"Loading the checkpoint from {dump}/checkpoint/step-3" in log
    assert losses(dump) == losses(reference)
    assert_same_tensors(reference / "checkpoint" / "step-5", dump / "checkpoint" / "step-5")
    assert complete_steps(dump) == [3, 4, 5]  # torchtitan does not purge at the last step


# ---- 2. non-finite numbers ----------------------------------------------------------------------
def test_nan_loss_is_skipped_before_the_update_and_named(assets, reference, tmp_path, monkeypatch):
    """Proves: a NaN loss at step 3 (skip policy) leaves the weights and optimizer state of
    step 2 untouched (checkpoint step-3 == the reference's step-2 in every model and optimizer
    tensor), is logged with the sample ids of the whole batch (both ranks) and counted, and
    training goes on; steps before it match the reference bit for bit."""
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    r = run_with_faults(monkeypatch, cfg, "nan_loss@3", "--speechlm_data.log_batch_hashes", "true")
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "step 3: non-finite loss" in log and "optimizer step skipped" in log
    got, ref = losses(dump), losses(reference)
    assert got[1] == ref[1] and got[2] == ref[2] and got[3] != got[3]  # NaN
    assert all(got[s] == got[s] for s in (4, 5))
    assert_same_tensors(reference / "checkpoint" / "step-2", dump / "checkpoint" / "step-3")
    (row,) = [json.loads(x) for x in (dump / "anomalies.jsonl").read_text().splitlines()]
    assert row["step"] == 3 and row["kind"] == "nonfinite_loss"
    # the ids name exactly the samples both ranks trained at step 3 (2 micro-batches each)
    per_rank = []
    for rank in (0, 1):
        lines = (dump / "batch_hashes" / f"rank{rank}.jsonl").read_text().splitlines()
        per_rank += [len(json.loads(x)["samples"]) for x in lines[4:6]]
    assert len(row["samples"]) == sum(per_rank)
    assert all(s.startswith(("tts:tiny:u", "asr:tiny:u")) for s in row["samples"])
    metrics = {m["step"]: m for m in read_metrics(dump)}
    assert metrics[2]["reliability/skipped_steps"] == 0
    assert metrics[5]["reliability/skipped_steps"] == 1


def test_inf_gradient_on_one_rank_stops_under_the_stop_policy(assets, tmp_path, monkeypatch):
    """Proves: an Inf in one gradient shard of rank 1 at step 2 makes *both* ranks stop
    before the update (policy stop): an error naming the step and the samples, no traceback,
    and the last checkpoint (step-1) intact and loadable."""
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    r = run_with_faults(monkeypatch, cfg, "inf_grad@2:1", "--speechlm_faults.nonfinite", "stop")
    assert r.returncode == 1
    assert "rank 0: NonFiniteError: step 2: non-finite gradient" in r.stderr
    assert re.search(r"Samples of the batch: (tts|asr):tiny:u\d+", r.stderr)
    assert "Traceback" not in r.stderr
    assert complete_steps(dump) == [1]
    assert len(tensors(dump / "checkpoint" / "step-1")) > 10


def test_loss_spike_is_logged_with_its_samples(assets, tmp_path, monkeypatch):
    """Proves: a loss 50x the usual at step 7 (one process) is logged as a spike with its
    sample ids and the running median; the run goes on."""
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    r = run_with_faults(
        monkeypatch, cfg, "spike_loss@7", "--training.steps", "7", "--checkpoint.enable",
        "false", "--training.local_batch_size", "4", nproc=1,
    )  # fmt: skip
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "step 7: loss spike" in log
    (row,) = [json.loads(x) for x in (dump / "anomalies.jsonl").read_text().splitlines()]
    assert row["kind"] == "loss_spike" and row["step"] == 7 and row["samples"]
    assert row["loss"] > 5 * row["median"]


# ---- 3. full disk -------------------------------------------------------------------------------
def test_full_disk_during_a_save_stops_cleanly_and_loses_nothing(
    assets, reference, tmp_path, monkeypatch
):
    """Proves: ENOSPC while writing checkpoint step-3 stops the run with an error naming the
    full disk and the intact step-2, removes the partial folder, and a rerun resumes from
    step-2 and reproduces the uninterrupted run bit for bit."""
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    r = run_with_faults(monkeypatch, cfg, "enospc_in_save@3:1")
    assert r.returncode == 1
    assert "CheckpointSaveError: saving checkpoint" in r.stderr, r.stderr[-3000:]
    assert "the disk is full (ENOSPC" in r.stderr and "step-2 is intact" in r.stderr
    assert "Traceback" not in r.stderr
    assert complete_steps(dump) == [1, 2] and not (dump / "checkpoint" / "step-3").exists()
    r = run_train(cfg, *COMMON, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(dump) == losses(reference)
    assert_same_tensors(reference / "checkpoint" / "step-5", dump / "checkpoint" / "step-5")


# ---- 4. hung or dead rank -----------------------------------------------------------------------
def test_a_stopped_rank_makes_the_other_exit_within_the_timeout(
    assets, reference, tmp_path, monkeypatch
):
    """Proves: rank 1 stopped with SIGSTOP at step 3: rank 0 leaves its collective after
    comm.train_timeout_seconds with a message naming rank 1 and the collective, instead of
    waiting for ever; the checkpoint of step 2 is intact and a rerun continues bit-exactly."""
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    start = time.monotonic()
    r = run_with_faults(monkeypatch, cfg, "sigstop@3:1", "--comm.train_timeout_seconds", "5",
                        timeout=240)  # fmt: skip
    elapsed = time.monotonic() - start
    assert r.returncode == 1
    assert "rank 0: RuntimeError: collective all_reduce called from allow_update" in r.stderr, (
        r.stderr[-3000:]
    )
    assert "rank(s) 1 stopped responding" in r.stderr and "Timed out" in r.stderr
    assert elapsed < 150  # start-up + 3 steps + 5 s timeout + torchrun's 30 s kill grace
    assert complete_steps(dump) == [1, 2]
    assert_rerun_is_bit_exact(cfg, dump, reference)


def assert_rerun_is_bit_exact(cfg, dump, reference) -> None:
    r = run_train(cfg, *COMMON, nproc=2)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "Training starts at step 3" in log
    assert losses(dump) == losses(reference)
    assert_same_tensors(reference / "checkpoint" / "step-5", dump / "checkpoint" / "step-5")


def test_a_dead_rank_ends_the_run_naming_it(assets, reference, tmp_path, monkeypatch):
    """Proves: rank 1 killed (SIGKILL) at step 3 just before a collective ends the whole run
    promptly, the launcher naming rank 1 and the signal; checkpoint step-2 is intact and a
    rerun continues bit-exactly."""
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    start = time.monotonic()
    r = run_with_faults(monkeypatch, cfg, "die@3:1", "--comm.train_timeout_seconds", "5",
                        timeout=240)  # fmt: skip
    assert r.returncode == 1 and time.monotonic() - start < 120
    assert "rank 1 was killed by SIGKILL" in r.stderr, r.stderr[-3000:]
    assert complete_steps(dump) == [1, 2]
    assert_rerun_is_bit_exact(cfg, dump, reference)


# ---- 5 and 6: inputs and config seen by `torchtitan train` --------------------------------------
def test_bad_inputs_and_layouts_stop_before_any_rank_starts(assets, tmp_path):
    """Proves: through `torchtitan train`, a shard modified after preparation, a missing
    shard, impossible degrees, an indivisible batch, conflicting keys, an unwritable dump
    folder and a dump folder of another model each stop with exit status 2 before any rank
    starts, naming the file or key and the fix, without a traceback."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(assets["prepared"], data)
    local = dict(assets, prepared=str(data))
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", local, dump)

    def refused(*extra, nproc=1, expect):
        r = run_train(cfg, *extra, nproc=nproc, timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        assert expect in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and "[rank" not in r.stderr
        return r

    codes = data / "shards" / "00000" / "audio_codes.npy"
    original = codes.read_bytes()
    changed = bytearray(original)
    changed[-1] ^= 1
    codes.write_bytes(bytes(changed))
    refused(expect="audio_codes.npy was modified after metadata.json was written")
    codes.write_bytes(original[:-10])
    refused(expect="audio_codes.npy has")
    codes.write_bytes(original)
    shutil.move(data / "shards" / "00000", tmp_path / "moved")
    refused(expect="shards/00000 is missing")
    shutil.move(tmp_path / "moved", data / "shards" / "00000")

    refused("--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2", nproc=2,
            expect="= 4 ranks, but the job has 2")  # fmt: skip
    refused("--training.global_batch_size", "6", nproc=2,
            expect="training.global_batch_size = 6 is not a multiple")  # fmt: skip
    refused("--checkpoint.keep_latest_k", "1", expect="checkpoint.keep_latest_k = 1")
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    refused("--job.dump_folder", str(blocker / "run"), expect="is a file")
    assert not dump.exists()

    # a dump folder whose checkpoint is another model's (a wider backbone)
    r = run_train(cfg, "--training.steps", "1", "--validation.enable", "false", nproc=1)
    assert r.returncode == 0, r.stderr[-2000:]
    other = wider_backbone(assets, tmp_path / "wider")
    refused("--training.steps", "2", "--model.hf_assets_path", other,
            expect="was made with another model: backbone_config differs")  # fmt: skip
    (dump / "speechlm_run.json").unlink()  # no record: the checkpoint itself is compared
    refused("--training.steps", "2", "--model.hf_assets_path", other,
            expect="was written by another model: tok_embeddings.weight has shape")  # fmt: skip


def wider_backbone(assets, path) -> str:
    from transformers import AutoTokenizer

    from tests.helpers import TINY_BACKBONE
    from torchtitan_speechlm.demo.assets import build_backbone

    vocab = len(AutoTokenizer.from_pretrained(assets["tokenizer"]))
    build_backbone(str(path), family="qwen3", vocab_size=vocab, seed=1,
                   tie_word_embeddings=False, **dict(TINY_BACKBONE, hidden_size=48))  # fmt: skip
    return str(path)
