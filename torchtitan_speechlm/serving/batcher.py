"""The model worker: one thread owns the model and runs its jobs in dynamic batches.

Request threads ``submit`` a job (a task name, a payload and whose it is: a key's name or a
client address) to a bounded queue: a full queue, or a key that already holds
``max_queued_per_key`` of its places, raises :class:`QueueFull` at once (the HTTP layer answers
503 with Retry-After). The worker takes the oldest job, then waits up to ``batch_wait_s`` for
more jobs *of the same task* (from anywhere in the queue; other tasks keep their place), up to
``max_batch`` rows, taken one per key in turn (so one client's flood of requests shares each
batch with the others' instead of filling it), and makes ONE call of that task's runner for the
whole batch. A runner is::

    runner(payloads: list, emit: Callable[[int, object], None]) -> list  # one result per row

``emit(row, piece)`` hands a row's partial output (a chunk of audio) to its job while the batch
is still running: a streamed response writes it at once. A runner that decodes step by step may
batch continuously (speech: serving/speech.py): between two steps ``emit.take()`` hands it queued
jobs of its task, which join the batch as its next rows (fairly, up to ``max_batch`` rows
running; none once a job of another task waits, so that the batch ends), and
``emit.finish(row, value)`` answers a row the step it completes rather than at the batch's end. If the batched call raises, each row
that has emitted nothing yet runs again alone, so that one bad row fails only its own job (a
row whose output had begun to stream fails with the batch's error: its start cannot be taken
back). No exception of a runner ends the worker.

``workers`` > 1 runs that many worker threads, each taking and running its own batches: for
runners whose model is elsewhere (``--engine vllm``: a batch is an HTTP request, and the engine
batches the requests in flight together); our own model has one worker.

**Cancelling.** A job whose request is gone (its client left, or the drain ran out of time) is
cancelled: it leaves the queue at once, or, running, is told so through the runner's ``emit``
(an ``Emit``): ``emit.stopped(row)``, which a runner asks between decode steps to drop that
row's work (serving/speech.py; a runner that never asks runs its rows to the end, unused). Each
such question, each piece emitted and each batch's start and end is the worker's *progress*,
which ``progress()`` reports (``/ready``, the stall metric).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

Runner = Callable[[list, Callable[[int, Any], None]], list]
# a continuous batch takes at most this many times max_batch rows in all, then drains and the
# next batch starts: what a batch keeps of its rows (their jobs, a runner's per-row state) and
# a batch's entry in the metrics stay bounded under a load that never pauses
JOINED_BATCHES = 16
# on_batch(task, payloads, results or None if the call failed, seconds, rows failed)
BatchHook = Callable[[str, list, "list | None", float, int], None]

_PIECE, _DONE, _ERROR = "piece", "done", "error"


class QueueFull(Exception):
    """The job queue holds ``queue_size`` jobs: try again later."""


class Cancelled(Exception):
    """The job was cancelled (its client left, or the drain ran out of time)."""


class Job:
    """One request's row: what the worker emits and its result or error, read by the request
    thread through ``stream()`` (the pieces as they come) or ``result()``."""

    def __init__(self, task: str, payload: Any, key: str | None = None):
        self.task, self.payload, self.key = task, payload, key
        self.batch_size = 0  # the batch it ran in (0 until it runs)
        self.value: Any = None
        self.cancelled = False
        self._events: queue.Queue = queue.Queue()
        self._closed = False

    def cancel(self, why: str = "the client left") -> None:
        """Stop waiting for this job: its reader gets ``Cancelled``; the worker skips it."""
        self.cancelled = True
        self.fail(Cancelled(why))

    # the worker's side
    def emit(self, piece: Any) -> None:
        if not self._closed:
            self._events.put((_PIECE, piece))

    def finish(self, value: Any) -> None:
        if not self._closed:
            self._closed = True
            self._events.put((_DONE, value))

    def fail(self, error: BaseException) -> None:
        if not self._closed:
            self._closed = True
            self._events.put((_ERROR, error))

    @property
    def done(self) -> bool:
        return self._closed

    # the request thread's side
    def stream(self, timeout: float | None = None) -> Iterator[Any]:
        """The emitted pieces in order; then the result is in ``value``, or the row's error is
        raised (TimeoutError if nothing came for ``timeout`` seconds)."""
        while True:
            try:
                kind, item = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no answer from the model worker in {timeout} s") from None
            if kind == _PIECE:
                yield item
            elif kind == _DONE:
                self.value = item
                return
            else:
                raise item

    def result(self, timeout: float | None = None) -> Any:
        for _ in self.stream(timeout):
            pass
        return self.value


class Emit:
    """A runner's ``emit`` for one batch: ``emit(row, piece)`` hands a piece to the row's job;
    ``emit.stopped(row)``: whether that row's job was cancelled. Both count as progress.

    For a runner that batches continuously: ``emit.take(room)``, the payloads of up to
    ``room`` (default: up to ``max_batch`` rows running) queued jobs of the batch's task, which join the batch as its next rows (none once
    a job of another task waits, so that the batch ends and that job runs next);
    ``emit.finish(row, value)`` / ``emit.fail(row, error)`` answer a row before the batch ends
    (its result in the list the runner returns is then not used)."""

    def __init__(self, jobs: list[Job], beat: Callable[[], None],
                 take: Callable[[int | None], list[Job]] | None = None):  # fmt: skip
        self.jobs, self.beat = jobs, beat
        self._take = take
        self.emitted: set[int] = set()

    def __call__(self, row: int, piece: Any) -> None:
        self.emitted.add(row)
        self.jobs[row].emit(piece)
        self.beat()

    def stopped(self, row: int) -> bool:
        self.beat()
        return self.jobs[row].cancelled

    def take(self, room: int | None = None) -> list:
        self.beat()
        if self._take is None or (room is not None and room < 1):
            return []
        return [job.payload for job in self._take(room)]

    def finish(self, row: int, value: Any) -> None:
        self.jobs[row].finish(value)
        self.beat()

    def fail(self, row: int, error: BaseException) -> None:
        self.jobs[row].fail(error)
        self.beat()


class Batcher:
    """The bounded job queue and the worker thread running ``runners[task]`` in batches."""

    def __init__(
        self,
        runners: dict[str, Runner],
        queue_size: int = 64,
        max_batch: int = 8,
        batch_wait_s: float = 0.01,
        on_error: Callable[[str, BaseException], None] | None = None,
        on_queue: Callable[[int], None] | None = None,
        on_batch: BatchHook | None = None,
        workers: int = 1,
        on_stop: Callable[[], None] | None = None,
        max_queued_per_key: int = 0,
    ):
        if queue_size < 1 or max_batch < 1 or batch_wait_s < 0 or workers < 1:
            raise ValueError("queue_size, max_batch and workers must be >= 1, batch_wait_s >= 0")
        self.runners = dict(runners)
        self.queue_size, self.max_batch, self.batch_wait_s = queue_size, max_batch, batch_wait_s
        self.max_queued_per_key = max_queued_per_key  # 0: no cap but queue_size
        self.on_error = on_error or (lambda where, e: None)
        # observers (serving/metrics.py): the queue depth after each change; each model call
        self.on_queue = on_queue or (lambda depth: None)
        self.on_batch = on_batch or (lambda task, payloads, results, seconds, failed: None)
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.workers = workers
        self.on_stop = on_stop  # after the workers stop: release what the runners hold
        self._threads: list[threading.Thread] = []
        self._running: set[Job] = set()  # the jobs of the batches being run
        self._beat = time.monotonic()  # the worker's last progress
        self._counts = threading.Lock()
        self.batches_run = 0
        self.rows_run = 0
        self.largest_batch = 0
        self.rows_retried_alone = 0
        self.rows_cancelled = 0
        self.rows_joined = 0  # rows that joined a batch in progress (Emit.take)

    # ---- request threads -------------------------------------------------------------------
    def submit(self, task: str, payload: Any, key: str | None = None) -> Job:
        """Queue one row of ``task`` for ``key``; raises QueueFull when ``queue_size`` jobs
        wait, or ``max_queued_per_key`` of ``key``'s."""
        if task not in self.runners:
            raise KeyError(f"no runner for task {task!r} ({sorted(self.runners)})")
        job = Job(task, payload, key)
        with self._cond:
            if len(self._pending) >= self.queue_size:
                raise QueueFull(f"the model's queue is full ({self.queue_size} requests waiting)")
            cap = self.max_queued_per_key
            if cap and self._held(key) >= cap:
                raise QueueFull(f"{key or 'this client'} holds {cap} places of the model's queue "
                                f"already (--max-queued-per-key {cap})")  # fmt: skip
            self._pending.append(job)
            self._cond.notify_all()
            depth = len(self._pending)
        self.on_queue(depth)
        return job

    def _held(self, key: str | None) -> int:
        """The places ``key`` holds: its jobs queued and its rows still decoding (a row joins a
        running batch as soon as there is room, so queued places alone would not bound a key's
        share of the model)."""
        queued = sum(j.key == key for j in self._pending)
        return queued + sum(j.key == key and not j.done for j in self._running)

    def cancel(self, job: Job, why: str = "the client left") -> None:
        """Cancel ``job``: out of the queue if it waits there; a running one stops at its
        runner's next ``emit.stopped`` question."""
        with self._cond:
            waiting = job in self._pending
            if waiting:
                self._pending.remove(job)
            depth = len(self._pending)
        if not job.done:
            with self._counts:
                self.rows_cancelled += 1
        job.cancel(why)
        if waiting:
            self.on_queue(depth)

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._pending)

    def beat(self) -> None:
        self._beat = time.monotonic()

    def progress(self) -> tuple[float, bool]:
        """(seconds since the worker's last progress while a batch runs, 0 when idle; whether
        a batch runs)."""
        busy = bool(self._running)
        return (time.monotonic() - self._beat if busy else 0.0), busy

    def stats(self) -> dict:
        return {
            "queue_depth": self.queue_depth,
            "queue_size": self.queue_size,
            "batches_run": self.batches_run,
            "mean_batch_size": round(self.rows_run / self.batches_run, 3)
            if self.batches_run
            else 0.0,
            "largest_batch": self.largest_batch,
            "rows_retried_alone": self.rows_retried_alone,
            "rows_cancelled": self.rows_cancelled,
            "rows_joined": self.rows_joined,
        }

    # ---- the worker --------------------------------------------------------------------------
    def start(self) -> Batcher:
        names = ["model-worker"] if self.workers == 1 else [
            f"model-worker-{i}" for i in range(self.workers)
        ]  # fmt: skip
        self._threads = [threading.Thread(target=self._work, name=n, daemon=True) for n in names]
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop after the batches in progress; the jobs still queued fail; a row still running
        after ``timeout`` is cancelled (it stops at its next decode step); then ``on_stop``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            left, self._pending = list(self._pending), deque()
        for job in left:
            job.fail(RuntimeError("the server is shutting down"))
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            with self._cond:
                running = list(self._running)
            for job in running:
                job.cancel("the server is shutting down")
            for t in self._threads:
                t.join(timeout)
        if self.on_stop is not None:
            self.on_stop()

    @property
    def alive(self) -> bool:
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def next_batch(self) -> list[Job]:
        """Block for the oldest job, then gather up to ``max_batch`` jobs of its task, waiting
        at most ``batch_wait_s`` from when the first was taken. [] once stopping. (A cancelled
        job has left the queue already.)"""
        with self._cond:
            while not self._pending and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return []
            batch = [self._pending.popleft()]
            task = batch[0].task
            deadline = time.monotonic() + self.batch_wait_s
            while len(batch) < self.max_batch:
                batch += self._take_fairly(task, batch)
                left = deadline - time.monotonic()
                if len(batch) >= self.max_batch or left <= 0 or self._stopping:
                    break
                self._cond.wait(left)
            depth = len(self._pending)
            self._running.update(batch)
            self.beat()
        self.on_queue(depth)
        return batch

    def _join(self, batch: list[Job], room: int | None) -> list[Job]:
        """``Emit.take``: up to ``room`` queued jobs of the batch's task (and at most
        ``max_batch`` rows running), taken fairly and
        appended to ``batch`` (running from now), unless the oldest queued job is of another
        task or the batcher is stopping."""
        with self._cond:
            if self._stopping or not self._pending or self._pending[0].task != batch[0].task:
                return []
            if len(batch) >= JOINED_BATCHES * self.max_batch:
                return []
            live = [j for j in batch if not j.done]
            want = (
                self.max_batch - len(live)
                if room is None
                else min(room, self.max_batch - len(live))
            )
            picked = self._take_fairly(batch[0].task, live, want)
            if not picked:
                return []
            batch += picked
            self._running.update(picked)
            depth = len(self._pending)
        with self._counts:
            self.rows_run += len(picked)
            self.rows_joined += len(picked)
            self.largest_batch = max(self.largest_batch, len(live) + len(picked))
        for job in picked:
            job.batch_size = len(live) + len(picked)
        self.on_queue(depth)
        return picked

    def _take_fairly(self, task: str, batch: list[Job], want: int | None = None) -> list[Job]:
        """Queued jobs of ``task`` to fill ``batch`` (``want`` of them; default up to
        ``max_batch``): one per key in turn (the keys in the order of their oldest job, those
        already in the batch last), out of the queue."""
        queues: dict = {}
        for job in self._pending:
            if job.task == task:
                queues.setdefault(job.key, []).append(job)
        inside = {j.key for j in batch}
        order = sorted(queues.values(), key=lambda q: q[0].key in inside)  # stable
        picked = []
        want = self.max_batch - len(batch) if want is None else want
        while order and len(picked) < want:
            for q in list(order):
                if len(picked) >= want:
                    break
                picked.append(q.pop(0))
                if not q:
                    order.remove(q)
        for job in picked:
            self._pending.remove(job)
        return picked

    def run_batch(self, batch: list[Job]) -> None:
        """One batched runner call for ``batch`` (one task), with the per-row fallback."""
        runner = self.runners[batch[0].task]
        with self._counts:
            self.batches_run += 1
            self.rows_run += len(batch)
            self.largest_batch = max(self.largest_batch, len(batch))
        for job in batch:
            job.batch_size = len(batch)
        emit = Emit(batch, self.beat, lambda room: self._join(batch, room))
        t0 = time.perf_counter()
        try:
            results = runner([j.payload for j in batch], emit)
            results = _checked(results, len(batch))  # (rows that joined included)
        except Exception as e:
            payloads = [j.payload for j in batch]
            self.on_batch(batch[0].task, payloads, None, time.perf_counter() - t0, len(batch))
            if len(batch) == 1:
                batch[0].fail(e)
                return
            self.on_error(f"a batch of {len(batch)} {batch[0].task} rows (retrying each alone)", e)
            for row, job in enumerate(batch):
                if job.done:  # answered before the batch failed
                    continue
                if row in emit.emitted:
                    job.fail(e)
                elif not job.cancelled:  # a cancelled row is not run again
                    with self._counts:
                        self.rows_retried_alone += 1
                    self._run_alone(runner, job)
            return
        payloads = [j.payload for j in batch]
        self.on_batch(batch[0].task, payloads, results, time.perf_counter() - t0, 0)
        for job, value in zip(batch, results, strict=True):
            job.finish(value)

    def _run_alone(self, runner: Runner, job: Job) -> None:
        t0 = time.perf_counter()
        try:
            value = _checked(runner([job.payload], Emit([job], self.beat)), 1)[0]
        except Exception as e:
            self.on_batch(job.task, [job.payload], None, time.perf_counter() - t0, 1)
            job.fail(e)
            return
        self.on_batch(job.task, [job.payload], [value], time.perf_counter() - t0, 0)
        job.finish(value)

    def _work(self) -> None:
        while True:
            batch: list[Job] = []
            try:
                batch = self.next_batch()
                if not batch:
                    return
                self.run_batch(batch)
            except BaseException as e:  # noqa: B036  (nothing may end the worker)
                self.on_error("the model worker", e)
                for job in batch:
                    job.fail(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            finally:
                with self._cond:
                    self._running.difference_update(batch)
                self.beat()


def _checked(results: Any, n: int) -> list:
    results = list(results)
    if len(results) != n:
        raise RuntimeError(f"the runner gave {len(results)} results for {n} rows")
    return results
