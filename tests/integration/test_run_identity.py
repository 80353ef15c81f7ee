"""Issue 51's training-run findings on real 2-process runs (`make faults`, marker ``faults``;
the cheap forms are in tests/unit/trainer/test_run_identity_and_files.py). Each failed before
the fix:

- D1: a checkpoint folder copied into a new dump folder (no ``speechlm_run.json``) and run on
  data made with another codec is refused by the launcher, naming both codecs, before any rank
  starts and before a run record is written (it trained on, loss 3.80 -> 6.03, exit 0).
- D2: a step whose manifest was deleted and 64 of whose bytes were flipped is damaged: the run
  resumes from the step before it and trains the lost step again with the same loss (it loaded
  the step unverified).
- D3: a disk that fills while rank 0 writes ``metrics.jsonl``: one line naming the full disk
  and the checkpoint to resume from, no traceback, the file whole lines; the rerun resumes and
  appends whole lines.
- D4: a damaged ``vocab.json`` / ``speechlm_run.json`` is one line of the launcher naming the
  file (both ranks died with tracebacks after the launcher's checks passed).
- D6: a second ``torchtitan train`` on the dump folder of a live 2-rank run is refused by the
  lock before it opens or lists anything of the live run's folder or its dataset's shards (it
  read the live run's checkpoints and shards for ~21 s before the lock refused it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fault_injection import RUN_ARGS
from tests.helpers import make_tiny_run_assets, run_train, write_tiny_config
from tests.integration.test_run_lifecycle import _launch, _wait_for
from tests.integration.test_run_lifecycle import _losses as losses
from tests.unit.trainer.test_checkpoint_integrity import _flip

pytestmark = [pytest.mark.slow, pytest.mark.faults]
ROOT = Path(__file__).resolve().parents[2]
COMMON = (
    "--validation.enable", "false",
    "--training.global_batch_size", "8",
    "--training.local_batch_size", "2",
    "--lr_scheduler.total_steps", "6",
    "--checkpoint.interval", "1",
)  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("identity_assets"), n_items=32)


def test_d1_a_copied_checkpoint_folder_refuses_another_codecs_data(assets, tmp_path_factory):
    other = make_tiny_run_assets(tmp_path_factory.mktemp("other_codec"), n_items=32, seed=1)
    meta = [json.loads(Path(a["prepared"], "metadata.json").read_text()) for a in (assets, other)]
    assert meta[0]["codec"]["config_hash"] != meta[1]["codec"]["config_hash"]
    root = tmp_path_factory.mktemp("d1")
    first = run_train(write_tiny_config(root / "a.toml", assets, root / "a"), *COMMON,
                      "--training.steps", "2", nproc=2)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    moved = root / "b"
    moved.mkdir()
    shutil.copytree(root / "a" / "checkpoint", moved / "checkpoint")  # no run record beside it
    mixed = {**assets, "prepared": other["prepared"]}  # the same model, another codec's data
    cfg = write_tiny_config(root / "b.toml", mixed, moved)
    r = run_train(cfg, *COMMON, "--training.steps", "3", nproc=2)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    line = next(x for x in r.stderr.splitlines() if "config error" in x)
    assert f"{moved}/checkpoint/step-2 was trained on data made with codec" in line
    assert meta[0]["codec"]["config_hash"] in line and meta[1]["codec"]["config_hash"] in line
    assert "rank 0" not in r.stderr and "Traceback" not in r.stderr
    assert not (moved / "speechlm_run.json").exists()  # no record naming the wrong codec


def test_d2_a_deleted_manifest_with_flipped_bytes_is_not_loaded(assets, tmp_path):
    from torchtitan_speechlm.utils.checkpoint_manifest import MANIFEST, verify

    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    first = run_train(cfg, *COMMON, "--training.steps", "3", nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    step3 = dump / "checkpoint" / "step-3"
    os.remove(step3 / MANIFEST)
    shard = step3 / "__1_0.distcp"
    _flip(str(shard), shard.stat().st_size // 2)  # 64 bytes
    before = losses(dump)
    rerun = run_train(cfg, *COMMON, "--training.steps", "4", nproc=2)
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, out[-3000:]
    assert f"checkpoint {step3} is damaged: {step3}/{MANIFEST} is missing although" in out
    assert f"Loading {dump}/checkpoint/step-2, the newest intact checkpoint" in out
    assert "unverified" not in out
    after = losses(dump)  # step 3 trained again, with its first loss
    assert after[3] == before[3] and set(after) == {1, 2, 3, 4}
    assert verify(str(step3)) == "" and verify(str(dump / "checkpoint" / "step-4")) == ""


def test_d3_a_disk_full_under_metrics_jsonl_is_one_line_and_whole_lines(
    assets, tmp_path, monkeypatch
):
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    monkeypatch.setenv("SPEECHLM_FAULTS", "enospc_in_metrics@3:0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = run_train(cfg, *COMMON, *RUN_ARGS, "--training.steps", "4", nproc=2)
    monkeypatch.delenv("SPEECHLM_FAULTS")
    assert r.returncode == 1, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if "the disk is full (ENOSPC" in x]
    assert len(lines) == 1 and "rank 0" in lines[0] and "metrics.jsonl" in lines[0], r.stderr
    assert "checkpoint/step-2: rerun the same command to resume from it" in lines[0]
    assert "Traceback" not in r.stderr
    text = (dump / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(x)["step"] for x in text.splitlines()] == [1, 2]
    rerun = run_train(cfg, *COMMON, "--training.steps", "4", nproc=2)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    rows = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_d4_a_damaged_vocab_or_run_record_is_the_launchers_one_line(assets, tmp_path):
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    first = run_train(cfg, *COMMON, "--training.steps", "1", nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    for name in ("vocab.json", "speechlm_run.json"):
        path = dump / name
        good = path.read_bytes()
        path.write_bytes(good.replace(b'"', b"\xe9", 1))  # one byte: not UTF-8 any more
        r = run_train(cfg, *COMMON, "--training.steps", "2", nproc=2)
        assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
        assert f"{path} is damaged: byte 0xe9 at offset" in r.stderr and "delete" in r.stderr
        assert "Traceback" not in r.stderr and "rank 0" not in r.stderr
        path.write_bytes(good)
    r = run_train(cfg, *COMMON, "--training.steps", "2", nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]


# what a second launcher opens or lists under ROOTS (argv[1], JSON), but for the lock files and
# its write probe: Python's audit events ("open" is raised by open() and os.open() alike)
WATCHED = r"""
import json, os, sys, time
roots = tuple(json.loads(sys.argv[1]))
ours = (".speechlm-run.lock", ".speechlm-ranks.lock", ".speechlm-write-probe-")
seen = []

def hook(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args:
        path = args[0]
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(path))
            if path.startswith(roots) and not os.path.basename(path).startswith(ours):
                seen.append(f"{event} {path}")

from torchtitan_speechlm import cli
import torchtitan_speechlm.commands.train  # its imports (torch, torchtitan) are not timed
sys.addaudithook(hook)
t = time.monotonic()
rc = cli.main(sys.argv[2:])
print(f"READ {json.dumps(seen)} IN {time.monotonic() - t:.2f}", file=sys.stderr)
sys.exit(rc)
"""


def test_d6_a_second_run_on_a_live_folder_is_refused_before_it_reads_it(assets, tmp_path):
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    log = tmp_path / "live.log"
    live = _launch(cfg, log)  # 2 ranks, 400 steps, a checkpoint every 2
    try:
        _wait_for(dump / "checkpoint" / "step-2" / ".manifest.json", live, log)
        roots = [str(dump.resolve()), str(Path(assets["prepared"]).resolve())]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        second = subprocess.run(
            [sys.executable, "-c", WATCHED, json.dumps(roots), "train", "--job.config_file", cfg,
             "--nproc-per-node", "2", *COMMON, "--training.steps", "400"],
            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
        )  # fmt: skip
        assert live.poll() is None, log.read_text()[-3000:]  # the live run was live throughout
    finally:
        if live.poll() is None:
            os.killpg(live.pid, signal.SIGKILL)
        live.wait()
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"job.dump_folder {dump} is in use by another run: its launcher" in second.stderr
    read = next(x for x in second.stderr.splitlines() if x.startswith("READ "))
    seen, took = read.removeprefix("READ ").rsplit(" IN ", 1)
    assert json.loads(seen) == [], seen  # no checkpoint, no shard, no run record
    assert "Traceback" not in second.stderr and "rank 0" not in second.stderr
    print(f"refused {took} s after the command began (its imports aside)")
