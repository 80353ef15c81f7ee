"""The fault suite's fast half (seconds each, in `make test`); the multi-process kills, hangs and
resumes are in tests/integration/test_faults_multiprocess.py (`make faults`). docs/errors.md lists every fault tried here
with the test that tries it."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests import fault_injection
from tests.data_fixtures import build_assets
from tests.helpers import make_step_dirs
from torchtitan_speechlm.components.nonfinite import GuardSettings, NonFiniteError, StepGuard
from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.format import AUDIO_CODES, ITEMS, CorruptDatasetError
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.prepare.pipeline import prepare_dataset


# ---- 1. checkpoints ---------------------------------------------------------------------------
def _purged(purge, folder, k: int) -> list[str]:
    import queue

    fake = SimpleNamespace(
        keep_latest_k=k, folder=str(folder), purge_queue=queue.Queue(),
        enable_ft_dataloader_checkpoints=False, ft_manager=None, purge_thread=object(),
    )  # fmt: skip
    purge(fake)
    out = []
    while not fake.purge_queue.empty():
        out.append(os.path.basename(fake.purge_queue.get()))
    return sorted(out)


def test_keep_latest_k_never_deletes_the_last_complete_checkpoint(tmp_path, monkeypatch):
    """Proves: purging counts complete checkpoints only; a killed save (step-3, no .metadata)
    and an async save in flight (step-4) never push the newest complete one (step-2) out,
    while torchtitan's own purge deletes it."""
    from torchtitan.components.checkpoint import CheckpointManager

    import torchtitan_speechlm.utils.compat as compat  # noqa: F401  (fix 8 installed on import)

    folder = tmp_path / "checkpoint"
    make_step_dirs(folder, complete=[1, 2], partial=[3, 4])
    ours = CheckpointManager._purge_stale_checkpoints
    assert _purged(ours, folder, k=2) == []
    shutil.rmtree(folder)
    make_step_dirs(folder, complete=[1, 2, 5, 6], partial=[3, 7])
    # keeps the 2 newest complete (5, 6) and the in-flight 7; the superseded partial 3 goes
    assert _purged(ours, folder, k=2) == ["step-1", "step-2", "step-3"]

    # upstream keeps the k newest folders whatever they hold: step-2 would be deleted
    # (torchtitan 0.2.2's code, reproduced through the original function object)
    import torch.distributed as dist

    upstream = _upstream_purge()
    shutil.rmtree(folder)
    make_step_dirs(folder, complete=[1, 2], partial=[3, 4])
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    assert "step-2" in _purged(upstream, folder, k=2)


def _upstream_purge():
    import importlib.util

    import torchtitan.components.checkpoint as ck

    spec = importlib.util.spec_from_file_location("_tt_checkpoint_pristine", ck.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CheckpointManager._purge_stale_checkpoints


@pytest.fixture
def save_faults(monkeypatch):
    """Faults armed for this test only (the hooks are removed afterwards)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    monkeypatch.setattr(FileSystem, "create_stream", FileSystem.create_stream)
    monkeypatch.delattr(FileSystem, "_speechlm_faults", raising=False)
    monkeypatch.setattr(fault_injection, "_FAULTS", [])
    for method in ("note_loss", "allow_update"):
        monkeypatch.setattr(StepGuard, method, getattr(StepGuard, method))
    monkeypatch.delattr(StepGuard, "_speechlm_faults", raising=False)
    yield fault_injection.install


def test_a_save_that_hits_a_full_disk_keeps_the_previous_checkpoint(tmp_path, save_faults):
    """Proves: ENOSPC halfway through a save -> CheckpointSaveError naming the disk, the
    folder and the intact checkpoint; the partial folder is gone; the previous one loads."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpoint import AsyncMode, CheckpointManager

    import torchtitan_speechlm.utils.compat as compat

    folder = tmp_path / "checkpoint"
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    CheckpointManager.dcp_save(None, state, str(folder / "step-1"), AsyncMode.DISABLED)
    save_faults("enospc_in_save@2")
    state2 = {"w": torch.zeros(1000)}
    with pytest.raises(compat.CheckpointSaveError) as e:
        CheckpointManager.dcp_save(None, state2, str(folder / "step-2"), AsyncMode.DISABLED)
    msg = str(e.value)
    assert "disk is full (ENOSPC" in msg and f"{folder}/step-1 is intact" in msg, msg
    assert "step-2" in msg and not (folder / "step-2").exists()
    back = {"w": torch.empty(1000)}
    dcp.load(back, checkpoint_id=str(folder / "step-1"))
    assert torch.equal(back["w"], state["w"])


def test_a_resave_removes_the_old_index_before_writing(tmp_path, save_faults):
    """Proves: saving into a folder that holds a complete checkpoint first removes its
    .metadata, so a save killed mid-write there leaves a folder that is never loaded (not an
    old index over half-new data)."""
    from torchtitan.components.checkpoint import AsyncMode, CheckpointManager

    from torchtitan_speechlm.utils.checkpoint_folders import complete_checkpoints

    folder = tmp_path / "checkpoint"
    CheckpointManager.dcp_save(
        None, {"w": torch.ones(10)}, str(folder / "step-3"), AsyncMode.DISABLED
    )
    assert complete_checkpoints(str(folder)) == [3]
    save_faults("enospc_in_save@3")
    with pytest.raises(Exception, match="ENOSPC"):
        CheckpointManager.dcp_save(
            None, {"w": torch.zeros(10)}, str(folder / "step-3"), AsyncMode.DISABLED
        )
    assert complete_checkpoints(str(folder)) == []


# ---- 2. non-finite numbers ----------------------------------------------------------------------
def _guard(tmp_path, **faults) -> StepGuard:
    cfg = SimpleNamespace(
        speechlm_faults=SimpleNamespace(
            nonfinite=faults.get("nonfinite", "skip"),
            max_consecutive_skips=faults.get("max_consecutive_skips", 3),
            loss_spike_factor=faults.get("loss_spike_factor", 3.0),
            loss_spike_window=faults.get("loss_spike_window", 20),
        ),
        job=SimpleNamespace(dump_folder=str(tmp_path)),
    )
    return StepGuard(GuardSettings.from_config(cfg.speechlm_faults), cfg.job.dump_folder)


def _step(g: StepGuard, loss: float, grad: float = 1.0, ids=("d:a", "d:b")) -> bool:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), grad)
    g.note_micro_batch(list(ids))
    g.note_loss(torch.tensor(loss * 4), torch.tensor([0, 0, 0, -100, 0]))
    return g.allow_update([p])


def _anomalies(tmp_path) -> list[dict]:
    path = tmp_path / "anomalies.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_nonfinite_loss_or_gradient_skips_the_update_and_names_the_samples(tmp_path):
    """Proves: a NaN loss and an Inf gradient each block the optimizer step, are counted, and
    are recorded with the step and the batch's sample ids; finite steps go through."""
    g = _guard(tmp_path)
    assert _step(g, 2.0)
    assert not _step(g, math.nan, ids=("d:x1", "d:x2"))
    assert not _step(g, 2.0, grad=math.inf, ids=("d:y",))
    assert _step(g, 2.0)
    assert g.skipped == 2 and g.consecutive == 0 and g.metrics()["reliability/skipped_steps"] == 2
    rows = _anomalies(tmp_path)
    assert [(r["step"], r["kind"], r["samples"]) for r in rows] == [
        (2, "nonfinite_loss", ["d:x1", "d:x2"]),
        (3, "nonfinite_gradient", ["d:y"]),
    ]


def test_nonfinite_stop_policy_and_too_many_skips_stop_naming_step_and_samples(tmp_path):
    """Proves: `stop` raises at the first non-finite step naming the step and samples; `skip`
    stops after max_consecutive_skips in a row."""
    g = _guard(tmp_path, nonfinite="stop")
    assert _step(g, 1.0)
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite loss.*d:bad"):
        _step(g, math.inf, ids=("d:bad",))
    g = _guard(tmp_path, max_consecutive_skips=2)
    assert not _step(g, math.nan)
    with pytest.raises(NonFiniteError, match=r"step 2: .*2 non-finite steps in a row"):
        _step(g, math.nan)


def test_loss_spikes_over_k_times_the_running_median_are_logged_with_sample_ids(tmp_path):
    """Proves: a finite loss above loss_spike_factor x the running median is recorded (and
    trained); smaller ones are not."""
    g = _guard(tmp_path, loss_spike_factor=3.0)
    for loss in (2.0, 1.9, 2.1, 1.8, 2.0, 5.5):  # 5.5 < 3 x 2.0
        assert _step(g, loss)
    assert _step(g, 7.0, ids=("d:spiky",))
    rows = _anomalies(tmp_path)
    assert [(r["step"], r["kind"], r["samples"]) for r in rows] == [(7, "loss_spike", ["d:spiky"])]
    assert rows[0]["median"] == pytest.approx(2.0) and g.spikes == 1


# ---- 5. corrupt inputs --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults_data")
    a = build_assets(root)
    out = os.path.join(str(root), "ds")
    prepare_dataset(a["manifest"], a["codec"], a["tok"], out, progress=False, shard_size=2)
    return out


def test_a_shard_truncated_modified_or_missing_is_refused_naming_it(prepared, tmp_path):
    """Proves: metadata.json records each shard file's size and sha256; a truncated file, a
    same-size modification (verify_shards = full) and a missing file or shard are refused with
    an error naming the shard file."""
    ds = tmp_path / "ds"
    shutil.copytree(prepared, ds)
    meta = json.loads((ds / "metadata.json").read_text())
    assert set(meta["shards"][1]["files"][AUDIO_CODES]) == {"bytes", "sha256"}
    assert len(PreparedDataset(str(ds), verify="full")) == 6
    codes = ds / "shards" / "00001" / AUDIO_CODES
    data = codes.read_bytes()
    codes.write_bytes(data[:-16])
    with pytest.raises(
        CorruptDatasetError, match=r"shards/00001/audio_codes\.npy has \d+ bytes.*truncated"
    ):
        PreparedDataset(str(ds), verify="size")
    flipped = bytearray(data)
    flipped[-1] ^= 0x01  # one code changed, same size: still a valid .npy
    codes.write_bytes(bytes(flipped))
    assert len(PreparedDataset(str(ds), verify="size")) == 6  # sizes cannot see it
    with pytest.raises(
        CorruptDatasetError,
        match=r"shards/00001/audio_codes\.npy was modified after metadata\.json",
    ):
        PreparedDataset(str(ds), verify="full")
    codes.write_bytes(data)
    (ds / "shards" / "00002" / ITEMS).unlink()
    with pytest.raises(CorruptDatasetError, match=r"shards/00002/items\.jsonl is missing"):
        PreparedDataset(str(ds), verify="full")
    shutil.rmtree(ds / "shards" / "00002")
    with pytest.raises(CorruptDatasetError, match=r"shard .*shards/00002 is missing"):
        PreparedDataset(str(ds))


def test_a_rank_ends_on_a_user_fault_with_one_line_and_no_traceback(tmp_path):
    """Proves: inside a rank, a user fault (here a corrupt shard) ends the process with status
    1 and one line naming the rank and the file, not a traceback; a bug keeps its traceback."""
    code = (
        "from torchtitan_speechlm.trainer.faults import exit_on_user_fault\n"
        "from torchtitan_speechlm.data.format import CorruptDatasetError\n"
        "with exit_on_user_fault():\n"
        f"    raise CorruptDatasetError({str(tmp_path / 'shards/00001/audio_codes.npy')!r} + ' is missing')\n"
    )
    env = dict(os.environ, RANK="3")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 1
    assert "rank 3: CorruptDatasetError:" in r.stderr and "audio_codes.npy is missing" in r.stderr
    assert "Traceback" not in r.stderr
    bug = code.replace("CorruptDatasetError(", "KeyError(")
    r = subprocess.run([sys.executable, "-c", bug], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "Traceback" in r.stderr


def test_a_save_broken_by_a_dead_peer_keeps_its_own_words():
    """Proves: a checkpoint save that a dead peer broke ends the rank as CheckpointSaveError
    (which names the checkpoint and the intact one) and is not rewritten into a collective
    failure, although its words name the backend's error; a bare backend error still is."""
    from torchtitan_speechlm.trainer.faults import is_unexplained_collective_failure
    from torchtitan_speechlm.utils.compat import CheckpointSaveError

    backend = RuntimeError("[gloo] Connection reset by peer")
    save = CheckpointSaveError(
        "saving checkpoint run/checkpoint/step-4 failed on rank(s) [1]: a peer rank died or "
        f"hung during the save (RuntimeError: {backend})"
    )
    assert is_unexplained_collective_failure(backend)
    assert not is_unexplained_collective_failure(save)
    assert not is_unexplained_collective_failure(KeyError("gloo"))


# ---- 4. hung ranks ------------------------------------------------------------------------------
def test_heartbeats_name_the_rank_that_stopped(monkeypatch):
    """Proves: the ranks whose heartbeat counter stops moving are the ones named."""
    import threading
    import time

    import torch.distributed as dist

    from torchtitan_speechlm.components import heartbeat as hb

    store = dist.HashStore()
    h = hb.Heartbeat()
    h.store, h.rank, h.world = store, 0, 3
    stop = threading.Event()

    def beat(rank):
        while not stop.is_set():
            store.add(hb.KEY.format(rank=rank), 1)
            time.sleep(hb.PERIOD / 2)

    alive = threading.Thread(target=beat, args=(1,), daemon=True)
    alive.start()
    store.add(hb.KEY.format(rank=2), 5)  # rank 2 beat once, then stopped
    try:
        assert h.silent_ranks() == [2]
    finally:
        stop.set()


# ---- 6. config and environment ------------------------------------------------------------------
def _layout_cfg(world_replicate=1, shard=-1, tp=1, pp=1, cp=1, ep=1, local=2, global_=0, **ckpt):
    return SimpleNamespace(
        parallelism=SimpleNamespace(
            data_parallel_replicate_degree=world_replicate, data_parallel_shard_degree=shard,
            tensor_parallel_degree=tp, pipeline_parallel_degree=pp, context_parallel_degree=cp,
            expert_parallel_degree=ep,
        ),
        training=SimpleNamespace(
            local_batch_size=local, global_batch_size=global_, steps=10, dtype="float32",
            mixed_precision_param="bfloat16",
        ),
        checkpoint=SimpleNamespace(
            keep_latest_k=ckpt.get("k", 0), last_save_in_hf=ckpt.get("hf", False),
            last_save_model_only=ckpt.get("model_only", False),
            initial_load_in_hf=ckpt.get("load_hf", False),
            initial_load_model_only=ckpt.get("load_model_only", True), enable=True, interval=5,
        ),
    )  # fmt: skip


def test_impossible_layouts_and_batches_are_refused_naming_key_and_fix():
    """Proves: degrees that do not fit the world size and a global batch that does not split
    into local x dp micro-batches are refused with the keys and a fix."""
    from torchtitan_speechlm.trainer.preflight import check_conflicts, check_parallel_layout

    check_parallel_layout(_layout_cfg(), 4)
    check_parallel_layout(_layout_cfg(world_replicate=2, shard=2), 4)
    with pytest.raises(
        ConfigError,
        match=r"data_parallel_replicate_degree \(2\) x data_parallel_shard_degree \(2\) = 4 ranks, but the job has 2.*-1",
    ):
        check_parallel_layout(_layout_cfg(world_replicate=2, shard=2), 2)
    with pytest.raises(
        ConfigError, match=r"tensor_parallel_degree \(3\).*does not divide the job's 4 ranks"
    ):
        check_parallel_layout(_layout_cfg(tp=3), 4)
    check_parallel_layout(_layout_cfg(local=2, global_=8), 2)
    check_parallel_layout(_layout_cfg(ep=2), 4)  # EP borrows 2 of the 4 data-parallel ranks
    with pytest.raises(ConfigError, match=r"expert_parallel_degree = 4 must divide .*\(2 x 1\)"):
        check_parallel_layout(_layout_cfg(ep=4), 2)
    with pytest.raises(
        ConfigError,
        match=r"training.global_batch_size = 6 is not a multiple of training.local_batch_size \(2\) x the data-parallel degree \(2\) = 4: .*e.g. 4 or 8",
    ):
        check_parallel_layout(_layout_cfg(local=2, global_=6), 2)
    with pytest.raises(ConfigError, match="keep_latest_k = 1"):
        check_conflicts(_layout_cfg(k=1))
    with pytest.raises(
        ConfigError, match="last_save_in_hf = true needs checkpoint.last_save_model_only"
    ):
        check_conflicts(_layout_cfg(hf=True))
    check_conflicts(_layout_cfg(hf=True, model_only=True))
    with pytest.raises(ConfigError, match="initial_load_in_hf = true needs"):
        check_conflicts(_layout_cfg(load_hf=True, load_model_only=False))


def test_unwritable_dump_folder_is_refused_and_probing_leaves_nothing(tmp_path):
    """Proves: a dump folder that cannot be created or written is refused naming it; a
    writable one is probed without leaving folders behind."""
    from torchtitan_speechlm.trainer.preflight import check_dump_folder

    def cfg(dump):
        return SimpleNamespace(
            job=SimpleNamespace(dump_folder=str(dump)),
            checkpoint=SimpleNamespace(enable=True, folder="checkpoint"),
        )

    check_dump_folder(cfg(tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(
        ConfigError, match=rf"{blocker}/run cannot be created because {blocker} is a file"
    ):
        check_dump_folder(cfg(blocker / "run"))
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ConfigError, match="is not writable"):
            check_dump_folder(cfg(ro / "run"))


def _probe_as_rank(dump: str, start, out, world_key: str) -> None:
    """One rank of an 8-rank job: wait for the others, then probe the (missing) dump folder."""
    from torchtitan_speechlm.trainer.preflight import check_dump_folder

    os.environ.pop("WORLD_SIZE", None)
    os.environ[world_key] = "8"
    cfg = SimpleNamespace(
        job=SimpleNamespace(dump_folder=dump),
        checkpoint=SimpleNamespace(enable=True, folder="checkpoint"),
    )
    start.wait()
    try:
        check_dump_folder(cfg)
        out.put("ok")
    except ConfigError as e:
        out.put(str(e))


@pytest.mark.parametrize("world_key", ["WORLD_SIZE", "SLURM_NTASKS"])
def test_ranks_probing_a_new_dump_folder_together_all_pass_and_keep_it(tmp_path, world_key):
    """Proves: 8 ranks starting at once on a dump folder that does not exist yet (a fresh run
    folder on shared storage) all pass the probe, 6 rounds in a row, and the folders stay for
    the run (one rank's clean-up used to delete the folder under another's probe), under
    torchrun's variables and under srun's without torchrun (SLURM_NTASKS only: the probe runs
    before they are mapped; tests/integration/test_cluster.py once failed so)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for round_ in range(6):
        dump = str(tmp_path / f"r{round_}" / "run")
        start, out = ctx.Barrier(8), ctx.Queue()
        ranks = [ctx.Process(target=_probe_as_rank, args=(dump, start, out, world_key))
                 for _ in range(8)]  # fmt: skip
        for p in ranks:
            p.start()
        results = [out.get(timeout=60) for _ in ranks]
        for p in ranks:
            p.join(timeout=60)
        assert results == ["ok"] * 8, results
        assert os.path.isdir(os.path.join(dump, "checkpoint"))
        assert not [f for f in os.listdir(dump) if f.startswith(".speechlm-write-probe")]


def test_low_free_space_warns_with_the_checkpoint_size(tmp_path, monkeypatch):
    """Proves: less free space than the checkpoints the run keeps at once (the newest one's
    size times those ``keep_latest_k`` keeps beside it: issue 51, D7) gives a warning naming
    the sizes; room for one but not for two warns too; enough space gives none."""
    from torchtitan_speechlm.trainer import preflight

    ckpt = tmp_path / "checkpoint" / "step-2"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"m")
    (ckpt / "__0_0.distcp").write_bytes(np.zeros(3 << 20, dtype=np.uint8).tobytes())
    cfg = SimpleNamespace(
        job=SimpleNamespace(dump_folder=str(tmp_path)),
        checkpoint=SimpleNamespace(enable=True, folder="checkpoint", keep_latest_k=2, interval=2),
        training=SimpleNamespace(steps=10),
    )
    assert preflight.expected_checkpoint_bytes(cfg) == (3 << 20) + 1
    # step-2 there; saves at 4, 6, 8, 10, three kept at a time (2 + the one being written)
    assert preflight.checkpoints_to_come(cfg) == 2
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage._replace(free=1 << 20))
    seen = []
    msg = preflight.check_free_space(cfg, warn=seen.append)
    assert seen == [msg] and "only 1.0 MiB free" in msg and "2 more checkpoints need" in msg
    assert "about 6.0 MiB (3.0 MiB each; keep_latest_k = 2 keeps up to 3 at a time)" in msg
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage._replace(free=4 << 20))
    assert preflight.check_free_space(cfg, warn=seen.append) is not None  # room for one only
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage._replace(free=8 << 20))
    assert preflight.check_free_space(cfg, warn=seen.append) is None
    cfg.checkpoint.keep_latest_k = 0  # all kept: the four saves to come
    assert preflight.checkpoints_to_come(cfg) == 4
