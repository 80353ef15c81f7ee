"""Is an exception a failed collective (a peer hung or dead), and which collective was it?

Read from the exception alone (its type, its words, its stack), so both the rank's last words
(trainer/faults.py) and the checkpoint-save workaround (utils/compat.py) can tell a dead peer from a bug.
"""

from __future__ import annotations

import os
import traceback

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
