"""``torchtitan serve --replicas N``: N server processes, each its own model on its own device,
behind one port.

The supervisor (this process) binds the port once and starts N replica processes (spawned:
each a fresh interpreter, as CUDA needs) that all accept on that socket, so the kernel spreads
the connections over them; a replica that is busy decoding accepts less. Each replica loads
the model onto its device (``replica_device``: ``cuda`` -> ``cuda:i``; a list -> its i-th
entry; ``cpu`` -> the CPU, its cores shared out) and runs the whole server of
commands/serve.py: its own batcher, queue and limits. Metrics are kept in one folder
(prometheus_client's multiprocess mode, serving/metrics.py), so any replica's ``/metrics`` is
the sum over all of them.

Start-up: each replica reports ready or its error on a queue; the supervisor prints the URL
when all are ready, or stops the others and exits 2 with the first error. SIGTERM / Ctrl-C:
forwarded to every replica, each drains (finishes its requests in flight) and exits; the
supervisor exits 0 when all have. A replica that dies while serving is started again (its
requests in flight are lost; the others' are not), at most ``MAX_RESTARTS`` times.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable

from torchtitan_speechlm.serving.metrics import MULTIPROC_ENV, mark_replica_dead

MAX_RESTARTS = 3
READY_TIMEOUT_S = 600.0

# replica_main(args, sock, index, device, threads, ready): serve until SIGTERM; ``ready.put(
# (index, None))`` once listening, ``(index, message)`` on a start-up error
ReplicaMain = Callable[..., None]


def replica_device(device: str, index: int) -> str:
    """The device of replica ``index``: ``cuda`` -> ``cuda:index``; ``a,b,...`` -> the
    index-th entry (round robin); anything else as given."""
    devices = [d.strip() for d in device.split(",") if d.strip()]
    if len(devices) > 1:
        return devices[index % len(devices)]
    one = devices[0] if devices else "cpu"
    return f"{one}:{index}" if one in ("cuda", "xpu") else one


def cpu_threads(n_replicas: int) -> int:
    """Intra-op threads per replica: the cores shared out (CPU replicas)."""
    return max(1, (os.cpu_count() or 1) // n_replicas)


class Replicas:
    """The supervisor of ``n`` replica processes on one listening socket."""

    def __init__(self, n: int, sock: socket.socket, main: ReplicaMain, args, device: str,
                 say: Callable[[str], None] = print):  # fmt: skip
        self.n, self.sock, self.main, self.args, self.device = n, sock, main, args, device
        self.say = say
        self.ctx = mp.get_context("spawn")
        self.ready: mp.Queue = self.ctx.Queue()
        self.procs: dict[int, mp.Process] = {}
        self.restarts = 0
        self.stopping = threading.Event()
        self.metrics_dir: str | None = None

    def _start(self, i: int) -> None:
        device = replica_device(self.device, i)
        threads = cpu_threads(self.n) if device.startswith("cpu") else 0
        p = self.ctx.Process(
            target=self.main,
            args=(self.args, self.sock, i, device, threads, self.ready),
            name=f"serve-replica-{i}",
        )
        p.start()
        self.procs[i] = p

    def start(self) -> str | None:
        """Start every replica and wait until all listen: None, or the first start-up error
        (then the others are stopped)."""
        if not os.environ.get(MULTIPROC_ENV):  # the replicas inherit it
            self.metrics_dir = tempfile.mkdtemp(prefix="speechlm-serve-metrics-")
            os.environ[MULTIPROC_ENV] = self.metrics_dir
        for i in range(self.n):
            self._start(i)
        waiting, deadline = set(range(self.n)), time.monotonic() + READY_TIMEOUT_S
        while waiting:
            try:
                i, error = self.ready.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i in waiting if not self.procs[i].is_alive()]
                if dead or time.monotonic() > deadline:
                    error = (f"replica {dead[0]} exited with status "
                             f"{self.procs[dead[0]].exitcode} before listening"
                             if dead else f"replicas {sorted(waiting)} not ready in "
                             f"{READY_TIMEOUT_S:.0f} s")  # fmt: skip
                    self.stop()
                    return error
                continue
            if error is not None:
                self.stop()
                return f"replica {i}: {error}"
            waiting.discard(i)
        return None

    def watch(self) -> None:
        """Until ``stopping`` is set: start again a replica that died (not one told to stop)."""
        while not self.stopping.wait(0.5):
            for i, p in list(self.procs.items()):
                if p.is_alive() or self.stopping.is_set():
                    continue
                mark_replica_dead(p.pid)
                if self.restarts >= MAX_RESTARTS:
                    self.say(f"replica {i} exited with status {p.exitcode}; not restarted "
                             f"(already {self.restarts} restarts)")  # fmt: skip
                    self.procs.pop(i)
                    continue
                self.restarts += 1
                self.say(f"replica {i} exited with status {p.exitcode}; starting it again")
                self._start(i)

    def stop(self, timeout: float = 660.0) -> int:
        """SIGTERM every replica (each drains), wait for them: 0 if all exited cleanly."""
        self.stopping.set()
        for p in self.procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        status, deadline = 0, time.monotonic() + timeout
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
            status = status or (p.exitcode != 0)
            mark_replica_dead(p.pid)
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            os.environ.pop(MULTIPROC_ENV, None)
        return int(status)
