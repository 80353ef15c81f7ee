"""serving/metrics.py: the Prometheus exposition counts what the batcher and the HTTP layer
did, read back with prometheus_client's own parser; in multiprocess mode (replicas) the sums
cover every process, and a dead replica's queue depth leaves them."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from torchtitan_speechlm.serving.batcher import Batcher
from torchtitan_speechlm.serving.metrics import ServeMetrics


def samples(text: bytes) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_batches_tokens_errors_and_requests_are_counted():
    def tokens_of(task, payloads, results):
        return sum(results) if task == "tts" else None

    m = ServeMetrics(tokens_of)

    def tts(rows, emit):
        if "bad" in rows:
            raise ValueError("bad row")
        return [len(r) * 4 for r in rows]  # "tokens" per row

    b = Batcher({"tts": tts}, max_batch=4, batch_wait_s=0.2, on_queue=m.queue_depth,
                on_batch=m.batch).start()  # fmt: skip
    jobs = [b.submit("tts", t) for t in ("ab", "abc", "bad", "a")]
    results = []
    for j in jobs:
        try:
            results.append(j.result(10))
        except ValueError:
            results.append(None)
    b.stop()
    assert results == [8, 12, None, 4]
    for route, status, sec in (("/v1/audio/speech", 200, 0.3), ("/v1/audio/speech", 400, 0.01),
                               ("other", 404, 0.001), ("/v1/audio/speech", 503, 0.002)):  # fmt: skip
        m.request(route, status, sec)
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    s = samples(body)
    # one batched call of 4 rows failed, then each row alone: 3 succeeded, 1 failed
    assert s["speechlm_batch_size_count", (("task", "tts"),)] == 5
    assert s["speechlm_batch_size_sum", (("task", "tts"),)] == 4 + 1 + 1 + 1 + 1
    assert s["speechlm_errors_total", (("kind", "model"),)] == 4 + 1  # the batch's rows, then one
    assert s["speechlm_generated_tokens_total", (("task", "tts"),)] == 8 + 12 + 4
    assert s["speechlm_errors_total", (("kind", "client"),)] == 2
    assert s["speechlm_errors_total", (("kind", "server"),)] == 1
    assert s["speechlm_requests_total", (("route", "/v1/audio/speech"), ("status", "200"))] == 1
    latency = ("speechlm_request_seconds_bucket", (("le", "0.5"), ("route", "/v1/audio/speech")))
    assert s[latency] == 3  # 0.3, 0.01, 0.002 <= 0.5
    assert s["speechlm_queue_depth", ()] == 0
    assert s["speechlm_tokens_per_second", (("task", "tts"),)] > 0


def _replica(n: int, depth: int) -> None:
    m = ServeMetrics()
    for _ in range(n):
        m.request("/v1/audio/speech", 200, 0.1)
    m.queue_depth(depth)


def test_replicas_sum_in_multiprocess_mode(tmp_path, monkeypatch):
    folder = str(tmp_path / "prom")
    os.makedirs(folder)
    # set before the replicas import prometheus_client (it picks its value store at import)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", folder)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_replica, args=(n, d)) for n, d in ((3, 2), (5, 1))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    # a third process (another replica answering the scrape) reads the sums
    code = ("import os, sys; os.environ['PROMETHEUS_MULTIPROC_DIR'] = sys.argv[1]; "
            "from torchtitan_speechlm.serving.metrics import ServeMetrics, mark_replica_dead; "
            "[mark_replica_dead(int(p)) for p in sys.argv[2:]]; "
            "sys.stdout.write(ServeMetrics().render()[0].decode())")  # fmt: skip
    read = [sys.executable, "-c", code, folder]
    s = samples(subprocess.run(read, capture_output=True, check=True).stdout)
    key = ("speechlm_requests_total", (("route", "/v1/audio/speech"), ("status", "200")))
    assert s[key] == 8
    # livesum: replicas that ended are marked dead, so their queue depth leaves the sum
    assert s["speechlm_queue_depth", ()] == 3  # (nothing marked dead: their files remain)
    dead = subprocess.run(read + [str(p.pid) for p in procs], capture_output=True, check=True)
    assert samples(dead.stdout).get(("speechlm_queue_depth", ()), 0) == 0
    assert samples(dead.stdout)[key] == 8  # counters keep what the dead replicas counted
