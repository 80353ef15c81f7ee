"""`torchtitan prepare --workers 2` after the parent process has used torch: it must finish
(forked workers used to sleep for ever in torch's thread pool) and write byte-identical shards
to `--workers 1`, with a neural codec, a k-means codec being fitted, and a fitted one."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.data_fixtures import build_assets

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
