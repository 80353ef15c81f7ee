"""How a training rank ends on a fault the user can act on: one line, no traceback.

A multi-day run that stops should say why in words a user can act on: which file, key, step,
sample or rank, and what to do. Tracebacks stay for what is a bug (an exception not listed
here). ``exit_on_user_fault`` wraps a rank's run (launch.run_worker): it prints
``torchtitan train: rank R: <message>`` and ends the process with status 1 without
interpreter teardown (gloo threads may still be blocked in a collective with a dead peer).

Collective failures (a peer hung past ``comm.*_timeout_seconds``, or dead) are rewritten to
name the collective (from the stack) and the peer ranks that stopped beating
(components/heartbeat.py): by the trainer, which owns the run's heartbeat
(``CollectiveFailure``), or here, without one, for a failure before training starts.

A full disk (``ENOSPC`` anywhere in the exception's chain, from any file the run writes:
``metrics.jsonl``, a checkpoint, a record, a log) is one line too (``disk_full_message``): the
file, the free space, the newest complete checkpoint a rerun resumes from.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from contextlib import contextmanager

from torchtitan_speechlm.components.heartbeat import Heartbeat
from torchtitan_speechlm.components.nonfinite import NonFiniteError
from torchtitan_speechlm.components.resume import ResumeError
from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.format import CorruptDatasetError
from torchtitan_speechlm.data.lengths import DataLengthError
from torchtitan_speechlm.data.sampler import StreamResumeError
from torchtitan_speechlm.model.run_record import RunRecordError
from torchtitan_speechlm.model.vocab import VocabMismatchError
from torchtitan_speechlm.trainer import lifecycle
from torchtitan_speechlm.utils.collective_errors import collective_of, is_collective_failure
from torchtitan_speechlm.utils.compat import CheckpointSaveError


class CollectiveFailure(RuntimeError):
    """A collective failed; the message names it and the silent peer rank(s)."""


def user_fault_types() -> tuple[type[BaseException], ...]:
    """Exceptions whose message already says what happened and what to do."""
    return (
        ConfigError,
        CorruptDatasetError,
        RunRecordError,
        ResumeError,
        VocabMismatchError,
        DataLengthError,
        StreamResumeError,
        NonFiniteError,
        CheckpointSaveError,
        CollectiveFailure,
    )


def is_unexplained_collective_failure(exc: BaseException) -> bool:
    """A failed collective that none of our own errors explains yet. A checkpoint save that a
    dead peer broke already says so (``CheckpointSaveError``, whose words name the backend's
    error): rewriting it would lose what it says about the checkpoint, and reading the
    heartbeats first gives the launcher time to end this rank before it says anything."""
    return not isinstance(exc, user_fault_types()) and is_collective_failure(exc)


def describe_collective_failure(exc: BaseException, heartbeat: Heartbeat | None) -> str:
    """What failed and which peer went silent (``heartbeat``: the run's; None before one
    started: no peer can be named)."""
    rank = os.environ.get("RANK", "0")
    # said at once: the launcher may end this process while the heartbeats are read
    print(
        f"torchtitan train: rank {rank}: collective {collective_of(exc)} failed; looking for "
        "the silent peer rank",
        file=sys.stderr,
        flush=True,
    )
    stale = heartbeat.silent_ranks() if heartbeat is not None else []
    if stale:
        who = f"rank(s) {', '.join(map(str, stale))} stopped responding (hung or dead)"
    elif stale is None:
        who = "a peer rank stopped responding (hung or dead; the heartbeat store is gone too)"
    else:
        who = "no peer was silent: the network or the backend failed"
    first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return (
        f"collective {collective_of(exc)} failed on rank {rank}: {who}. Backend said: "
        f"{first_line}. The wait is bounded by comm.train_timeout_seconds (after step 1) and "
        "comm.init_timeout_seconds (before); rerun to resume from the newest checkpoint, after "
        "checking the named rank's host"
    )


def full_disk_error(exc: BaseException) -> OSError | None:
    """The ``ENOSPC`` (or ``EDQUOT``: a quota) OSError in ``exc``'s chain, if any."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        e = e.__cause__ or e.__context__
    return None


def disk_full_message(error: OSError) -> str:
    """One line: which file, the disk's free space, and the checkpoint a rerun resumes from."""
    name = error.filename or "a file of the run"
    where = os.path.dirname(os.path.abspath(error.filename)) if error.filename else "."
    while not os.path.isdir(where) and where != os.path.dirname(where):
        where = os.path.dirname(where)
    try:
        free = f", {shutil.disk_usage(where).free / 2**20:.1f} MiB free"
    except OSError:
        free = ""
    resume = lifecycle.resume_hint(lifecycle.tracked_checkpoints())
    return (f"the disk is full (ENOSPC{free}) writing {name}. Free space on that disk (or point "
            f"job.dump_folder elsewhere, lower checkpoint.keep_latest_k): {resume}")  # fmt: skip


@contextmanager
def exit_on_user_fault():
    """Run a rank; on a user fault print one line and end the process with status 1."""
    try:
        yield
    except BaseException as e:  # DCP wraps some failures in a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        full = full_disk_error(e) if not isinstance(e, user_fault_types()) else None
        if isinstance(e, user_fault_types()):
            message = str(e)
        elif full is not None:
            message, e = disk_full_message(full), full
        elif is_unexplained_collective_failure(e):
            message = describe_collective_failure(e, None)
        else:
            raise
        rank = os.environ.get("RANK", "0")
        # a collective failure the trainer described is named by what the backend raised
        kind = e.__cause__ if isinstance(e, CollectiveFailure) and e.__cause__ else e
        print(f"torchtitan train: rank {rank}: {type(kind).__name__}: {message}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
