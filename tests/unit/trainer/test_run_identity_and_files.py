"""Issue 51's training-run findings in their cheap form (real DCP checkpoints, real files, a
real full tmpfs where root can mount one; the 2-process runs, D6 among them, are in
tests/integration/test_run_identity.py): each test failed before the fix.

- D1: every checkpoint step carries its identity (codec, tokenizer, vocabulary, data order) in
  a file of its own and in its manifest; a step of another codec's data is refused whatever
  the dump folder holds.
- D2: a step whose manifest is missing beside manifested siblings is damaged, not "legacy".
- D3: ``metrics.jsonl`` holds whole lines on a really full disk, a torn tail is repaired on
  reopening, and an ENOSPC anywhere ends a rank with one line.
- D4: ``speechlm_run.json`` and ``vocab.json`` carry a checksum; damage is named.
- D5: the write probe on a full disk says so and leaves nothing behind.
- D6: the dump folder's lock is taken before any check reads the folder.
- D7: wording: a deleted ``.metadata`` listed by the manifest, a 0-byte wav, "at at column",
  the launcher's line after a rank crash, the free space of several kept checkpoints
  (tests/unit/trainer/test_fault_handling.py).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.unit.trainer.test_checkpoint_integrity import _cfg, _flip, _save, small_tmpfs
from torchtitan_speechlm.components.resume import ResumeError
from torchtitan_speechlm.trainer.run import VERIFIED_ENV, choose_intact_step

__all__ = ["small_tmpfs"]  # the fixture, used below

CODEC_A = {"name": "kmeans", "config_hash": "aaaa1111aaaa1111"}
CODEC_B = {"name": "kmeans", "config_hash": "bbbb2222bbbb2222"}


def identity(codec=CODEC_A, seed=0) -> dict:
    return {
        "codec": codec,
        "vocab": "f00d",
        "tokenizer": {"hash": "t0k", "path": "/tok", "vocab_size": 100},
        "data_order": {"train": ["tts:tiny"], "seed": seed, "shuffle": True, "batching": "pack"},
    }


def job(tmp_path, **checkpoint):
    cfg = _cfg(tmp_path)
    cfg.checkpoint.exclude_from_loading = checkpoint.get("exclude", [])
    return cfg


# ---- D1 ------------------------------------------------------------------------------------
def test_d1_a_step_carries_its_identity_and_refuses_data_of_another_codec(tmp_path, monkeypatch):
    """A checkpoint folder moved into a new dump folder (no speechlm_run.json beside it) used to
    train on another codec's data without a word; its step now says what it was trained on."""
    from torchtitan_speechlm.components.resume import check_checkpoint_identity
    from torchtitan_speechlm.utils import checkpoint_manifest as cm

    monkeypatch.delenv(VERIFIED_ENV, raising=False)
    cm.set_identity(identity(), str(tmp_path / "checkpoint"))
    try:
        step = _save(tmp_path / "checkpoint", 3, 1.0)
    finally:
        cm.set_identity(None)
    manifest = json.loads(open(os.path.join(step, cm.MANIFEST)).read())
    assert manifest["identity"] == identity() and cm.IDENTITY in manifest["files"]
    assert cm.read_identity(step) == identity()
    assert not os.path.exists(tmp_path / "speechlm_run.json")  # nothing else vouches for it
    check_checkpoint_identity(job(tmp_path), identity())  # the same data: loads
    with pytest.raises(ResumeError) as e:
        check_checkpoint_identity(job(tmp_path), identity(CODEC_B))
    msg = str(e.value)
    assert "step-3 was trained on data made with codec kmeans (config_hash aaaa1111" in msg
    assert "config_hash bbbb2222" in msg and "another job.dump_folder" in msg
    with pytest.raises(ResumeError, match="speechlm_data.seed was 0, this run has 5"):
        check_checkpoint_identity(job(tmp_path), identity(seed=5))
    # the data stream restarted on purpose: the order is not compared, the codec still is
    check_checkpoint_identity(job(tmp_path, exclude=["dataloader"]), identity(seed=5))
    with pytest.raises(ResumeError, match="codec"):
        check_checkpoint_identity(job(tmp_path, exclude=["dataloader"]), identity(CODEC_B))
    # the identity file is summed by the manifest: edited, the step is damaged
    with open(os.path.join(step, cm.IDENTITY), "a") as f:
        f.write(" ")
    assert "truncated or grown" in cm.verify(step)


# ---- D2 ------------------------------------------------------------------------------------
def test_d2_a_missing_manifest_beside_manifested_siblings_is_damaged_not_legacy(
    tmp_path, monkeypatch
):
    from torchtitan_speechlm.utils.checkpoint_manifest import LEGACY, MANIFEST, verify

    monkeypatch.delenv(VERIFIED_ENV, raising=False)
    folder = tmp_path / "checkpoint"
    _save(folder, 1, 1.0)
    _save(folder, 2, 2.0)
    os.remove(folder / "step-2" / MANIFEST)
    _flip(str(folder / "step-2" / "__0_0.distcp"), 100)  # 64 flipped bytes, now unverifiable
    problem = verify(str(folder / "step-2"))
    assert problem != LEGACY and "is missing although its sibling step-1 has one" in problem
    warnings: list[str] = []
    cfg = _cfg(tmp_path)
    choose_intact_step(cfg, warn=warnings.append)
    assert cfg.checkpoint.load_step == 1, warnings  # the newest intact step instead
    assert any("step-2 is damaged" in w and "deleted or lost" in w for w in warnings)
    assert not any("unverified" in w for w in warnings)


# ---- D3 ------------------------------------------------------------------------------------
def fill(folder, leave: int) -> None:
    """Fill the file system of ``folder`` until ``leave`` bytes or fewer are free."""
    import shutil

    with open(os.path.join(folder, "filler"), "wb") as f:
        while shutil.disk_usage(folder).free > leave:
            try:
                f.write(b"\0" * max(512, min(1 << 16, shutil.disk_usage(folder).free - leave)))
                f.flush()
            except OSError:
                break


def test_d3_metrics_jsonl_keeps_whole_lines_on_a_really_full_disk(small_tmpfs, caplog):
    import errno

    from torchtitan_speechlm.components.metrics import JsonlLogger

    path = str(small_tmpfs / "metrics.jsonl")
    log = JsonlLogger(path)
    log.log({"loss": 1.5}, 1)
    fill(small_tmpfs, 0)
    row = {f"train/stream_{k}_loss": 1.0 / (k + 1) for k in range(300)}  # ~9 KB a line
    with pytest.raises(OSError) as e:
        for step in range(2, 50):
            log.log(row, step)
    assert e.value.errno == errno.ENOSPC and e.value.filename == path
    log.close()
    text = open(path).read()
    assert text.endswith("\n") and [json.loads(x)["step"] for x in text.splitlines()] == [1]
    os.remove(small_tmpfs / "filler")
    with open(path, "a") as f:  # a torn tail (a crash mid-line of an older writer)
        f.write('{"step": 2, "loss": 1.')
    with caplog.at_level(logging.WARNING):
        log = JsonlLogger(path)
    log.log({"loss": 1.25}, 3)
    log.close()
    rows = [json.loads(x) for x in open(path).read().splitlines()]
    assert [r["step"] for r in rows] == [1, 3]
    assert any("torn line" in r.getMessage() for r in caplog.records)


def test_d3_an_enospc_anywhere_ends_a_rank_with_one_line(tmp_path):
    code = (
        "import errno, os\n"
        "from torchtitan_speechlm.trainer.faults import exit_on_user_fault\n"
        "with exit_on_user_fault():\n"
        "    try:\n"
        f"        raise OSError(errno.ENOSPC, 'No space left on device', {str(tmp_path / 'metrics.jsonl')!r})\n"
        "    except OSError as e:\n"
        "        raise RuntimeError('logging failed') from e\n"
    )  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("torchtitan train:")]
    assert len(lines) == 1, r.stderr
    assert "the disk is full (ENOSPC" in lines[0] and "metrics.jsonl" in lines[0]
    assert "a rerun starts from step 1" in lines[0]


# ---- D4 ------------------------------------------------------------------------------------
def test_d4_run_folder_files_are_checksummed_and_named_when_damaged(tmp_path):
    from torchtitan_speechlm.model.run_record import RunRecordError, read_run_record
    from torchtitan_speechlm.model.vocab import VocabLayout, VocabMismatchError
    from torchtitan_speechlm.utils.fileio import write_checked_json

    vocab = tmp_path / "vocab.json"
    layout = VocabLayout(text_size=100, num_streams=4, codebook_size=64)
    layout.save(vocab)
    assert VocabLayout.load(vocab) == layout
    text = vocab.read_text()
    # a flip that still parses: the codebook size 64 -> 74
    vocab.write_text(text.replace('"codebook_size": 64', '"codebook_size": 74'))
    with pytest.raises(VocabMismatchError) as e:
        VocabLayout.load(vocab)
    assert str(vocab) in str(e.value) and "no longer match" in str(e.value)
    assert "delete" in str(e.value)
    vocab.write_bytes(text.encode()[:40])  # cut short
    with pytest.raises(VocabMismatchError, match=r"vocab.json is damaged: it ends early"):
        VocabLayout.load(vocab)
    record = tmp_path / "speechlm_run.json"
    write_checked_json(str(record), {"version": 1, "codec": CODEC_A})
    assert read_run_record(str(record))["codec"] == CODEC_A
    data = bytearray(record.read_bytes())
    data[data.index(b"kmeans")] = 0xE9  # not UTF-8 any more
    record.write_bytes(bytes(data))
    with pytest.raises(RunRecordError) as e:
        read_run_record(str(record))
    assert f"{record} is damaged: byte 0xe9 at offset" in str(e.value)


# ---- D5 ------------------------------------------------------------------------------------
def test_d5_the_write_probe_on_a_full_disk_says_so_and_leaves_nothing(small_tmpfs):
    from torchtitan_speechlm.config import ConfigError
    from torchtitan_speechlm.trainer.preflight import check_dump_folder

    dump = small_tmpfs / "run"
    dump.mkdir()
    fill(small_tmpfs, 0)
    cfg = SimpleNamespace(job=SimpleNamespace(dump_folder=str(dump)),
                          checkpoint=SimpleNamespace(enable=False))  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_dump_folder(cfg)
    assert "is full (ENOSPC" in str(e.value) and "permissions" not in str(e.value)
    assert os.listdir(dump) == []  # the probe file is gone


# ---- D6 ------------------------------------------------------------------------------------
def test_d6_the_lock_is_taken_before_any_check_reads_the_folder(tmp_path, monkeypatch, capsys):
    """A second run on a live dump folder is refused before it reads anything there (it read
    the live run's checkpoints and shards for ~21 s before the lock refused it)."""
    from tests.helpers import write_tiny_config
    from torchtitan_speechlm.commands import train
    from torchtitan_speechlm.trainer import run as run_module

    dump = tmp_path / "run"
    dump.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom torchtitan_speechlm.trainer.lifecycle "
         f"import hold_run_folder\nhold_run_folder({str(dump)!r})\nprint('held', flush=True)\n"
         "time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        read = []
        monkeypatch.setattr(run_module, "choose_intact_step", lambda *a, **k: read.append(a))
        assets = {k: str(tmp_path / k) for k in ("backbone", "tokenizer", "codec", "prepared")}
        cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
        assert train.train_command(["--job.config_file", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert "is in use by another run" in err and read == [], err
    finally:
        holder.kill()
        holder.wait()


# ---- D7 ------------------------------------------------------------------------------------
def test_d7_a_deleted_metadata_listed_by_its_manifest_is_not_an_interrupted_save(tmp_path, caplog):
    from torchtitan_speechlm.utils.checkpoint_folders import complete_checkpoints

    folder = tmp_path / "checkpoint"
    _save(folder, 1, 1.0)
    _save(folder, 2, 2.0)
    os.remove(folder / "step-2" / ".metadata")
    with caplog.at_level(logging.WARNING):
        assert complete_checkpoints(str(folder), warn=True) == [1]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "although its manifest lists it" in said and "interrupted" not in said


def test_d7_an_empty_wav_and_a_control_character_are_named_plainly(tmp_path):
    from torchtitan_speechlm.prepare.sources.jsonl import json_object
    from torchtitan_speechlm.utils.audio import BadAudioError, load_audio

    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(BadAudioError, match=r"empty \(0 bytes\)"):
        load_audio(str(empty), 16000)
    with pytest.raises(ValueError) as e:
        json_object('{"text": "a\x01b"}', "m.jsonl:3")
    assert "at at" not in str(e.value) and "Invalid control character at column 12" in str(e.value)


def test_d7_the_launcher_line_after_a_rank_crash_names_the_checkpoint(
    tmp_path, monkeypatch, capsys
):
    import torch.distributed.run as torchrun

    from torchtitan_speechlm.commands import train

    _save(tmp_path / "checkpoint", 4, 1.0)

    class ChildFailed(Exception):
        failures = {1: SimpleNamespace(exitcode=-9)}

    def crash(_):
        raise ChildFailed("rank 1 died")

    monkeypatch.setattr(torchrun, "run", crash)
    monkeypatch.setenv("LOG_RANK", "0")
    cfg = SimpleNamespace(
        job=SimpleNamespace(dump_folder=str(tmp_path)),
        checkpoint=SimpleNamespace(enable=True, folder="checkpoint"),
        parallelism=SimpleNamespace(pipeline_parallel_degree=1),
    )
    assert train._launch(["--job.config_file", "x.toml"], cfg, 2) == 1
    err = capsys.readouterr().err
    assert "rank 1 was killed by SIGKILL" in err
    assert f"the newest complete checkpoint is {tmp_path}/checkpoint/step-4" in err
