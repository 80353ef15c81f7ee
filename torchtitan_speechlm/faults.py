"""How a training rank ends on a fault the user can act on: one line, no traceback.

A multi-day run that stops should say why in words a user can act on: which file, key, step,
sample or rank, and what to do. Tracebacks stay for what is a bug (an exception not listed
here). ``exit_on_user_fault`` wraps a rank's run (launch.run_worker): it prints
``torchtitan train: rank R: <message>`` and ends the process with status 1 without
interpreter teardown (gloo threads may still be blocked in a collective with a dead peer).

Collective failures (a peer hung past ``comm.*_timeout_seconds``, or dead) are rewritten to
name the collective (from the stack) and the peer ranks that stopped beating
(components/heartbeat.py).
"""

from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager

# words of gloo / NCCL / c10d errors raised when a peer is gone or does not answer
_COLLECTIVE_WORDS = (
    "timed out",
    "timeout",
    "connection reset",
    "connection closed",
    "broken pipe",
    "socket",
    "gloo",
    "nccl",
    "closed by peer",
)
_COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_to_all_single",
    "all_to_all",
    "send",
    "recv",
    "gather",
    "scatter",
)


def user_fault_types() -> tuple[type[BaseException], ...]:
    """Exceptions whose message already says what happened and what to do."""
    from torchtitan_speechlm.compat import CheckpointSaveError
    from torchtitan_speechlm.components.nonfinite import NonFiniteError
    from torchtitan_speechlm.components.resume import ResumeError
    from torchtitan_speechlm.config import ConfigError
    from torchtitan_speechlm.data.stream import DataLengthError, StreamResumeError
    from torchtitan_speechlm.dataset_format import CorruptDatasetError
    from torchtitan_speechlm.model.vocab import VocabMismatchError
    from torchtitan_speechlm.run_record import RunRecordError

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
    )


def is_collective_failure(exc: BaseException) -> bool:
    """A distributed backend error (not our own code's RuntimeError)."""
    import torch.distributed as dist

    backend_errors = tuple(
        t for t in (getattr(dist, "DistBackendError", None), getattr(dist, "DistError", None)) if t
    )
    if backend_errors and isinstance(exc, backend_errors):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _COLLECTIVE_WORDS)


def collective_of(exc: BaseException) -> str:
    """The collective the failure happened in, with the code that called it, from the stack."""
    frames = traceback.extract_tb(exc.__traceback__)
    name, caller = None, None
    for i, frame in enumerate(frames):
        path = frame.filename.replace("\\", "/")
        if frame.name in _COLLECTIVES and "torch/distributed" in path:
            name = frame.name
            for outer in reversed(frames[:i]):
                p = outer.filename.replace("\\", "/")
                if "torch/distributed/distributed_c10d" not in p and "c10d_logger" not in p:
                    caller = f"{outer.name} ({os.path.basename(p)}:{outer.lineno})"
                    break
    if name is None:  # FSDP2 waits on the work of an all-gather / reduce-scatter it issued
        for frame in reversed(frames):
            path = frame.filename.replace("\\", "/")
            if "torch/distributed" in path:
                return f"{frame.name} ({os.path.basename(path)}:{frame.lineno})"
        return "a collective"
    return f"{name} called from {caller}" if caller else name


def describe_collective_failure(exc: BaseException) -> str:
    from torchtitan_speechlm.components.heartbeat import HEARTBEAT

    rank = os.environ.get("RANK", "0")
    # said at once: the launcher may end this process while the heartbeats are read
    print(
        f"torchtitan train: rank {rank}: collective {collective_of(exc)} failed; looking for "
        "the silent peer rank",
        file=sys.stderr,
        flush=True,
    )
    stale = HEARTBEAT.silent_ranks()
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


@contextmanager
def exit_on_user_fault():
    """Run a rank; on a user fault print one line and end the process with status 1."""
    try:
        yield
    except BaseException as e:  # DCP wraps some failures in a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(e, user_fault_types()):
            message = str(e)
        elif is_collective_failure(e):
            message = describe_collective_failure(e)
        else:
            raise
        rank = os.environ.get("RANK", "0")
        print(f"torchtitan train: rank {rank}: {type(e).__name__}: {message}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
