"""`torchtitan prepare` in parts, in process: which part runs (--part, torchrun, SLURM), the
lock on --out-dir, a failed part rerun doing only what is missing, --join refusing while shards
are missing. The multi-process runs (concurrent parts, torchrun) are in
tests/integration/test_prepare_parts.py."""

from __future__ import annotations

import os
import socket

import pytest

from tests.data_fixtures import build_assets, write_tone_corpus
from torchtitan_speechlm.commands.prepare import main
from torchtitan_speechlm.prepare import pipeline
from torchtitan_speechlm.prepare import worker as prepare_worker
from torchtitan_speechlm.prepare.parts import (
    Mutex,
    PartError,
    PartLock,
    owned,
    parse_part,
    part_device,
)
from torchtitan_speechlm.prepare.pipeline import join_parts, prepare_dataset


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny assets plus a 10-item tone corpus (5 shards of 2) and its one-part dataset."""
    a = build_assets(tmp_path_factory.mktemp("parts"))
    corpus = os.path.join(a["root"], "corpus10")
    write_tone_corpus(corpus, [0.3 + 0.1 * (i % 4) for i in range(10)], a["sentences"])
    a["m10"] = os.path.join(corpus, "manifest.jsonl")
    a["one"] = os.path.join(a["root"], "one")
    prepare_dataset(a["m10"], a["codec"], a["tok"], a["one"], progress=False, shard_size=2)
    return a


def tree(out) -> dict:
    """{relative path: bytes} of a dataset, without the run's own records (summary.json: times;
    .prepare/: locks and part records; index/: the reader's cache)."""
    res = {}
    for d, dirs, files in os.walk(out):
        dirs[:] = [x for x in dirs if x not in (".prepare", "index")]
        for f in files:
            p = os.path.join(d, f)
            if f != "summary.json":
                res[os.path.relpath(p, out)] = open(p, "rb").read()
    return res


def test_which_part():
    assert parse_part(None, {}) == (0, 1)
    assert parse_part("1/4", {"RANK": "3", "WORLD_SIZE": "8"}) == (1, 4)  # the flag wins
    assert parse_part(None, {"RANK": "3", "WORLD_SIZE": "8"}) == (3, 8)
    assert parse_part(None, {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "5"}) == (2, 5)
    arr1 = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "5", "SLURM_ARRAY_TASK_MIN": "1"}
    assert parse_part(None, arr1) == (4, 5)  # --array=1-5
    assert parse_part(None, {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == (1, 2)
    for bad in ("2/2", "a/b", "1", "0/0"):
        with pytest.raises(PartError):
            parse_part(bad, {})
    assert part_device("cuda", {"LOCAL_RANK": "3"}) == "cuda:3"
    assert part_device("cuda", {"SLURM_LOCALID": "1"}) == "cuda:1"
    assert part_device("cuda:2", {"LOCAL_RANK": "3"}) == "cuda:2"
    assert part_device("cpu", {"LOCAL_RANK": "3"}) == "cpu"
    assert owned(7, (1, 3)) == [1, 4] and owned(2, (2, 3)) == []


def test_failed_part_keeps_the_rest_and_its_rerun_does_only_what_is_missing(
    assets, tmp_path, monkeypatch
):
    out = str(tmp_path / "out")
    args = (assets["m10"], assets["codec"], assets["tok"], out)
    kw = dict(progress=False, shard_size=2)
    encoded: list[int] = []
    real_encode = prepare_worker._encode_all

    def counting(loaded):
        encoded.append(sum(len(d["wavs"]) for d in loaded))
        return real_encode(loaded)

    monkeypatch.setattr(prepare_worker, "_encode_all", counting)
    real_run = prepare_worker.run_shard

    def fail_at_shard_3(task, out_dir):
        if task.index == 3:
            raise RuntimeError("disk on fire")
        return real_run(task, out_dir)

    s0 = prepare_dataset(*args, **kw, part="0/2")  # shards 0, 2, 4
    assert s0["complete"] is False and "part(s) 1/2" in s0["missing"]
    assert sorted(os.listdir(os.path.join(out, "shards"))) == ["00000", "00002", "00004"]
    assert not os.path.exists(os.path.join(out, "metadata.json"))
    with pytest.raises(PartError, match=r"2 shard\(s\) not finished yet \(00001, 00003\).*1/2"):
        join_parts(out)
    assert main(["--join", out]) == 1
    monkeypatch.setattr("torchtitan_speechlm.prepare.run.run_shard", fail_at_shard_3)
    # a temporary folder of another (live) part is never deleted as stale by this one
    other_tmp = os.path.join(out, "shards", ".tmp-00002-99999")
    os.makedirs(other_tmp)
    with pytest.raises(RuntimeError, match="disk on fire"):
        prepare_dataset(*args, **kw, part="1/2")  # shard 1 done, shard 3 fails
    assert os.path.isdir(other_tmp)
    os.rmdir(other_tmp)
    finished = {k: v for k, v in tree(out).items() if k.startswith("shards/")}
    assert sorted({k.split("/")[1] for k in finished}) == ["00000", "00001", "00002", "00004"]
    monkeypatch.setattr("torchtitan_speechlm.prepare.run.run_shard", real_run)
    encoded.clear()
    s1 = prepare_dataset(*args, **kw, part="1/2")  # the rerun: shard 3 only, then the join
    assert (s1["shards_written"], s1["shards_reused"]) == (4, 1)  # the parts summed: 3 + 1, 0 + 1
    assert sum(encoded) == 2  # the 2 items of shard 3, nothing else encoded
    assert s1["num_items"] == 10 and s1["parts"] == ["0/2", "1/2"]
    after = tree(out)
    assert all(after[k] == v for k, v in finished.items())  # finished shards untouched
    assert after == tree(assets["one"])  # the one-part dataset, byte for byte
    assert join_parts(out)["num_items"] == 10 and tree(out) == after  # a join again: the same


def test_another_prepare_on_the_same_out_is_refused(assets, tmp_path, capsys):
    out = str(tmp_path / "out")
    args = ["--manifest", assets["m10"], "--codec", assets["codec"], "--tokenizer", assets["tok"],
            "--out-dir", out, "--shard-size", "2", "--no-progress"]  # fmt: skip
    os.makedirs(out)
    other = PartLock(out, (0, 1), "0123456789abcdef")  # a live run of another plan
    with Mutex(out):
        other.acquire()
    try:
        assert main(args) == 1
        err = capsys.readouterr().err
        assert f"another run (host {socket.gethostname()}, PID {os.getpid()}" in err
        assert not os.path.exists(os.path.join(out, "shards"))  # nothing written
    finally:
        other.release()
    # the same part of this same run, live: refused too; other parts of it may run
    rid = pipeline.run_id(_plan(assets, out))
    same = PartLock(out, (1, 2), rid)
    with Mutex(out):
        same.acquire()
    try:
        assert main([*args, "--part", "1/2"]) == 1
        assert "part 1/2 of this run is already running" in capsys.readouterr().err
        assert main([*args, "--part", "0/2"]) == 0
        assert "not joined yet" in capsys.readouterr().out
    finally:
        same.release()
    # a lock left by a dead part (nobody holds it) is stale: removed, the run goes on
    with open(os.path.join(out, ".prepare", "part-0-of-1.lock"), "w") as f:
        f.write('{"host": "gone", "pid": 1, "run": "0123456789abcdef"}')
    assert main(args) == 0
    assert tree(out) == tree(assets["one"]) and not os.path.exists(os.path.join(out, ".prepare"))


def _plan(assets, out) -> dict:
    """The plan a one-part run of assets' corpus writes (read from its plan.json)."""
    from torchtitan_speechlm.data.format import read_json

    return read_json(os.path.join(assets["one"], "plan.json"))
