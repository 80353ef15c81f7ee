"""A run's hold on its dump folder, and how its processes end.

One run per dump folder. ``kill -9`` of the launcher left its ranks training, and a second run
in the same folder loaded a checkpoint they had just written and trained beside them (two
writers of ``metrics.jsonl`` and of every checkpoint). Two advisory locks (``flock``: the
kernel releases them when the holder dies, also on ``kill -9``):

- ``{dump}/.speechlm-run.lock``: the launcher's, exclusive (``hold_run_folder``). A rank
  started without it (torchrun or srun starting ``torchtitan train`` on every rank) takes it
  shared, so a launcher and such a job exclude each other too.
- ``{dump}/.speechlm-ranks.lock``: every rank's, shared (``hold_as_rank``). A launcher, before
  it starts ranks, tries it exclusively: a rank of an earlier run still alive makes it fail.

A refused run names the holder's host and PID (written into the lock file) and exits 2.

Ranks die with their launcher: each rank of ``torchtitan train --nproc-per-node N`` asks the
kernel for SIGKILL when its parent (the launcher, which runs torch's elastic agent in-process)
dies (``prctl(PR_SET_PDEATHSIG)``), so nothing is written after the launcher is gone.

Ctrl-C and SIGTERM (``stop_on_signals``): a rank ends at once, without a traceback, and rank 0
records the step it reached in ``{dump}/.speechlm-stopped.json``; the launcher prints one line
(the signal, that step, the newest complete checkpoint to resume from) and exits 128 + signal
(130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import threading

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.utils.checkpoint_folders import complete_checkpoints
from torchtitan_speechlm.utils.checkpoint_manifest import LEGACY, verify

RUN_LOCK = ".speechlm-run.lock"
RANKS_LOCK = ".speechlm-ranks.lock"
STOPPED = ".speechlm-stopped.json"
LAUNCHER_ENV = "TORCHTITAN_SPEECHLM_LAUNCHER_PID"
_HELD: list[int] = []  # the launcher's lock, kept open for the life of the run
_RANK_HELD: list[int] = []  # this rank's


def _drop_inherited_locks() -> None:
    """In a forked child (a DataLoader worker of a rank, a rank forked by a test harness): let
    go of the copies of the parent's lock descriptors. A ``flock`` lasts while any descriptor
    of it is open, so a worker outliving its rank by the seconds its parent-watchdog takes
    would otherwise keep the folder locked and refuse the rerun."""
    for held in (_HELD, _RANK_HELD):
        while held:
            try:
                os.close(held.pop())
            except OSError:
                pass


os.register_at_fork(after_in_child=_drop_inherited_locks)
PR_SET_PDEATHSIG = 1


class RunFolderBusy(ConfigError):
    """Another run holds the dump folder."""


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        text = ""
    return text or "a process that did not say who it is"


def _lock(path: str, how: int) -> int | None:
    """An open descriptor holding ``how`` on ``path``; None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _say_who(fd: int, role: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{role} on host {socket.gethostname()}, PID {os.getpid()}\n".encode(), 0)


def _busy(dump: str, path: str, what: str) -> RunFolderBusy:
    return RunFolderBusy(
        f"job.dump_folder {dump} is in use by another run: {what} ({_holder(path)}) holds "
        f"{path}. Two runs in one folder would overwrite each other's checkpoints and metrics: "
        "wait for it to end, stop it (kill that PID), or choose another job.dump_folder"
    )


def hold_run_folder(dump: str) -> bool:
    """The launcher's: take the folder for this run or raise ``RunFolderBusy`` naming the
    holder. Held until this process ends. Returns whether the folder was made for it (a run
    refused by a later check then leaves nothing: ``leave_new_folder``)."""
    made = not os.path.isdir(dump)
    os.makedirs(dump, exist_ok=True)
    run_lock = os.path.join(dump, RUN_LOCK)
    release()  # this process's earlier run (an in-process call) is over
    fd = _lock(run_lock, fcntl.LOCK_EX)
    if fd is None:
        raise _busy(dump, run_lock, "its launcher")
    ranks_lock = os.path.join(dump, RANKS_LOCK)
    probe = _lock(ranks_lock, fcntl.LOCK_EX)
    if probe is None:  # ranks of an earlier run outlived their launcher
        os.close(fd)
        raise _busy(dump, ranks_lock, "a training process")
    os.close(probe)
    _say_who(fd, "torchtitan train (launcher)")
    _HELD.append(fd)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    return made


def leave_new_folder(dump: str) -> None:
    """Let go of a folder ``hold_run_folder`` made for a run that did not start: its lock
    files go, and the folder too if nothing else was put in it."""
    release()
    for name in (RUN_LOCK, RANKS_LOCK):
        try:
            os.remove(os.path.join(dump, name))
        except OSError:
            pass
    try:
        os.rmdir(dump)
    except OSError:
        pass


def hold_as_rank(dump: str, rank: int) -> None:
    """A rank's: a shared hold on the ranks' lock (and, for a rank started without our
    launcher, on the run lock)."""
    os.makedirs(dump, exist_ok=True)
    if os.environ.get(LAUNCHER_ENV) is None:
        run_lock = os.path.join(dump, RUN_LOCK)
        fd = _lock(run_lock, fcntl.LOCK_SH)
        if fd is None:
            raise _busy(dump, run_lock, "its launcher")
        _RANK_HELD.append(fd)
    ranks_lock = os.path.join(dump, RANKS_LOCK)
    fd = _lock(ranks_lock, fcntl.LOCK_SH)
    if fd is None:
        raise _busy(dump, ranks_lock, "a launcher starting")
    if rank == 0:
        _say_who(fd, "rank 0")
    _RANK_HELD.append(fd)


def release_rank() -> None:
    """A rank lets go (its trainer closed; a process that ends lets go anyway)."""
    while _RANK_HELD:
        os.close(_RANK_HELD.pop())


def release() -> None:
    """The launcher lets go (an in-process call that ended)."""
    release_rank()
    while _HELD:
        os.close(_HELD.pop())
    os.environ.pop(LAUNCHER_ENV, None)


def die_with_launcher() -> None:
    """A rank started by our launcher gets SIGKILL when the launcher dies (Linux; elsewhere a
    no-op). The launcher is this process's parent: the elastic agent runs inside it."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher or not sys.platform.startswith("linux") or int(launcher) == os.getpid():
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def newest_checkpoint(folder: str) -> str | None:
    """The newest complete checkpoint whose save was confirmed (sizes checked, not sums)."""
    for step in reversed(complete_checkpoints(folder)):
        path = os.path.join(folder, f"step-{step}")
        if verify(path, checksums=False) in ("", LEGACY):
            return path
    return None


def resume_hint(ckpt_folder: str | None) -> str:
    """Where a rerun of the same command starts: the newest complete checkpoint, or step 1."""
    newest = newest_checkpoint(ckpt_folder) if ckpt_folder else None
    if newest:
        return (
            f"the newest complete checkpoint is {newest}: rerun the same command to resume from it"
        )
    return "there is no complete checkpoint yet: a rerun starts from step 1"


def stop_line(signum: int, step: int | None, ckpt_folder: str | None) -> str:
    name = signal.Signals(signum).name
    reached = f"at step {step}" if step else "before its first step"
    return f"stopped by {name} {reached}; {resume_hint(ckpt_folder)}"


_RUN: dict = {"dump": None, "checkpoints": None, "step": lambda: None}


def track_run(dump: str, ckpt_folder: str | None, current_step) -> None:
    """What a stop reports: the dump folder, the checkpoint folder, ``current_step()``."""
    _RUN.update(dump=dump, checkpoints=ckpt_folder, step=current_step)


def tracked_checkpoints() -> str | None:
    """The checkpoint folder of the run this rank trains (``track_run``), if known."""
    return _RUN["checkpoints"]


def stop_on_signals():
    """SIGINT / SIGTERM end this rank at once, without a traceback. Rank 0 records the step
    reached for the launcher; a run of one process (no launcher above it) prints the line
    itself. A training rank's (commands/train.py ``run_worker``), not the Python API's.
    Returns what puts the previous handlers back (an in-process run that ended)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # Python sets signal handlers from the main thread only
    rank = int(os.environ.get("RANK", "0"))
    alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
    # Both paths below can deliver the same signal: the first one reports and exits; the other
    # waits for that exit. Without this, the second one's open(..., "w") could empty the file
    # the first had written just before its os._exit (the launcher then read no step).
    first = threading.Lock()

    def handler(signum, frame):
        if not first.acquire(blocking=False):
            threading.Event().wait()  # the first handler ends the process
        try:
            step = _RUN["step"]()
            if alone:
                line = stop_line(signum, step, _RUN["checkpoints"])
                print(f"torchtitan train: {line}", file=sys.stderr)
            elif rank == 0 and _RUN["dump"]:
                with open(os.path.join(_RUN["dump"], STOPPED), "w") as f:
                    json.dump({"signal": signum, "step": step}, f)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signum)

    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    # Python runs ``handler`` in the main thread between bytecodes, so not while it waits in a
    # collective or a long kernel; the C-level handler writes the signal number into this pipe
    # at once, and a thread ends the rank from there.
    r, w = os.pipe()
    os.set_blocking(w, False)
    wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            try:
                got = os.read(r, 1)
            except OSError:
                return  # restored: the pipe is closed
            if not got:
                return
            if got[0] in (signal.SIGINT, signal.SIGTERM):
                handler(got[0], None)

    threading.Thread(target=watch, name="speechlm-stop", daemon=True).start()

    def restore() -> None:
        signal.set_wakeup_fd(wakeup)
        for sig, previous in before.items():
            signal.signal(sig, previous)
        os.close(w)

    return restore


class _NoAgentSignalWarning(logging.Filter):
    """torchrun's agent warns ``Received 2 death signal, shutting down workers`` when the
    launcher is stopped; the launcher's one line (``stop_line``) says it with the step and the
    checkpoint to resume from, so the agent's is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal" not in record.getMessage()


AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


def quiet_agent_signal_warning() -> None:
    """Install ``_NoAgentSignalWarning`` on torchrun's agent logger (once)."""
    agent = logging.getLogger(AGENT_LOGGER)
    if not any(isinstance(f, _NoAgentSignalWarning) for f in agent.filters):
        agent.addFilter(_NoAgentSignalWarning())


def stopped_step(dump: str) -> int | None:
    """The step rank 0 recorded when a signal stopped it (the launcher's line)."""
    try:
        with open(os.path.join(dump, STOPPED)) as f:
            return json.load(f).get("step")
    except (OSError, ValueError):
        return None


def forget_stop(dump: str) -> None:
    try:
        os.remove(os.path.join(dump, STOPPED))
    except OSError:
        pass
