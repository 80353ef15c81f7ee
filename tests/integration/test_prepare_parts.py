"""`torchtitan prepare` as parts in real processes: `--part 0/2` and `--part 1/2` running
concurrently (one with `--workers 2`), and 2 ranks under torchrun, each give the one-process
dataset byte for byte (every shard file, plan.json, failures.jsonl, metadata.json; only
summary.json, which holds times, and OUT/.prepare/, the parts' locks and records, differ)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.data_fixtures import build_assets, write_tone_corpus

pytestmark = [pytest.mark.slow, pytest.mark.long]  # in make faults (make test budget)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    a = build_assets(tmp_path_factory.mktemp("parts"))
    c = os.path.join(a["root"], "corpus10")
    write_tone_corpus(c, [0.3 + 0.1 * (i % 4) for i in range(10)], a["sentences"])
    a["common"] = ["--manifest", os.path.join(c, "manifest.jsonl"), "--codec", a["codec"],
                   "--tokenizer", a["tok"], "--shard-size", "2", "--no-progress"]  # fmt: skip
    a["one"] = os.path.join(a["root"], "one")
    r = run(["prepare", *a["common"], "--out-dir", a["one"]])
    assert r.returncode == 0, r.stderr
    return a


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return dict(e, OMP_NUM_THREADS="1")  # the same torch threads in every process


def exe() -> list[str]:
    return [shutil.which("torchtitan", path=os.path.dirname(sys.executable))]


def run(args, timeout=180):
    return subprocess.run([*exe(), *args], capture_output=True, text=True, timeout=timeout,
                          env=env())  # fmt: skip


def tree(out) -> dict:
    res = {}
    for d, dirs, files in os.walk(out):
        dirs[:] = [x for x in dirs if x != ".prepare"]
        for f in files:
            if f != "summary.json":
                p = os.path.join(d, f)
                res[os.path.relpath(p, out)] = open(p, "rb").read()
    return res


def test_two_concurrent_parts_equal_one_process(corpus, tmp_path):
    out = str(tmp_path / "out")
    procs = [
        subprocess.Popen([*exe(), "prepare", *corpus["common"], "--out-dir", out, "--part", p, *w],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        for p, w in (("0/2", []), ("1/2", ["--workers", "2"]))
    ]  # fmt: skip
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    printed = "".join(o[0] for o in outs)
    assert "10 items written" in printed  # the last part to finish joined
    want = tree(corpus["one"])
    assert len([k for k in want if k.startswith("shards/")]) == 5 * 6  # 5 shards x 6 files
    assert tree(out) == want
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["parts"] == ["0/2", "1/2"] and summary["shards_written"] == 5
    r = run(["prepare", "--join", out])  # joining again by hand: the same dataset
    assert r.returncode == 0 and "10 items written" in r.stdout, r.stderr
    assert tree(out) == want


def test_torchrun_two_ranks_equal_one_process(corpus, tmp_path):
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "torchtitan_speechlm.cli", "prepare", *corpus["common"], "--out-dir", out]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert tree(out) == tree(corpus["one"])
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["parts"] == ["0/2", "1/2"]
