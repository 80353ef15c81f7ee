"""The HTTP server of `torchtitan serve` (serving/app.py on uvicorn) over fake runners, in this
process or in a child process of its own (``python -m tests.fake_serve``), for the tests that
attack the server: no model, the real ASGI stack on a real socket.

The runners stand for a model's: ``tts`` speaks ``min(len(text), MAX_STEPS)`` steps of
``STEP_SAMPLES`` samples, ``step_s`` seconds each, asking ``emit.stopped(row)`` between steps
as the real decoder does (serving/speech.py), and counting the steps it ran (``GET /health``'s
``fake_steps``, through the batcher's stats); the texts ``crash`` / ``invalid`` make it raise
(RuntimeError: a 500; ValueError: a 400); ``gate`` holds a step until set. ``asr`` answers the
upload's sample count.

App and server settings that the code under test does not have are dropped with a line on
stderr (``settable``): the same test then runs against an older server and fails on what it
does, not on a missing argument.

The child: ``python -m tests.fake_serve '{"app": {...}, "server": {...}, "step_s": 0.05,
"memory_mb": 1500}'`` prints ``listening URL`` once it serves, and serves until SIGTERM.
``memory_mb``: its address space is limited (RLIMIT_AS) to that many MiB above what it uses
when it starts, so that a request that would take all the memory ends in a MemoryError in the
child rather than in the machine's OOM killer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time

import numpy as np

RATE = 8000
STEP_SAMPLES = 100
MAX_STEPS = 50


class FakeModel:
    """The runners (see the module's docstring)."""

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.steps = 0
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def tts(self, rows, emit):
        stopped = getattr(emit, "stopped", lambda row: False)
        counts = []
        for row, r in enumerate(rows):
            if r.text == "crash":
                raise RuntimeError("the decoder fell over")
            if r.text == "invalid":
                raise ValueError("this text is too long for the model")
            n = 0
            for _ in range(min(len(r.text), MAX_STEPS)):
                if stopped(row):
                    break
                self.entered.set()
                self.gate.wait(60)
                time.sleep(self.step_s)
                self.steps += 1
                n += 1
                emit(row, np.full(STEP_SAMPLES, 0.1, np.float32))
            counts.append(n * STEP_SAMPLES)
        return counts

    def asr(self, rows, emit):
        return [f"{len(r.wave)} samples" for r in rows]


def settable(cls, kwargs: dict) -> dict:
    """``kwargs`` that ``cls`` takes (a dataclass's fields or its constructor's parameters)."""
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
    else:
        names = set(inspect.signature(cls).parameters)
    dropped = sorted(set(kwargs) - names)
    if dropped:
        print(f"fake_serve: this server has no {', '.join(dropped)}: not set", file=sys.stderr)
    return {k: v for k, v in kwargs.items() if k in names}


def build(app_kw: dict | None = None, server_kw: dict | None = None, step_s: float = 0.0,
          queue_size: int = 4, max_batch: int = 2, lines: list | None = None,
          said: list | None = None):  # fmt: skip
    """(server, batcher, model, access-log lines, error lines), not started."""
    from torchtitan_speechlm.serving.app import App
    from torchtitan_speechlm.serving.batcher import Batcher
    from torchtitan_speechlm.serving.metrics import ServeMetrics
    from torchtitan_speechlm.serving.server import SpeechServer

    model = FakeModel(step_s)
    batcher = Batcher({"tts": model.tts, "asr": model.asr}, queue_size=queue_size,
                      max_batch=max_batch, batch_wait_s=0)  # fmt: skip
    stats = batcher.stats
    batcher.stats = lambda: {**stats(), "fake_steps": model.steps}  # type: ignore[method-assign]
    lines = [] if lines is None else lines
    said = [] if said is None else said
    kw = {"max_upload_bytes": 1 << 20, "metrics": None, **(app_kw or {})}
    if "requests_per_minute" in kw:  # (JSON settings of the child: the limits as a number)
        from torchtitan_speechlm.serving.gate import RateLimits

        kw["rate_limits"] = RateLimits(kw.pop("requests_per_minute"))
    if kw.pop("with_metrics", False):
        kw["metrics"] = ServeMetrics()
        batcher.on_queue, batcher.on_batch = kw["metrics"].queue_depth, kw["metrics"].batch
    app = App(batcher, "fake", RATE, RATE, log=lines.append, say=said.append,
              **settable(App, kw))  # fmt: skip
    server = SpeechServer(app, "127.0.0.1", 0, **settable(SpeechServer, server_kw or {}))
    return server, batcher, model, lines, said


@contextlib.contextmanager
def serving(app_kw: dict | None = None, server_kw: dict | None = None, **kw):
    """``build``'s server started in this process: (server, model, lines, said)."""
    server, batcher, model, lines, said = build(app_kw, server_kw, **kw)
    batcher.start()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield server, model, lines, said
    finally:
        model.gate.set()
        server.shutdown(10)
        server.server_close()
        batcher.stop()


class Child:
    """``python -m tests.fake_serve SETTINGS`` started and listening: ``url``, ``proc``,
    ``lines`` (its stdout), ``peak_mb()`` (its VmHWM)."""

    def __init__(self, settings: dict, wait_s: float = 60.0):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   OPENBLAS_NUM_THREADS="1", MALLOC_ARENA_MAX="2",
                   PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fake_serve", json.dumps(settings)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        self.lines: list[str] = []
        got = threading.Event()
        self.url = ""

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if line.startswith("listening "):
                    self.url = line.split()[1]
                    got.set()
            got.set()

        threading.Thread(target=read, daemon=True).start()
        if not got.wait(wait_s) or not self.url:
            self.close()
            raise RuntimeError("the fake server did not start:\n" + "\n".join(self.lines[-20:]))
        self.address = tuple(self.url.rsplit("/", 1)[1].split(":"))
        self.address = (self.address[0], int(self.address[1]))

    def status_kb(self, field: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise KeyError(field)

    def peak_mb(self) -> float:
        return self.status_kb("VmHWM") / 1024

    def rss_mb(self) -> float:
        return self.status_kb("VmRSS") / 1024

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _limit_memory(extra_mb: int) -> None:
    """RLIMIT_AS: what the process maps now plus ``extra_mb``."""
    with open("/proc/self/status") as f:
        vm = next(int(x.split()[1]) for x in f if x.startswith("VmSize:")) * 1024
    limit = vm + (extra_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(argv: list[str]) -> int:
    settings = json.loads(argv[0]) if argv else {}

    class Printing(list):
        def append(self, line):
            print(line, flush=True)

    server, batcher, model, _, _ = build(
        settings.get("app"), settings.get("server"), settings.get("step_s", 0.0),
        settings.get("queue_size", 4), settings.get("max_batch", 2), Printing(), Printing(),
    )  # fmt: skip
    if settings.get("memory_mb"):
        _limit_memory(int(settings["memory_mb"]))
    batcher.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    while not server.server.started:
        time.sleep(0.01)
    print(f"listening {server.url}", flush=True)
    while thread.is_alive() and not stop.wait(0.2):
        pass
    server.shutdown(10)
    server.server_close()
    batcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
