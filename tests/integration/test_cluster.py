"""Clusters, on one machine: two "nodes" train exactly what one node of two ranks trains.

Three launches of the same 2-rank job on a dump folder that does not exist yet, compared loss by
loss and grad norm by grad norm with `torchtitan train --nproc-per-node 2`:
- `train_configs/slurm/train.sbatch` itself, with stand-in `srun` (one task per "node", SLURM's
  variables set) and `scontrol` commands: two torchrun agents (`--nnodes 2`, c10d rendezvous on
  127.0.0.1), one rank each, every rank running `torchtitan train`;
- the srun-variable path without torchrun: two `torchtitan train` processes that map
  SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID themselves.
Run by `make faults` (marker `cluster`): 3 x 2 processes is too slow for `make test`.
"""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make_tiny_run_assets, read_metrics, run_train, write_tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "train_configs" / "slurm" / "train.sbatch"
BIN = Path(sys.executable).parent
STEPS = ("--training.steps", "4", "--checkpoint.interval", "2", "--validation.enable", "false")

FAKE_SRUN = """#!/bin/bash
# stand-in srun: one task per "node" on this machine, with SLURM's per-task variables
set -u
while [[ "$1" == --* ]]; do shift; done  # srun's own options
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_NTASKS=$SLURM_NNODES "$@" \
        > "$LOG_DIR/node$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
# stand-in scontrol: every node of the job is this machine
case "$1 $2" in
    # the second line comes late, as from a slow scontrol on a big job: a reader that stops
    # after the first line (head -n 1 under pipefail) makes this exit on SIGPIPE
    "show hostnames") echo 127.0.0.1; sleep 0.5; echo 127.0.0.1 ;;
    *) echo "scontrol $*" ;;
esac
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("cluster_assets"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def curve(dump) -> list[tuple]:
    rows = read_metrics(dump)
    return [(r["step"], r["train/loss"], r["grad_norm"]) for r in rows if "train/loss" in r]


@pytest.fixture(scope="module")
def one_node(assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_node")
    dump = tmp / "new" / "run"
    cfg = write_tiny_config(tmp / "c.toml", assets, dump)
    r = run_train(cfg, *STEPS, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(curve(dump)) == 4
    return cfg, curve(dump)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def test_the_sbatch_script_on_two_nodes_trains_what_one_node_does(one_node, tmp_path):
    cfg, want = one_node
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    dump = tmp_path / "shared" / "runs" / "a"  # does not exist yet: every rank probes it
    env = _env(
        PATH=f"{fake}:{BIN}:{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_NNODES="2",
        GPUS_PER_NODE="1",
        RDZV_PORT=str(_port()),
        LOG_DIR=str(tmp_path),
    )
    r = subprocess.run(
        ["bash", str(SBATCH), cfg, str(dump), *STEPS],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    logs = "".join(p.read_text() for p in (tmp_path / f"node{n}.log" for n in (0, 1)) if p.exists())
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr}\n{logs}"[-4000:]
    assert curve(dump) == want  # losses and grad norms, bit for bit
    assert (dump / "checkpoint" / "step-4").is_dir()


def test_srun_variables_without_torchrun_train_what_one_node_does(one_node, tmp_path):
    cfg, want = one_node
    dump = tmp_path / "shared" / "runs" / "b"
    port = str(_port())
    procs = []
    for rank in (0, 1):
        env = _env(
            SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID="0",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        )  # fmt: skip
        cmd = [str(BIN / "torchtitan"), "train", "--job.config_file", cfg,
               "--job.dump_folder", str(dump), *STEPS]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "".join(outs)[-4000:]
    assert curve(dump) == want


def test_a_dump_folder_that_cannot_be_written_is_named_under_torchrun(assets, tmp_path):
    """Inside torchrun too, a dump folder that truly cannot be created is named as such."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = write_tiny_config(tmp_path / "c.toml", assets, blocker / "run")
    r = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--no-python",
         str(BIN / "torchtitan"), "train", "--job.config_file", cfg, *STEPS],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert r.returncode != 0
    assert f"{blocker}/run cannot be created because {blocker} is a file" in r.stdout + r.stderr


def test_the_sbatch_script_is_valid_bash():
    assert shutil.which("bash")
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def test_the_sbatch_script_picks_a_rendezvous_port_per_job(tmp_path):
    """Two jobs sharing a node must not meet on one fixed port: without RDZV_PORT the script
    takes 20000 + the job id mod 10000 (a stand-in torchrun prints what it was given)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("torchrun", '#!/bin/bash\necho "torchrun $*"\n')):  # fmt: skip
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    ports = []
    for job in ("4242", "4243"):
        env = _env(PATH=f"{fake}:{os.environ['PATH']}", SLURM_JOB_ID=job, LOG_DIR=str(tmp_path),
                   SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="1", GPUS_PER_NODE="1")  # fmt: skip
        r = subprocess.run(["bash", str(SBATCH), "c.toml", str(tmp_path / job)], env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        line = (tmp_path / "node0.log").read_text()
        ports.append(line.split("--rdzv-endpoint 127.0.0.1:")[1].split()[0])
    assert ports == ["24242", "24243"]
    assert "#SBATCH --open-mode=append" in SBATCH.read_text()  # a requeued job appends its log


def test_usr1_saves_the_step_in_flight_then_requeues_and_the_rerun_continues(assets, tmp_path):
    """Preemption: USR1 to the batch shell asks the run to save and stop (SAVE_AND_STOP in the
    dump folder); both "nodes" stop after the same step, which is checkpointed although it is
    off the save interval; only then is `scontrol requeue` called; the rerun (the requeued job)
    continues from that step and trains exactly what an uninterrupted run trains."""
    import signal
    import time

    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    long = ("--training.steps", "40", "--checkpoint.interval", "1000", "--validation.enable",
            "false", "--metrics.log_freq", "1")  # fmt: skip
    reference = tmp_path / "reference"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, reference)
    assert run_train(cfg, *long, nproc=2).returncode == 0
    dump = tmp_path / "shared" / "run"
    env = _env(PATH=f"{fake}:{BIN}:{os.environ['PATH']}", SLURM_JOB_ID="77",
               SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2", GPUS_PER_NODE="1",
               RDZV_PORT=str(_port()), LOG_DIR=str(tmp_path))  # fmt: skip
    cmd = ["bash", str(SBATCH), cfg, str(dump), *long]
    job = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not ((dump / "metrics.jsonl").exists() and len(curve(dump)) >= 2):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.2)
    job.send_signal(signal.SIGUSR1)
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    stopped = len(curve(dump))
    assert 2 <= stopped < 40
    assert (dump / "checkpoint" / f"step-{stopped}").is_dir(), sorted(
        os.listdir(dump / "checkpoint")
    )
    assert "asking the run to save and stop" in err and "scontrol requeue 77" in out
    assert (dump / "SAVE_AND_STOP").exists()
    rerun = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert not (dump / "SAVE_AND_STOP").exists()
    assert curve(dump) == curve(reference)  # every step once, bit for bit
