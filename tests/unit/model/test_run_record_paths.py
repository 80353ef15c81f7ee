"""speechlm_run.json names its paths relative to the dump folder where they lie inside it or
inside the project the run was started from (no user's home in the record; a moved project
still resolves), keeps other paths and URLs as they are, and reads back absolute, records
written with absolute paths (before) included."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from types import SimpleNamespace

from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.model.run_record import read_run_record, record_for_checkpoint, record_run


@dataclass
class Args:
    pattern: str = "delay"


def job(dump: str) -> SimpleNamespace:
    return SimpleNamespace(
        model=SimpleNamespace(name="speechlm", flavor="hf"), job=SimpleNamespace(dump_folder=dump)
    )


def test_paths_inside_the_project_are_relative_and_read_back_absolute(tmp_path, monkeypatch):
    project, elsewhere = tmp_path / "clone", tmp_path / "shared" / "tokenizer"
    (project / "outputs" / "run" / "checkpoint" / "step-4").mkdir(parents=True)
    monkeypatch.chdir(project)
    record_run(
        job("./outputs/run"),
        Args(),
        backbone_path="demo_work/backbone",
        codec=CodecIdentity(
            name="kmeans", path=str(project / "demo_work" / "codec"), config_hash="c"
        ),
        tokenizer={"path": str(elsewhere), "hash": "t"},
        datasets={
            "train": "demo_work/prepared/train",
            "s3": "s3://bucket/prepared",
            "mine": "outputs/run/pairs",
        },  # fmt: skip
    )
    raw = json.loads((project / "outputs" / "run" / "speechlm_run.json").read_text())
    assert raw["hf_assets_path"] == "../../demo_work/backbone"
    assert raw["codec"]["path"] == "../../demo_work/codec"
    assert raw["tokenizer"]["path"] == str(elsewhere)  # outside the project: as it was
    assert raw["datasets"] == {
        "train": "../../demo_work/prepared/train", "s3": "s3://bucket/prepared", "mine": "pairs"
    }  # fmt: skip
    assert str(tmp_path) not in json.dumps({k: v for k, v in raw.items() if k != "tokenizer"})

    # the project moved (another user's clone): the record resolves where it now lies
    moved = tmp_path / "moved"
    shutil.move(project, moved)
    monkeypatch.chdir(tmp_path)
    rec = record_for_checkpoint(str(moved / "outputs" / "run" / "checkpoint" / "step-4"))
    assert rec["hf_assets_path"] == str(moved / "demo_work" / "backbone")
    assert rec["codec"]["path"] == str(moved / "demo_work" / "codec")
    assert rec["tokenizer"]["path"] == str(elsewhere)
    assert rec["datasets"] == {
        "train": str(moved / "demo_work" / "prepared" / "train"),
        "s3": "s3://bucket/prepared",
        "mine": str(moved / "outputs" / "run" / "pairs"),
    }


def test_a_record_written_with_absolute_paths_reads_as_before(tmp_path):
    old = {
        "version": 1,
        "model_args": {"pattern": "delay"},
        "hf_assets_path": "/data/backbone",
        "codec": {"path": "/data/codec"},
        "tokenizer": {"path": "/data/tokenizer"},
        "datasets": {"train": "/data/prepared/train"},
    }
    (tmp_path / "speechlm_run.json").write_text(json.dumps(old))
    assert read_run_record(str(tmp_path / "speechlm_run.json")) == old
