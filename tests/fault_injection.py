"""Test hooks that inject the faults the fault suite (tests/unit/trainer/test_fault_handling.py) proves we survive.

Importing the package installs nothing: ``install()`` does, called by the tests, or by a
training rank (launch.run_worker) when the environment variable ``SPEECHLM_FAULTS`` is set
(read there and nowhere else), so production runs never carry the hooks. Each entry is ``KIND@STEP`` or ``KIND@STEP:RANK`` (comma-separated);
without a rank it fires on every rank. Every entry fires once per process.

    kill_in_save   SIGKILL this rank halfway through writing its first file of checkpoint step-STEP
    enospc_in_save a write of checkpoint step-STEP raises OSError(ENOSPC) after writing half its bytes
    enospc_in_metrics  the metrics.jsonl line of step STEP is half written, then OSError(ENOSPC)
    nan_loss       the loss of the first micro-batch of step STEP becomes NaN
    spike_loss     the loss of the first micro-batch of step STEP is multiplied by 50
    inf_grad       one gradient shard becomes +Inf after the backward of step STEP
    sigstop        SIGSTOP this rank at the start of step STEP's optimizer-step check (a hung rank)
    die            SIGKILL this rank at the same point (a dead rank, mid-collective for the others)

Why hooks rather than real faults: a real full disk or a NaN from data needs a tmpfs or a crafted
model, neither portable nor deterministic; the hooks go through the same code paths (DCP's
file writer, the loss, the gradients, the collectives) at a chosen step. They wrap the step
guard's two methods (``StepGuard.note_loss``, ``StepGuard.allow_update``) and DCP's file stream.
"""

from __future__ import annotations

import errno
import os
import re
import signal
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import torchtitan_speechlm  # noqa: F401  (a run's custom_import: registers the spec too)
from torchtitan_speechlm.components.nonfinite import StepGuard, local_gradients

ENV = "SPEECHLM_FAULTS"
RUN_ARGS = ("--experimental.custom_import", "tests.fault_injection")
KINDS = ("kill_in_save", "enospc_in_save", "enospc_in_metrics", "nan_loss", "spike_loss",
         "inf_grad", "sigstop", "die")  # fmt: skip
_STEP_DIR = re.compile(r"step-(\d+)")


@dataclass
class Fault:
    kind: str
    step: int
    rank: int | None
    fired: bool = False


def parse(text: str) -> list[Fault]:
    """``"kill_in_save@4:1,nan_loss@3"`` -> faults; raises ValueError on a bad entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        m = re.fullmatch(r"(\w+)@(\d+)(?::(\d+))?", entry)
        if not m or m.group(1) not in KINDS:
            raise ValueError(
                f"{ENV}: bad entry {entry!r}; expected KIND@STEP[:RANK], KIND in {KINDS}"
            )
        faults.append(
            Fault(m.group(1), int(m.group(2)), None if m.group(3) is None else int(m.group(3)))
        )
    return faults


_FAULTS: list[Fault] = []  # armed by install()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def take(kind: str, step: int) -> bool:
    """True (once) if fault ``kind`` is due at ``step`` on this rank."""
    for f in _FAULTS:
        if f.kind == kind and f.step == step and not f.fired and f.rank in (None, _rank()):
            f.fired = True
            return True
    return False


def at_step_check(step: int) -> None:
    """The optimizer-step check of ``step`` begins."""
    if take("sigstop", step):
        os.kill(os.getpid(), signal.SIGSTOP)
    if take("die", step):
        os.kill(os.getpid(), signal.SIGKILL)


def faulty_loss(loss_sum: torch.Tensor, step: int) -> torch.Tensor:
    """The first micro-batch's loss of ``step``, NaN or x50 when such a fault is due."""
    if take("nan_loss", step):
        return loss_sum * float("nan")
    if take("spike_loss", step):
        return loss_sum * 50.0
    return loss_sum


def faulty_gradients(local: list[torch.Tensor], step: int) -> None:
    """One gradient shard becomes +Inf when ``inf_grad`` is due at ``step``."""
    if local and take("inf_grad", step):
        local[0].view(-1)[0] = float("inf")


def install(spec: str) -> None:
    """Arm the faults of ``spec`` (``KIND@STEP[:RANK],...``) and install every hook: around the
    step guard's loss record and update check, and DCP's file streams (idempotent)."""
    _FAULTS[:] = parse(spec)
    install_guard_faults()
    install_checkpoint_faults()
    install_metrics_faults()


def _half_then_full(fd: int, data: bytes) -> int:
    """``os.write`` on a disk that fills: half of the bytes land, then ENOSPC."""
    os.write(fd, data[: max(1, len(data) // 2)])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def install_metrics_faults() -> None:
    """``JsonlLogger.log`` of a step with ``enospc_in_metrics`` due writes through a disk that
    fills half-way through the line (idempotent)."""
    from torchtitan_speechlm.components import metrics

    if getattr(metrics.JsonlLogger, "_speechlm_faults", False):
        return
    original = metrics.append_line

    def log(self, values, step):
        if not take("enospc_in_metrics", step):
            return original_log(self, values, step)
        row = {"step": step, **{k: float(v) for k, v in values.items()}}
        import json

        original(self._fd, json.dumps(row) + "\n", self.path, write=_half_then_full)

    original_log = metrics.JsonlLogger.log
    metrics.JsonlLogger.log = log
    metrics.JsonlLogger._speechlm_faults = True


def install_guard_faults() -> None:
    """Wrap ``StepGuard.note_loss`` (the first micro-batch's loss of a step may become NaN or a
    spike) and ``StepGuard.allow_update`` (a rank stops or dies as the check of a step begins;
    a gradient shard becomes +Inf before the check reads it) (idempotent)."""
    if getattr(StepGuard, "_speechlm_faults", False):
        return
    note_loss, allow_update = StepGuard.note_loss, StepGuard.allow_update

    def faulty_note_loss(self, loss_sum, labels):
        if self._loss is None:  # the first micro-batch of the step
            loss_sum = faulty_loss(loss_sum, self.step())
        return note_loss(self, loss_sum, labels)

    def faulty_allow_update(self, params):
        step = self.step()
        at_step_check(step)
        faulty_gradients(local_gradients(params), step)
        return allow_update(self, params)

    StepGuard.note_loss, StepGuard.allow_update = faulty_note_loss, faulty_allow_update
    StepGuard._speechlm_faults = True


class _FaultyStream:
    """A file stream that writes half of one write, then dies or reports a full disk."""

    def __init__(self, stream, kind: str, path: str):
        self._stream, self._kind, self._path = stream, kind, path

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._stream.write(view[: max(1, len(view) // 2)])
        self._stream.flush()
        if self._kind == "kill_in_save":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def install_checkpoint_faults() -> None:
    """Route DCP's file streams through ``_FaultyStream`` when a save fault is due (idempotent)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    if getattr(FileSystem, "_speechlm_faults", False):
        return
    original = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            m = _STEP_DIR.search(os.path.basename(os.path.dirname(str(path))))
            kind = None
            if m and "w" in mode and str(path).endswith(".distcp"):
                step = int(m.group(1))
                kind = next((k for k in ("kill_in_save", "enospc_in_save") if take(k, step)), None)
            yield _FaultyStream(stream, kind, str(path)) if kind else stream

    FileSystem.create_stream = create_stream
    FileSystem._speechlm_faults = True


if os.environ.get(ENV):  # a training run's custom_import (RUN_ARGS): arm what it asks for
    install(os.environ[ENV])
