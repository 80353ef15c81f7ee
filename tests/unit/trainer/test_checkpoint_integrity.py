"""Checkpoints that prove themselves (utils/checkpoint_manifest.py) and saves on a really full
disk (issue 39, findings 3, 4 and 6). Real bytes flipped or cut in real DCP checkpoints; a real
small tmpfs. The 2-process runs (a damaged .distcp resumed from, the launcher's refusal) are in
tests/integration/test_run_lifecycle.py."""

from __future__ import annotations

import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch

from torchtitan_speechlm.components.resume import ResumeError
from torchtitan_speechlm.trainer.run import VERIFIED_ENV, choose_intact_step
from torchtitan_speechlm.utils.checkpoint_manifest import MANIFEST, PENDING, verify


def _save(folder, step: int, value: float) -> str:
    from torchtitan.components.checkpoint import AsyncMode, CheckpointManager

    state = {"w": torch.full((4096,), value), "b": torch.arange(100, dtype=torch.float32)}
    path = str(folder / f"step-{step}")
    CheckpointManager.dcp_save(None, state, path, AsyncMode.DISABLED)
    return path


def _cfg(tmp_path, load_step: int = -1):
    return SimpleNamespace(
        job=SimpleNamespace(dump_folder=str(tmp_path)),
        checkpoint=SimpleNamespace(enable=True, folder="checkpoint", load_step=load_step),
    )


def _flip(path: str, offset: int, n: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(n))
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _cut(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


DAMAGE = {
    "distcp_flipped": ("__0_0.distcp", _flip, "CRC-32C"),
    "distcp_truncated": ("__0_0.distcp", _cut, "truncated or grown"),
    "metadata_flipped": (".metadata", _flip, "CRC-32C"),
    "metadata_truncated": (".metadata", _cut, "truncated or grown"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_loads(
    tmp_path, monkeypatch, damage
):
    """Proves: a step whose bytes changed on disk (flipped or cut, in a .distcp or in
    .metadata) is named with the file and what differs; the newest intact step is loaded
    instead with a warning; asked for exactly (checkpoint.load_step), it is refused."""
    import torch.distributed.checkpoint as dcp

    monkeypatch.delenv(VERIFIED_ENV, raising=False)
    folder = tmp_path / "checkpoint"
    _save(folder, 1, 1.0)
    step2 = _save(folder, 2, 2.0)
    manifest = json.loads((folder / "step-2" / MANIFEST).read_text())
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp"}
    assert not (folder / "step-2" / PENDING).exists()
    assert not list((folder / "step-2").glob("*.sum"))  # summed while written, collected
    assert verify(step2) == ""
    name, how, words = DAMAGE[damage]
    how(os.path.join(step2, name), 40) if how is _flip else how(os.path.join(step2, name))
    problem = verify(step2)
    assert os.path.join(step2, name) in problem and words in problem, problem

    warnings = []
    cfg = _cfg(tmp_path)
    choose_intact_step(cfg, warn=warnings.append)
    assert cfg.checkpoint.load_step == 1
    (msg,) = warnings
    assert f"checkpoint {step2} is damaged: {os.path.join(step2, name)}" in msg, msg
    assert f"Loading {folder / 'step-1'}, the newest intact checkpoint, instead" in msg
    back = {"w": torch.empty(4096), "b": torch.empty(100)}
    dcp.load(back, checkpoint_id=str(folder / "step-1"))
    assert torch.equal(back["w"], torch.full((4096,), 1.0))

    monkeypatch.delenv(VERIFIED_ENV, raising=False)
    with pytest.raises(ResumeError, match=r"load_step = 2: .*step-2 is damaged: .*" + name):
        choose_intact_step(_cfg(tmp_path, load_step=2), warn=warnings.append)


def test_old_checkpoints_load_with_a_warning_and_unconfirmed_saves_do_not(tmp_path, monkeypatch):
    """Proves: a step without a manifest (written before manifests) loads with a warning; a
    step whose save stopped after .metadata but before its manifest is not intact; every
    step damaged is refused naming each."""
    monkeypatch.delenv(VERIFIED_ENV, raising=False)
    folder = tmp_path / "checkpoint"
    _save(folder, 1, 1.0)
    os.remove(folder / "step-1" / MANIFEST)
    warnings = []
    cfg = _cfg(tmp_path)
    choose_intact_step(cfg, warn=warnings.append)
    assert cfg.checkpoint.load_step == -1 and "no manifest" in warnings[0]

    _save(folder, 2, 2.0)
    os.remove(folder / "step-2" / MANIFEST)
    (folder / "step-2" / PENDING).write_text("x")
    warnings.clear()
    cfg = _cfg(tmp_path)
    choose_intact_step(cfg, warn=warnings.append)
    assert cfg.checkpoint.load_step == 1
    assert any("save was stopped before the checkpoint was confirmed" in w for w in warnings)

    _save(folder, 1, 1.0)
    _flip(str(folder / "step-1" / "__0_0.distcp"), 100)
    monkeypatch.delenv(VERIFIED_ENV, raising=False)
    with pytest.raises(ResumeError, match="every checkpoint in .* is damaged"):
        choose_intact_step(_cfg(tmp_path))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (root's ``mount``); skipped where it cannot be mounted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_save_on_a_really_full_small_disk_says_disk_full(small_tmpfs):
    """Proves: a save that fills a real 1 MiB tmpfs (torch's zip writer fails with "unexpected
    pos", no errno) ends in CheckpointSaveError saying the disk is full; the partial folder is
    removed and the earlier step stays intact and verified."""
    from torchtitan.components.checkpoint import AsyncMode, CheckpointManager

    from torchtitan_speechlm.utils.compat import CheckpointSaveError

    folder = small_tmpfs / "checkpoint"
    _save(folder, 1, 1.0)
    big = {"w": torch.ones(1 << 19)}  # 2 MiB
    with pytest.raises(CheckpointSaveError) as e:
        CheckpointManager.dcp_save(None, big, str(folder / "step-2"), AsyncMode.DISABLED)
    msg = str(e.value)
    assert "the disk is full" in msg and f"{folder}/step-1 is intact" in msg, msg
    assert not (folder / "step-2").exists() and verify(str(folder / "step-1")) == ""
