"""A worker process that ends when the process it works for has ended.

``concurrent.futures.ProcessPoolExecutor``'s workers wait on a queue that only the process that
made the pool feeds, and the executor's own watch on its workers lives in that process. When it
ends without shutting the pool down (SIGTERM with Python's default handler, SIGKILL, the OOM
killer), its workers wait for ever. Under a forkserver (``prepare/run.py``'s ``worker_context``)
their parent is the forkserver, which itself lives as long as a worker holds its pipe, so
``PR_SET_PDEATHSIG`` cannot name the right process either.

Measured: ``torchtitan prepare --workers 2`` ended by ``kill`` left its forkserver and both
workers waiting, 0.9 GB resident, 40 minutes later. With :func:`exit_when_gone` called in each
worker they end as soon as the prepare process has (tests/integration/test_prepare_workers.py).
"""

from __future__ import annotations

import os
import select
import threading
import time

POLL_S = 1.0  # where a pidfd cannot be opened: how often the process is looked for


def exit_when_gone(pid: int, code: int = 1) -> None:
    """End this process (``os._exit(code)``) once process ``pid`` has ended: at once where Linux
    gives a pidfd of it (5.3 and later), else within ``POLL_S``. Runs in a daemon thread."""
    if pid == os.getpid():
        return
    threading.Thread(target=_watch, args=(pid, code), name="exit-when-gone", daemon=True).start()


def _watch(pid: int, code: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # it ended before this process started watching
        os._exit(code)
    except (AttributeError, OSError):  # not Linux, or a kernel without pidfd_open
        fd = None
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has ended
        os._exit(code)
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(code)
        except PermissionError:  # it exists (another user's reused pid: nothing to decide)
            pass
        time.sleep(POLL_S)
