"""`torchtitan prepare --workers 2` after the parent process has used torch: it must finish
(forked workers used to sleep for ever in torch's thread pool) and write byte-identical shards
to `--workers 1`, with a neural codec, a k-means codec being fitted, and a fitted one. Killed
mid-run, it leaves no worker behind."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.data_fixtures import build_assets, write_manifest
from torchtitan_speechlm.data.format import shard_name

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make faults (make test budget: 48 s)

# the parent runs parallel torch ops (2 threads) before it starts the workers
SCRIPT = """
import sys
if __name__ == "__main__":
    import torch
    torch.set_num_threads(2)
    x = torch.randn(256, 256)
    for _ in range(4):
        x = (x @ x).tanh()
    from torchtitan_speechlm.cli import main
    sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def kaldi(tmp_path_factory):
    """The tone corpus of data_fixtures as a Kaldi data dir (shards of 2 items)."""
    a = build_assets(tmp_path_factory.mktemp("prep"))
    kdir = os.path.join(a["root"], "kaldi")
    os.makedirs(kdir)
    corpus = os.path.dirname(a["manifest"])
    with (
        open(os.path.join(kdir, "wav.scp"), "w") as scp,
        open(os.path.join(kdir, "text"), "w") as text,
    ):
        for r in a["rows"]:
            scp.write(f"{r['id']} {os.path.join(corpus, r['audio'])}\n")
            text.write(f"{r['id']} {r['text']}\n")
    a["kaldi"] = kdir
    return a


def prepare(args, threads: int | None, script: str | None = None, timeout: int = 120):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    exe = shutil.which("torchtitan", path=os.path.dirname(sys.executable))
    cmd = [sys.executable, script] if script else [exe]
    r = subprocess.run(
        [*cmd, "prepare", *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]


def shard_bytes(out) -> dict:
    res = {}
    for d, _, files in os.walk(os.path.join(out, "shards")):
        for f in files:
            if f != "shard.json":  # holds the codec path, which differs between the runs
                p = os.path.join(d, f)
                res[os.path.relpath(p, out)] = open(p, "rb").read()
    return res


def test_two_workers_after_torch_work_finish_and_match_one_worker(kaldi, tmp_path):
    script = tmp_path / "parent_used_torch.py"
    script.write_text(SCRIPT)
    threads = max(1, (os.cpu_count() or 1) // 2)  # what each of 2 workers gets
    common = ["--kaldi", kaldi["kaldi"], "--tokenizer", kaldi["tok"], "--shard-size", "2"]
    km = str(tmp_path / "kmeans")
    # the README's command, exactly: the parent fits the codec (torch work), then starts workers
    prepare(
        [
            *common,
            "--fit-kmeans-codec",
            km,
            "--codebooks",
            "2",
            "--codebook-size",
            "16",
            "--kmeans-seconds",
            "5",  # the corpus holds 6 s: less than the default 600 is refused (issue 50)
            "--out-dir",
            str(tmp_path / "fit_w2"),
            "--workers",
            "2",
        ],
        threads=None,
    )
    for name, codec in (("kmeans", km), ("encodec", kaldi["codec"])):
        ref, two = tmp_path / f"{name}_w1", tmp_path / f"{name}_w2"
        prepare([*common, "--codec", codec, "--out-dir", str(ref), "--workers", "1"], threads)
        prepare(
            [*common, "--codec", codec, "--out-dir", str(two), "--workers", "2"],
            None,
            script=str(script),
        )
        want = shard_bytes(ref)
        assert len(want) == 3 * 5  # 3 shards x (items, failures, columns, 2 arrays)
        assert shard_bytes(two) == want, name
        if name == "kmeans":
            assert shard_bytes(tmp_path / "fit_w2") == want


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (Linux: /proc)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """Not ended (a zombie has ended: only its exit status is left to collect)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")[:200]
    except OSError:  # it ended since it was seen running
        return "(ended since)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_prepare_leaves_no_worker_behind(kaldi, tmp_path):
    """`kill -9` of `torchtitan prepare --workers 2` mid-run (a cancelled job, the OOM killer):
    its forkserver, workers and resource tracker end within seconds. The workers used to wait
    for work for ever (0.9 GB resident, 40 minutes later: utils/parent_watch.py)."""
    rows = [dict(r, id=f"{r['id']}_{k}") for k in range(40) for r in kaldi["rows"]]
    corpus = os.path.dirname(kaldi["manifest"])
    manifest = write_manifest(os.path.join(corpus, "many.jsonl"), rows)  # beside its wavs
    out = tmp_path / "out"
    exe = shutil.which("torchtitan", path=os.path.dirname(sys.executable))
    proc = subprocess.Popen(
        [exe, "prepare", "--manifest", manifest, "--tokenizer", kaldi["tok"], "--codec",
         kaldi["codec"], "--shard-size", "1", "--out-dir", str(out), "--workers", "2",
         "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    below: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not (out / "shards" / shard_name(0)).is_dir():  # a worker has written a shard
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no shard written in 120 s"
            time.sleep(0.02)
        below = descendants(proc.pid)
        proc.kill()
        assert proc.wait() == -signal.SIGKILL  # killed mid-run, not after its last shard
        assert len(list((out / "shards").iterdir())) < len(rows)
        assert len(below) >= 3, below  # the forkserver and its two workers at least
        deadline = time.monotonic() + 15
        while any(map(running, below)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {p: cmdline(p) for p in below if running(p)}
        assert not left, f"still running 15 s after the prepare process was killed: {left}"
    finally:
        for p in filter(running, below):
            os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
