"""``GET /metrics``: the server's Prometheus metrics, with ``prometheus_client``.

What an operator scrapes to size and alert on a speech server:

- ``speechlm_requests_total{route,status}`` and ``speechlm_request_seconds{route}`` (every
  answer, refusals included; the latency histogram from the first byte read to the last sent);
- ``speechlm_errors_total{kind}``: answers of status 5xx (``server``), 4xx (``client``) and the
  model's failed rows (``model``);
- ``speechlm_queue_depth`` (jobs waiting) and ``speechlm_batch_size{task}`` (rows per model
  call), ``speechlm_batch_seconds{task}`` (one batched model call);
- ``speechlm_generated_tokens_total{task}``: codec tokens generated (frames x codebooks) for
  ``tts``, and ``speechlm_tokens_per_second{task}``, the last batch's rate (a counter's
  ``rate()`` gives it over any window too);
- ``speechlm_rejected_total{reason}``: requests refused or dropped, by the ``code`` of the
  answer (``queue_full``, ``server_busy``, ``rate_limited``, ``input_too_long``,
  ``audio_too_long``, ``request_timeout``, ``client_gone``, ...; a connection closed by
  ``--header-timeout`` is ``header_timeout``);
- the process: prometheus_client's ``process_resident_memory_bytes`` (and CPU, open files),
  ``speechlm_process_peak_resident_memory_bytes`` (the kernel's high-water mark, VmHWM), and
  the model worker's ``speechlm_worker_busy`` (1 while a batch runs) and
  ``speechlm_worker_seconds_since_progress`` (since its last decode step, batch or idle wait:
  what ``/ready`` compares with ``--ready-timeout``).

With several replicas (``--replicas N``, serving/replicas.py) each is its own process: the
metrics are then kept in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode)
and any replica's ``/metrics`` sums them over all of them (the gauges: ``livesum``, the queue
depth of every live replica).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# a batch's generated tokens from its task, payloads and results (None: not counted)
TokenCount = Callable[[str, Sequence, Sequence], int | None]
# the worker's state: (seconds since its last progress, whether a batch is running)
WorkerState = Callable[[], tuple[float, bool]]


def peak_resident_bytes() -> int | None:
    """This process's peak resident memory (Linux's VmHWM), or None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _ProcessState:
    """Read at each scrape: the peak memory and the model worker's progress."""

    def __init__(self):
        self.worker: WorkerState | None = None

    def collect(self):
        peak = peak_resident_bytes()
        if peak is not None:
            yield GaugeMetricFamily("speechlm_process_peak_resident_memory_bytes",
                                    "peak resident memory of this process (VmHWM)", peak)  # fmt: skip
        if self.worker is not None:
            since, busy = self.worker()
            yield GaugeMetricFamily("speechlm_worker_seconds_since_progress",
                                    "seconds since the model worker last made progress", since)  # fmt: skip
            yield GaugeMetricFamily("speechlm_worker_busy", "1 while the model worker runs a "
                                    "batch", float(busy))  # fmt: skip


def multiprocess_mode() -> bool:
    """Whether the metrics are shared by several replica processes (their folder is set)."""
    return bool(os.environ.get(MULTIPROC_ENV))


class ServeMetrics:
    """The server's metric families in one registry (a fresh one per server: tests start
    several servers in one process)."""

    def __init__(self, tokens_of: TokenCount | None = None):
        self.tokens_of = tokens_of or (lambda task, payloads, results: None)
        self.registry = CollectorRegistry()
        shared = multiprocess_mode()
        # in multiprocess mode the values live in files; the registry only reads them back
        own = None if shared else self.registry
        live = {"multiprocess_mode": "livesum"} if shared else {}
        last = {"multiprocess_mode": "mostrecent"} if shared else {}
        self.requests = Counter("speechlm_requests", "HTTP answers by route and status",
                                ("route", "status"), registry=own)  # fmt: skip
        self.latency = Histogram("speechlm_request_seconds", "HTTP request latency (s)",
                                 ("route",), buckets=LATENCY_BUCKETS, registry=own)  # fmt: skip
        self.errors = Counter("speechlm_errors", "errors: server (5xx), client (4xx), model rows",
                              ("kind",), registry=own)  # fmt: skip
        self.queue = Gauge("speechlm_queue_depth", "jobs waiting for the model", registry=own,
                           **live)  # fmt: skip
        self.batch_size = Histogram("speechlm_batch_size", "rows per batch (joined rows included)",
                                    ("task",), buckets=BATCH_BUCKETS, registry=own)  # fmt: skip
        self.batch_seconds = Histogram("speechlm_batch_seconds", "one batch, start to end (s)",
                                       ("task",), buckets=LATENCY_BUCKETS, registry=own)  # fmt: skip
        self.tokens = Counter("speechlm_generated_tokens", "codec tokens generated",
                              ("task",), registry=own)  # fmt: skip
        self.tokens_per_s = Gauge("speechlm_tokens_per_second", "the last batch's tokens/s",
                                  ("task",), registry=own, **last)  # fmt: skip
        self.rejected = Counter("speechlm_rejected", "requests refused or dropped, by reason",
                                ("reason",), registry=own)  # fmt: skip
        if shared:
            multiprocess.MultiProcessCollector(self.registry)
        ProcessCollector(registry=self.registry)  # this process's (a replica's own, when several)
        self.process = _ProcessState()
        self.registry.register(self.process)

    def watch_worker(self, state: WorkerState) -> None:
        """Report the model worker's progress (the batcher's ``progress``)."""
        self.process.worker = state

    # ---- the HTTP layer ------------------------------------------------------------------
    def request(self, route: str, status: int, seconds: float, reason: str | None = None) -> None:
        """One answer (``route``: the route's path template, or ``other``; ``reason``: the
        code of a refusal)."""
        self.requests.labels(route, str(status)).inc()
        if reason and status >= 400:
            self.rejected.labels(reason).inc()
        self.latency.labels(route).observe(seconds)
        if status >= 500:
            self.errors.labels("server").inc()
        elif status >= 400:
            self.errors.labels("client").inc()

    # ---- the batcher (Batcher's on_queue / on_batch) -------------------------------------
    def queue_depth(self, depth: int) -> None:
        self.queue.set(depth)

    def batch(self, task: str, payloads: Sequence, results: Sequence | None,
              seconds: float, failed_rows: int) -> None:  # fmt: skip
        """One batched model call: its rows, time, failed rows and generated tokens."""
        self.batch_size.labels(task).observe(len(payloads))
        self.batch_seconds.labels(task).observe(seconds)
        if failed_rows:
            self.errors.labels("model").inc(failed_rows)
        tokens = self.tokens_of(task, payloads, results) if results is not None else None
        if tokens:
            self.tokens.labels(task).inc(tokens)
            self.tokens_per_s.labels(task).set(tokens / max(seconds, 1e-9))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def mark_replica_dead(pid: int) -> None:
    """A replica process has ended: its live gauges leave the sums (multiprocess mode)."""
    if multiprocess_mode():
        multiprocess.mark_process_dead(pid)
