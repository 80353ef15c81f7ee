"""`python -m torchtitan_speechlm.commands.wandb_offline RUN_DIR` takes what docs/metrics.md calls
RUN_DIR in any of its forms: the `offline-run-*` folder, its `run-*.wandb` file, or a folder
above them such as the dump folder (runs under `tb/<time>/wandb/`; several when the job was
started more than once: each is read, oldest first). The run files here are written in
wandb's own record format (a `:W&B` header, then 32 KiB blocks of crc / length / type /
payload records holding its `Record` protobufs); tests/integration/test_dashboard.py reads real ones."""

import struct
import subprocess
import sys
import zlib

import pytest

from torchtitan_speechlm.commands.wandb_offline import find_runs, main, read_history


def write_run(folder, steps: dict[int, dict]) -> str:
    """An offline run folder with one run-*.wandb file holding these history rows."""
    from wandb.proto import wandb_internal_pb2 as pb

    folder.mkdir(parents=True)
    records = []
    for step, row in steps.items():
        r = pb.Record()
        for key, value in row.items():
            r.history.item.add(key=key, value_json=str(value))
        r.history.step.num = step
        records.append(r.SerializeToString())
    data = b":W&B" + b"\xe1\xbe\x00"  # magic, version
    for payload in records:  # each a FULL record (type 1) in the first block
        data += struct.pack("<IHB", zlib.crc32(payload), len(payload), 1) + payload
    path = folder / f"run-{folder.name.rsplit('-', 1)[-1]}.wandb"
    path.write_bytes(data)
    return str(path)


@pytest.fixture
def dump(tmp_path):
    d = tmp_path / "dump"
    write_run(
        d / "tb" / "20260101-1200" / "wandb" / "offline-run-20260101_120000-aaa", {1: {"loss": 2.5}}
    )
    return d


def test_every_form_of_run_dir_reads_the_run(dump, capsys):
    run = next((dump / "tb").glob("*/wandb/offline-run-*"))
    (wandb_file,) = run.glob("run-*.wandb")
    for path in (run, wandb_file, dump, dump / "tb"):
        assert find_runs(str(path)) == [str(wandb_file)]
        assert read_history(str(path)) == [{"loss": 2.5, "_step": 1}]
        assert main([str(path)]) == 0
        assert "1 history rows; keys:\n  _step\n  loss" in capsys.readouterr().out


def test_a_dump_folder_with_several_runs_reads_each_oldest_first(dump, capsys):
    later = dump / "tb" / "20260101-1300" / "wandb" / "offline-run-20260101_130000-bbb"
    write_run(later, {2: {"loss": 2.0, "lr": 0.1}, 3: {"loss": 1.5}})
    runs = find_runs(str(dump))
    assert [r.split("/")[-2] for r in runs] == [
        "offline-run-20260101_120000-aaa",
        "offline-run-20260101_130000-bbb",
    ]
    with pytest.raises(ValueError, match="holds 2 offline wandb runs; name one"):
        read_history(str(dump))  # one list of rows would mix two runs
    assert main([str(dump)]) == 0
    out = capsys.readouterr().out
    assert "run 1 of 2:" in out and "run 2 of 2:" in out
    assert out.index("offline-run-20260101_120000") < out.index("offline-run-20260101_130000")
    assert "2 history rows; keys:\n  _step\n  loss\n  lr" in out


def test_a_folder_without_runs_is_an_error_not_a_traceback(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "torchtitan_speechlm.commands.wandb_offline", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "no offline wandb run" in r.stderr and "Traceback" not in r.stderr
