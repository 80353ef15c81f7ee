"""The model worker's dynamic batching (serving/batcher.py) with runners that record their
calls: jobs group by task (other tasks keep their place), the wait window and max batch bound
a batch, each batch is one runner call, a failing batch falls back to one call per row so that
only the bad row fails, a full queue refuses at once, and nothing a runner raises ends the
worker."""

import threading
import time

import pytest

from torchtitan_speechlm.serving.batcher import Batcher, QueueFull


class Recorder:
    """A runner: records each call's payloads; ``bad`` payloads make a call raise."""

    def __init__(self, bad=(), gate: threading.Event | None = None):
        self.calls, self.bad, self.gate = [], set(bad), gate

    def __call__(self, payloads, emit):
        if self.gate is not None:
            self.gate.wait(10)
        self.calls.append(list(payloads))
        if self.bad & set(payloads):
            raise ValueError(f"bad row among {payloads}")
        return [p.upper() for p in payloads]


def tasks(b: Batcher, batch) -> list[tuple[str, str]]:
    return [(j.task, j.payload) for j in batch]


def test_jobs_group_by_task_in_order_and_others_keep_their_place():
    b = Batcher({"tts": Recorder(), "asr": Recorder()}, max_batch=8, batch_wait_s=0)
    for task, p in [("tts", "a"), ("asr", "b"), ("tts", "c"), ("asr", "d"), ("tts", "e")]:
        b.submit(task, p)
    assert tasks(b, b.next_batch()) == [("tts", "a"), ("tts", "c"), ("tts", "e")]
    assert tasks(b, b.next_batch()) == [("asr", "b"), ("asr", "d")]
    assert b.queue_depth == 0


def test_max_batch_bounds_a_batch_and_ends_the_wait_early():
    b = Batcher({"tts": Recorder()}, max_batch=2, batch_wait_s=5.0)
    for p in "abcde":
        b.submit("tts", p)
    t = time.monotonic()
    sizes = [len(b.next_batch()) for _ in range(2)]
    assert sizes == [2, 2] and time.monotonic() - t < 1.0  # full batches never wait
    assert b.queue_depth == 1


def test_the_wait_window_gathers_late_jobs_and_then_runs_without_them():
    b = Batcher({"tts": Recorder()}, max_batch=8, batch_wait_s=1.0)
    got = {}

    def take():
        t = time.monotonic()
        got["batch"] = b.next_batch()
        got["waited"] = time.monotonic() - t

    b.submit("tts", "first")
    taker = threading.Thread(target=take)
    taker.start()
    time.sleep(0.1)
    b.submit("tts", "within the window")
    taker.join(5)
    b.submit("tts", "after the window")
    assert [j.payload for j in got["batch"]] == ["first", "within the window"]
    assert 0.95 <= got["waited"] < 5.0  # the whole window: the batch was not full
    assert [j.payload for j in b.next_batch()] == ["after the window"]


def test_a_full_queue_refuses_at_once_and_takes_jobs_again_once_drained():
    b = Batcher({"tts": Recorder()}, queue_size=2, batch_wait_s=0)
    b.submit("tts", "a")
    b.submit("tts", "b")
    t = time.monotonic()
    with pytest.raises(QueueFull, match="2 requests waiting"):
        b.submit("tts", "c")
    assert time.monotonic() - t < 1.0  # at once (the queue waits for nothing)
    assert b.stats()["queue_depth"] == 2
    b.next_batch()
    b.submit("tts", "c")
    with pytest.raises(KeyError):
        b.submit("sing", "la")


def test_one_runner_call_per_batch_and_each_job_gets_its_row():
    runner = Recorder()
    b = Batcher({"tts": runner}, batch_wait_s=0.05)
    jobs = [b.submit("tts", p) for p in "abc"]
    b.start()
    try:
        assert [j.result(5) for j in jobs] == ["A", "B", "C"]
        assert runner.calls == [["a", "b", "c"]]
        assert {j.batch_size for j in jobs} == {3}
        s = b.stats()
        assert (s["batches_run"], s["mean_batch_size"], s["largest_batch"]) == (1, 3.0, 3)
    finally:
        b.stop()


def test_a_failing_batch_retries_each_row_alone_and_only_the_bad_row_fails():
    runner = Recorder(bad={"bad"})
    b = Batcher({"tts": runner}, batch_wait_s=0.05)
    jobs = [b.submit("tts", p) for p in ("ok1", "bad", "ok2")]
    b.start()
    try:
        assert jobs[0].result(5) == "OK1" and jobs[2].result(5) == "OK2"
        with pytest.raises(ValueError, match="bad row"):
            jobs[1].result(5)
        assert runner.calls == [["ok1", "bad", "ok2"], ["ok1"], ["bad"], ["ok2"]]
        assert b.stats()["rows_retried_alone"] == 3
    finally:
        b.stop()


def test_a_row_that_began_to_stream_fails_with_the_batch_and_is_not_run_again():
    calls = []

    def runner(payloads, emit):
        calls.append(list(payloads))
        if len(payloads) > 1:
            emit(0, "chunk of row 0")
            raise RuntimeError("the decoder broke mid-batch")
        emit(0, f"chunk of {payloads[0]}")
        return ["done"]

    b = Batcher({"tts": runner}, batch_wait_s=0.05)
    first, second = b.submit("tts", "x"), b.submit("tts", "y")
    b.start()
    try:
        pieces = []
        with pytest.raises(RuntimeError, match="mid-batch"):
            for piece in first.stream(5):
                pieces.append(piece)
        assert pieces == ["chunk of row 0"]
        assert list(second.stream(5)) == ["chunk of y"] and second.value == "done"
        assert calls == [["x", "y"], ["y"]]
    finally:
        b.stop()


def test_nothing_a_runner_raises_ends_the_worker():
    state = {"mode": "exit"}

    def runner(payloads, emit):
        if state["mode"] == "exit":
            raise SystemExit(3)  # not even this
        if state["mode"] == "short":
            return []  # a wrong number of results
        return ["fine"] * len(payloads)

    errors = []
    b = Batcher({"tts": runner}, batch_wait_s=0, on_error=lambda where, e: errors.append(e))
    b.start()
    try:
        with pytest.raises(RuntimeError, match="SystemExit"):
            b.submit("tts", "a").result(5)
        state["mode"] = "short"
        with pytest.raises(RuntimeError, match="0 results for 1 rows"):
            b.submit("tts", "b").result(5)
        state["mode"] = "ok"
        assert b.submit("tts", "c").result(5) == "fine"
        assert b.alive and any(isinstance(e, SystemExit) for e in errors)
    finally:
        b.stop()


def test_stop_fails_the_queued_jobs():
    gate = threading.Event()
    b = Batcher({"tts": Recorder(gate=gate)}, batch_wait_s=0, max_batch=1).start()
    running = b.submit("tts", "a")
    while b.queue_depth:  # the worker took it and waits at the gate
        time.sleep(0.01)
    queued = b.submit("tts", "b")
    threading.Timer(0.2, gate.set).start()
    b.stop()
    assert running.result(5) == "A"
    with pytest.raises(RuntimeError, match="shutting down"):
        queued.result(5)
    assert not b.alive


def test_several_workers_run_batches_at_once_and_on_stop_comes_last():
    """``workers=2`` (``--engine vllm``: a batch is an HTTP request): a second batch runs while
    the first is still inside its runner (one worker would wait); ``on_stop`` is called once
    the workers have stopped."""
    started, release, events = [], threading.Event(), []

    def runner(payloads, emit):
        started.append(list(payloads))
        release.wait(10)
        return [p.upper() for p in payloads]

    b = Batcher({"tts": runner}, max_batch=1, batch_wait_s=0, workers=2,
                on_stop=lambda: events.append(("stopped", b.alive)))  # fmt: skip
    b.start()
    jobs = [b.submit("tts", p) for p in "ab"]
    deadline = time.monotonic() + 10
    while len(started) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(map(tuple, started)) == [("a",), ("b",)]  # both inside the runner at once
    release.set()
    assert [j.result(10) for j in jobs] == ["A", "B"]
    b.stop()
    assert events == [("stopped", False)]
    single = Batcher({"tts": runner}, workers=1)
    assert single.start().alive and len(single._threads) == 1
    single.stop()
    with pytest.raises(ValueError, match="workers"):
        Batcher({"tts": runner}, workers=0)


def test_a_cancelled_job_leaves_the_queue_and_a_running_one_is_told_between_steps():
    """``cancel``: a queued job is never run (its reader gets Cancelled at once); a running
    row's ``emit.stopped(row)`` turns True, so a runner that asks between steps drops it; each
    question counts as the worker's progress (``progress``), and ``stop`` cancels the rows
    still running when its time is up."""
    from torchtitan_speechlm.serving.batcher import Cancelled

    seen, steps = [], {"n": 0}

    def runner(payloads, emit):
        seen.append(list(payloads))
        for _ in range(400):
            if all(emit.stopped(r) for r in range(len(payloads))):
                break
            steps["n"] += 1
            time.sleep(0.005)
        return [p for p in payloads]

    b = Batcher({"tts": runner}, max_batch=1, batch_wait_s=0).start()
    first, queued = b.submit("tts", "a"), b.submit("tts", "b")
    while not seen:
        time.sleep(0.005)
    b.cancel(queued)
    with pytest.raises(Cancelled):
        queued.result(1)
    assert b.queue_depth == 0
    time.sleep(0.05)
    since, busy = b.progress()
    assert busy and since < 0.05  # stepping: progress all the time
    b.cancel(first)
    with pytest.raises(Cancelled):
        first.result(1)
    deadline = time.monotonic() + 2
    while b.progress()[1] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not b.progress()[1] and steps["n"] < 300  # stopped between steps, not at the end
    assert seen == [["a"]] and b.stats()["rows_cancelled"] == 2
    late = b.submit("tts", "c")  # a row running when stop's time is up is cancelled
    while len(seen) < 2:
        time.sleep(0.005)
    t = time.monotonic()
    b.stop(timeout=0.1)
    assert time.monotonic() - t < 1.0 and not b.alive
    with pytest.raises(Cancelled):
        late.result(1)


def test_a_batch_takes_each_keys_jobs_in_turn_and_a_key_holds_its_share_of_the_queue():
    """One client's flood (key a: 10 queued) shares each batch with the others' (b, c) instead
    of filling it, and ``max_queued_per_key`` refuses its 11th job while others still queue."""
    b = Batcher({"tts": Recorder()}, queue_size=32, max_batch=4, batch_wait_s=0,
                max_queued_per_key=10)  # fmt: skip
    for i in range(10):
        b.submit("tts", f"a{i}", key="a")
    with pytest.raises(QueueFull, match="a holds 10 places .*--max-queued-per-key 10"):
        b.submit("tts", "a10", key="a")
    b.submit("tts", "b0", key="b")
    b.submit("tts", "c0", key="c")
    b.submit("tts", "b1", key="b")
    assert [j.payload for j in b.next_batch()] == ["a0", "b0", "c0", "a1"]
    assert [j.payload for j in b.next_batch()] == ["a2", "b1", "a3", "a4"]


class Stepper:
    """A continuous runner: ``steps`` decode steps per row; between steps it takes queued jobs
    (``emit.take``) and answers each row at the step it completes (``emit.finish``); a payload
    starting with "bad" fails alone when it joins; ``arrive`` runs after the first step."""

    def __init__(self, steps=4, arrive=None):
        self.steps, self.arrive, self.joined, self.finished = steps, arrive, [], []

    def __call__(self, payloads, emit):
        rows = [[p, self.steps] for p in payloads]
        step = 0
        while any(left for _, left in rows):
            for i, row in enumerate(rows):
                if row[1]:
                    row[1] -= 1
                    if not row[1]:
                        emit.finish(i, row[0].upper())
                        self.finished.append(row[0])
            step += 1
            if step == 1 and self.arrive:
                self.arrive()
            for p in emit.take():
                self.joined.append((step, p))
                if p.startswith("bad"):
                    emit.fail(len(rows), ValueError(p))
                    rows.append([p, 0])
                else:
                    rows.append([p, self.steps])
        return [p.upper() for p, _ in rows]


def test_queued_jobs_join_a_running_batch_and_are_answered_when_their_row_completes():
    b = Batcher({"tts": None, "asr": Recorder()}, max_batch=3, batch_wait_s=0)
    late = []
    runner = Stepper(arrive=lambda: late.extend(
        b.submit("tts", p, key=k) for p, k in [("c", "x"), ("bad", "y"), ("d", "x"), ("e", "x")]
    ))  # fmt: skip
    b.runners["tts"] = runner
    first = [b.submit("tts", p, key=k) for p, k in [("a", "x"), ("b", "y")]]
    b.run_batch(b.next_batch())
    assert [j.result(1) for j in first] == ["A", "B"]
    assert late[0].result(1) == "C" and late[2].result(1) == "D" and late[3].result(1) == "E"
    with pytest.raises(ValueError, match="bad"):
        late[1].result(1)
    # after step 1 one place is free (3 rows at most): "c", the oldest; the others as rows end
    assert [p for _, p in runner.joined] == ["c", "bad", "d", "e"]
    assert runner.joined[0][0] == 1 and runner.finished[:2] == ["a", "b"]
    s = b.stats()
    assert s["rows_joined"] == 4 and s["batches_run"] == 1 and s["largest_batch"] <= 3
    assert all(job.batch_size <= 3 for job in first + late)


def test_a_job_of_another_task_waiting_stops_the_joining():
    b = Batcher({"tts": None, "asr": Recorder()}, max_batch=8, batch_wait_s=0)
    runner = Stepper(arrive=lambda: (b.submit("asr", "q"), b.submit("tts", "later")))
    b.runners["tts"] = runner
    job = b.submit("tts", "a")
    b.run_batch(b.next_batch())
    assert job.result(1) == "A" and runner.joined == []  # the asr job came first: no joining
    assert tasks(b, b.next_batch()) == [("asr", "q")]


def test_a_keys_rows_still_decoding_hold_its_places_too():
    """Rows join a running batch as soon as there is room, so a key's share counts its rows
    decoding as well as its queued jobs: without that, a flood would hold every row of the
    batch however small its queue share."""
    b = Batcher({"tts": Recorder()}, max_batch=4, batch_wait_s=0, max_queued_per_key=2)
    running = [b.submit("tts", f"a{i}", key="a") for i in range(2)]
    assert b.next_batch() == running and b.queue_depth == 0
    with pytest.raises(QueueFull, match="a holds 2 places"):
        b.submit("tts", "a2", key="a")
    b.submit("tts", "b0", key="b")  # another key still queues
    running[0].finish("A0")  # a row answered: its place is free again
    b.submit("tts", "a2", key="a")
    with pytest.raises(QueueFull, match="a holds 2 places"):
        b.submit("tts", "a3", key="a")


def test_a_continuous_batch_takes_at_most_sixteen_times_max_batch_rows_then_drains():
    from torchtitan_speechlm.serving import batcher as batcher_module

    b = Batcher({"tts": None}, queue_size=64, max_batch=2, batch_wait_s=0)
    runner = Stepper(steps=2, arrive=lambda: [b.submit("tts", f"j{i}", key=f"k{i}")
                                              for i in range(40)])  # fmt: skip
    b.runners["tts"] = runner
    b.submit("tts", "a", key="a")
    b.run_batch(b.next_batch())
    limit = batcher_module.JOINED_BATCHES * 2
    assert len(runner.joined) == limit - 1 and b.queue_depth == 40 - (limit - 1)
    assert b.stats()["batches_run"] == 1 and b.stats()["largest_batch"] <= 2
