"""Issue 51's findings against the server, each reproduced on the real ASGI stack and a real
socket (tests/fake_serve.py: fake runners, no model), where memory matters in a child process
whose address space is limited (RLIMIT_AS) and whose peak resident memory is read from the
kernel: each of these tests failed on the server before the fix (an older server is given
the same settings, those it lacks dropped, so it fails on what it does).

- H1: an upload whose header says more audio than ``--max-audio-seconds`` is a 413 before any
  of it is decoded (peak memory unchanged); one without a length is refused at the block that
  passes the bound; the model worker never sees either.
- H2: an ``input`` over ``--max-input-chars`` is a 400 before the worker.
- M1: sockets trickling headers, and requests trickling bodies (with the key), hold no place
  among the requests served: ``/health`` and speech answer at once.
- M2: 200 requests at once on a queue of 4: every answer is JSON, each 503 has Retry-After
  and a reason (``queue_full``, ``server_busy``), each is in the access log and in
  ``speechlm_rejected_total``.
- M3: the work of clients that left is cancelled between steps and logged 499 ``client_gone``;
  a live request behind them is not kept waiting.
- M4: a ``text/plain`` body is a 415, a foreign ``Origin`` a 403, a rebound ``Host`` a 400;
  ``--cors-origins`` lets one origin in.
- M5 and Low: request ids (taken or made, echoed, logged), a 500's reason and request id on the
  error line, ``/ready`` 503 while the worker is stalled (``/health`` still 200), the process's
  memory and the worker's progress in ``/metrics``, a 5,000-digit number and a lone surrogate
  400s, no server folder in a client's message, a non-ASCII key refused at start, the drain
  bounded by ``--drain-seconds``, the connection closed by ``--header-timeout`` logged.
- Keys and limits: several keys from a file that rotate without a restart; per key, requests,
  audio seconds and body bytes per minute (429 with Retry-After; bytes charged from the
  Content-Length before the body is read).
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import signal
import socket
import sys
import threading
import time

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.fake_serve import RATE, Child, serving
from torchtitan_speechlm import cli

KEY = "s3cret-key"


def call(address, method: str, path: str, body: bytes | None = None, headers=None,
         timeout: float = 10.0):  # fmt: skip
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        conn.request(method, path, body, headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    finally:
        conn.close()


def error(body: bytes) -> dict:
    return json.loads(body)["error"]


def speech(text: str = "hello") -> bytes:
    return json.dumps({"input": text}).encode()


JSON = {"Content-Type": "application/json"}


def form(name: str, data: bytes) -> tuple[bytes, dict]:
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + name.encode()
            + b"\"\r\nContent-Type: audio/flac\r\n\r\n" + data + b"\r\n--XyZ--\r\n")  # fmt: skip
    return body, {"Content-Type": "multipart/form-data; boundary=XyZ"}


def silence_flac(seconds: float, rate: int = RATE, channels: int = 1, length: bool = True) -> bytes:
    """FLAC of ``seconds`` of silence (a few KB per minute); ``length=False``: its STREAMINFO
    says the length is unknown (a streamed FLAC), so only decoding finds how long it is."""
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", rate, channels, format="FLAC", subtype="PCM_16") as f:
        block = np.zeros((rate * 60, channels), np.int16)
        left = int(seconds * rate)
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
    data = bytearray(buf.getvalue())
    if not length:  # the 36-bit total-samples field of STREAMINFO (bytes 21-25) set to 0
        data[21] &= 0xF0
        data[22:26] = b"\0\0\0\0"
    return bytes(data)


def lines_of(lines: list[str], timeout: float = 10.0, n: int = 1) -> list[dict]:
    deadline = time.monotonic() + timeout
    while len(lines) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return [json.loads(x) for x in list(lines)]


def health(address) -> dict:
    return json.loads(call(address, "GET", "/health")[2])


# ---- H1, H2 ------------------------------------------------------------------------------
def test_h1_long_audio_is_refused_from_its_header_or_while_decoding_in_bounded_memory():
    child = Child({"app": {"max_audio_seconds": 60, "max_upload_bytes": 8 << 20},
                   "memory_mb": 1500})  # fmt: skip
    try:
        start = child.peak_mb()
        hour = silence_flac(3600)  # 1 h: 28.8 M samples, 115 MB as float32, ~90 KB as FLAC
        t = time.monotonic()
        status, _, body = call(child.address, "POST", "/v1/audio/transcriptions",
                               *form("hour.flac", hour))  # fmt: skip
        took = time.monotonic() - t
        assert status == 413, body[:300]
        err = error(body)
        assert err["code"] == "audio_too_long" and err["param"] == "file"
        assert (
            "header says 3600.0 s" in err["message"] and "--max-audio-seconds 60" in err["message"]
        )
        assert took < 2.0 and child.peak_mb() - start < 40, (took, child.peak_mb(), start)
        # no length in the header: decoded block by block, refused at the block past 60 s
        status, _, body = call(child.address, "POST", "/v1/audio/transcriptions",
                               *form("stream.flac", silence_flac(1200, length=False)))  # fmt: skip
        assert status == 413 and "more than 60 s" in error(body)["message"], body[:300]
        assert child.peak_mb() - start < 40
        assert health(child.address)["batches_run"] == 0  # the worker never saw either
        # within the bound: decoded and transcribed (a file without a length too)
        for data in (silence_flac(30), silence_flac(30, length=False)):
            status, _, body = call(child.address, "POST", "/v1/audio/transcriptions",
                                   *form("ok.flac", data))  # fmt: skip
            assert status == 200 and json.loads(body)["text"] == f"{30 * RATE} samples"
        logged = [json.loads(x) for x in child.lines if x.startswith('{"method"')]
        assert [r.get("reason") for r in logged[:2]] == ["audio_too_long"] * 2
        # refused uploads are not kept: 40 of 120 s of noise (~1.9 MB each, 77 MB in all)
        noise = io.BytesIO()
        sf.write(noise, np.random.default_rng(0).uniform(-1, 1, RATE * 120), RATE, format="FLAC")
        upload = form("noise.flac", noise.getvalue())
        before = child.rss_mb()
        for _ in range(40):
            assert call(child.address, "POST", "/v1/audio/transcriptions", *upload)[0] == 413
        assert child.rss_mb() - before < 25, (before, child.rss_mb())
    finally:
        assert child.close() == 0


def test_h1_a_prompt_audio_over_the_bound_is_refused_too():
    wave = io.BytesIO()
    sf.write(wave, np.zeros(RATE * 3, np.float32), RATE, format="WAV")
    req = {"input": "hi", "prompt_audio": base64.b64encode(wave.getvalue()).decode()}
    with serving({"max_audio_seconds": 2}) as (server, model, lines, said):
        status, _, body = call(server.server_address, "POST", "/v1/audio/speech",
                               json.dumps(req).encode(), JSON)  # fmt: skip
        assert status == 413 and error(body)["param"] == "prompt_audio", body[:300]
        assert "--max-audio-seconds 2" in error(body)["message"] and model.steps == 0


def test_h2_an_input_over_the_bound_is_a_400_before_the_worker():
    with serving({"max_input_chars": 4096, "max_upload_bytes": 32 << 20}) as (
        server,
        model,
        lines,
        said,
    ):
        t = time.monotonic()
        status, _, body = call(server.server_address, "POST", "/v1/audio/speech",
                               speech("word " * 2_000_000), JSON)  # 10 MB  # fmt: skip
        assert status == 400 and time.monotonic() - t < 5, body[:300]
        err = error(body)
        assert err["code"] == "input_too_long" and err["param"] == "input"
        assert "10000000 characters" in err["message"] and "--max-input-chars" in err["message"]
        assert health(server.server_address)["batches_run"] == 0 and model.steps == 0
        status, _, _ = call(server.server_address, "POST", "/v1/audio/speech",
                            speech("a" * 4096), JSON)  # fmt: skip
        assert status == 200  # at the bound: taken


# ---- M1, M2, M3 --------------------------------------------------------------------------
def trickle(address, n: int, head: bytes) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(address, timeout=10)
        s.sendall(head)
        socks.append(s)
    return socks


def test_m1_sockets_trickling_headers_or_bodies_hold_no_place():
    """100 connections part-way through their headers and 100 keyed requests part-way
    through their bodies (uvicorn's cap counted both: everyone got a plain-text 503): the
    probes and a speech request are answered at once."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with serving({"api_key": KEY}) as (server, model, lines, said):
        address = server.server_address
        socks = trickle(address, 100, b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\n")
        socks += trickle(address, 100, b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\n"
                         b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"in")  # fmt: skip
        try:
            t = time.monotonic()
            status, head, body = call(address, "GET", "/health")
            assert status == 200 and json.loads(body)["status"] == "ok", body[:200]
            status, head, body = call(address, "POST", "/v1/audio/speech", speech(),
                                      {**JSON, **auth})  # fmt: skip
            assert status == 200 and body[:4] == b"RIFF", body[:200]
            assert time.monotonic() - t < 3
        finally:
            for s in socks:
                s.close()


def test_m2_overload_is_answered_in_json_with_retry_after_logged_and_counted():
    with serving({"with_metrics": True}, queue_size=4, max_batch=2) as (server, model, lines, said):
        address = server.server_address
        model.gate.clear()  # the worker holds its first batch: the queue fills
        results: list = [None] * 200

        def one(i: int) -> None:
            results[i] = call(address, "POST", "/v1/audio/speech", speech(f"t{i}"), JSON, 30)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(200)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while sum(r is not None for r in results) < 194 and time.monotonic() < deadline:
            time.sleep(0.02)  # all but the batch (2) and the queue (4) answered at once
        model.gate.set()
        for t in threads:
            t.join(30)
        refused = [r for r in results if r[0] != 200]
        assert len(refused) >= 150, [r[0] for r in results]
        reasons = {}
        for status, head, body in refused:
            assert status == 503 and head["content-type"] == "application/json", body[:200]
            assert int(head["retry-after"]) >= 1
            code = error(body)["code"]
            assert code in ("queue_full", "server_busy"), body
            reasons[code] = reasons.get(code, 0) + 1
        assert all(r[0] == 200 and r[2][:4] == b"RIFF" for r in results if r[0] == 200)
        logged = lines_of(lines, n=200)
        speech_lines = [r for r in logged if r["path"] == "/v1/audio/speech"]
        assert len(speech_lines) == 200
        assert sorted(r.get("reason") for r in speech_lines if r["status"] == 503) == sorted(
            code for code, k in reasons.items() for _ in range(k)
        )
        metrics = call(address, "GET", "/metrics")[2].decode()
        for code, k in reasons.items():
            assert f'speechlm_rejected_total{{reason="{code}"}} {float(k)}' in metrics


def test_m3_the_work_of_clients_that_left_is_cancelled_and_logged_as_such():
    """16 requests of 50 steps (2.5 s each on one worker: 40 s in all) whose clients close
    their connection once sent: each is cancelled (the running one between two steps), logged
    499 ``client_gone``, and a live request sent after them is answered in seconds."""
    with serving(step_s=0.05, queue_size=64, max_batch=1) as (server, model, lines, said):
        address = server.server_address
        body = speech("x" * 50)
        for _ in range(16):
            with socket.create_connection(address, timeout=10) as s:
                s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                          b"application/json\r\nContent-Length: " + str(len(body)).encode()
                          + b"\r\n\r\n" + body)  # fmt: skip
                time.sleep(0.02)
        t = time.monotonic()
        status, _, got = call(address, "POST", "/v1/audio/speech", speech("live"), JSON, 10)
        assert status == 200 and time.monotonic() - t < 4, time.monotonic() - t
        logged = lines_of(lines, n=17)
        gone = [r for r in logged if r["status"] == 499]
        assert len(gone) == 16 and {r["reason"] for r in gone} == {"client_gone"}, logged
        assert model.steps < 50 + 4  # at most the first row's steps, cut, and the live one's
        assert health(address)["rows_cancelled"] == 16
        assert all(r["status"] != 500 for r in logged)


def test_m3_a_stream_whose_client_leaves_stops_its_row_between_steps():
    """A streamed answer (50 steps of 0.05 s) whose client closes the connection after the
    first chunk: the row stops within a few steps and the request is logged 499."""
    with serving(step_s=0.05, queue_size=8, max_batch=1) as (server, model, lines, said):
        body = speech("x" * 50)
        with socket.create_connection(server.server_address, timeout=10) as s:
            s.sendall(b"POST /v1/audio/speech?stream=1 HTTP/1.1\r\nHost: localhost\r\n"
                      b"Content-Type: application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
            assert b"RIFF" in s.recv(4096) or b"RIFF" in s.recv(4096)
        logged = lines_of(lines, n=1)
        time.sleep(0.3)
        assert logged[0]["status"] == 499 and logged[0]["reason"] == "client_gone", logged
        assert model.steps < 15, model.steps
        assert health(server.server_address)["rows_cancelled"] == 1


# ---- M4 ----------------------------------------------------------------------------------
def test_m4_a_web_page_can_neither_send_work_nor_read_answers():
    with serving() as (server, model, lines, said):
        address = server.server_address
        status, _, body = call(address, "POST", "/v1/audio/speech", speech(),
                               {"Content-Type": "text/plain"})  # fmt: skip
        assert status == 415 and error(body)["code"] == "unsupported_media_type"
        status, _, body = call(address, "POST", "/v1/audio/speech", speech(),
                               {**JSON, "Origin": "http://evil.example"})  # fmt: skip
        assert status == 403 and error(body)["code"] == "origin_not_allowed"
        assert "--cors-origins" in error(body)["message"]
        status, _, body = call(address, "GET", "/v1/voices",
                               headers={"Host": f"rebound.example:{address[1]}"})  # fmt: skip
        assert status == 400 and error(body)["code"] == "untrusted_host"
        assert "--trusted-hosts" in error(body)["message"]
        assert model.steps == 0
        url = f"http://127.0.0.1:{address[1]}/v1"  # a client that is not a browser: served
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        assert (
            client.audio.speech.create(model="m", voice="alloy", input="hi").content[:4] == b"RIFF"
        )
    app = {"cors_origins": ["http://app.example"], "trusted_hosts": ["*"]}
    with serving(app) as (server, model, lines, said):
        address = server.server_address
        status, head, _ = call(address, "OPTIONS", "/v1/audio/speech", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})  # fmt: skip
        assert status == 200 and head["access-control-allow-origin"] == "http://app.example"
        status, head, body = call(address, "POST", "/v1/audio/speech", speech(),
                                  {**JSON, "Origin": "http://app.example"})  # fmt: skip
        assert status == 200 and head["access-control-allow-origin"] == "http://app.example"
        status, _, _ = call(address, "POST", "/v1/audio/speech", speech(),
                            {**JSON, "Origin": "http://evil.example"})  # fmt: skip
        assert status == 403
        status, _, _ = call(address, "GET", "/health", headers={"Host": "any.example"})
        assert status == 200


# ---- M5 and Low --------------------------------------------------------------------------
def test_m5_request_ids_and_every_500_with_its_reason_and_id():
    with serving() as (server, model, lines, said):
        address = server.server_address
        status, head, _ = call(address, "POST", "/v1/audio/speech", speech(),
                               {**JSON, "X-Request-Id": "trace-42"})  # fmt: skip
        assert status == 200 and head["x-request-id"] == "trace-42"
        status, head, _ = call(address, "GET", "/health", headers={"X-Request-Id": "a b\x01"})
        made = head["x-request-id"]
        assert len(made) == 32 and int(made, 16) >= 0  # not a plain token: one is made
        status, head, body = call(address, "POST", "/v1/audio/speech", speech("crash"), JSON)
        assert status == 500 and error(body)["type"] == "server_error"
        rid = head["x-request-id"]
        logged = lines_of(lines, n=3)
        assert [r["request_id"] for r in logged] == ["trace-42", made, rid]
        assert logged[2]["reason"] and "the decoder fell over" in logged[2]["error"]
        assert any(rid in line and "the decoder fell over" in line for line in said), said


def test_m5_ready_is_503_while_the_worker_is_stalled_and_health_stays_200():
    with serving({"ready_timeout_s": 0.3, "with_metrics": True}) as (server, model, lines, said):
        address = server.server_address
        assert call(address, "GET", "/ready")[0] == 200
        model.gate.clear()
        held = threading.Thread(target=call, args=(address, "POST", "/v1/audio/speech",
                                                   speech(), JSON, 30))  # fmt: skip
        held.start()
        assert model.entered.wait(10)
        time.sleep(0.6)
        status, head, body = call(address, "GET", "/ready")
        assert status == 503 and error(body)["code"] == "worker_stalled", body
        assert "--ready-timeout" in error(body)["message"] and int(head["retry-after"]) >= 1
        assert call(address, "GET", "/health")[0] == 200  # alive, not ready
        metrics = call(address, "GET", "/metrics")[2].decode()
        stalled = [x for x in metrics.splitlines()
                   if x.startswith("speechlm_worker_seconds_since_progress ")]  # fmt: skip
        assert stalled and float(stalled[0].split()[1]) > 0.5
        assert "speechlm_worker_busy 1.0" in metrics
        for name in (
            "process_resident_memory_bytes",
            "speechlm_process_peak_resident_memory_bytes",
        ):
            assert any(x.startswith(name + " ") and float(x.split()[1]) > 1e6
                       for x in metrics.splitlines()), name  # fmt: skip
        model.gate.set()
        held.join(30)
        assert call(address, "GET", "/ready")[0] == 200


def test_low_huge_numbers_lone_surrogates_and_server_paths_are_400s_without_paths():
    from torchtitan_speechlm.serving.errors import Redactions

    folder = "/srv/models/run-7/checkpoint/step-4"
    app = {"prompt_refusal": f"{folder} was trained without speaker prompts",
           "redact": Redactions({folder: "step-4"})}  # fmt: skip
    with serving(app) as (server, model, lines, said):
        address = server.server_address
        status, _, body = call(address, "POST", "/v1/audio/speech",
                               b'{"input": "hi", "speed": 1' + b"0" * 5000 + b"}", JSON)  # fmt: skip
        assert status == 400 and "could not parse the JSON" in error(body)["message"], body[:200]
        status, _, body = call(address, "POST", "/v1/audio/speech", b'{"input": "a\\ud800b"}',
                               JSON)  # fmt: skip
        assert status == 400 and error(body)["code"] == "invalid_input", body[:200]
        req = json.dumps({"input": "hi", "prompt_audio": "UklGRg=="}).encode()
        status, _, body = call(address, "POST", "/v1/audio/speech", req, JSON)
        assert status == 400 and error(body)["code"] == "prompt_refused"
        assert (
            "/srv" not in error(body)["message"] and "step-4 was trained" in error(body)["message"]
        )
        assert model.steps == 0


def test_low_a_key_no_request_could_send_is_refused_at_start(capsys, tmp_path):
    assert cli.main(["serve", "--model", "/no/model", "--api-key", "clé-secrète"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "cannot carry" in err and "no/model" not in err
    keys = tmp_path / "keys"
    keys.write_text("alice ok-key\nbob clé\n", encoding="utf-8")
    assert cli.main(["serve", "--model", "/no/model", "--api-key-file", str(keys)]) == 2
    assert f"{keys}:2" in capsys.readouterr().err


def shut_down(status: int, head: dict, body: bytes) -> bool:
    """The answer to a request the drain ran out on: JSON 503 ``shutting_down``, Retry-After."""
    return (status == 503 and head["content-type"] == "application/json"
            and int(head["retry-after"]) >= 1 and error(body)["code"] == "shutting_down")  # fmt: skip


def test_low_the_drain_is_bounded_by_drain_seconds_and_what_it_cuts_is_a_json_503():
    """A request held in the worker, one queued behind it and a stream already begun:
    shutdown returns after --drain-seconds (1), not after the request timeout (600 + 5 s).
    The two not yet answered get OpenAI's JSON 503 ``shutting_down`` with Retry-After (it was
    uvicorn's plain-text 500 while the log said 503), the stream is cut; all three are logged
    and counted as ``shutting_down``, none as a 500 or a 499."""
    with serving({"with_metrics": True}, server_kw={"drain_s": 1.0}, step_s=0.05, queue_size=8,
                 max_batch=1) as (server, model, lines, said):  # fmt: skip
        address = server.server_address
        answers: dict = {}

        def send(name: str, path: str, text: str) -> None:
            try:
                answers[name] = call(address, "POST", path, speech(text), JSON, 30)
            except http.client.IncompleteRead as e:  # a stream cut short
                answers[name] = ("cut", len(e.partial))

        streamed = threading.Thread(target=send, args=("streamed", "/v1/audio/speech?stream=1",
                                                       "x" * 50))  # fmt: skip
        streamed.start()
        deadline = time.monotonic() + 10
        while model.steps < 2 and time.monotonic() < deadline:  # its first chunks are out
            time.sleep(0.01)
        model.gate.clear()  # the worker holds the stream's row: the next two wait
        held = [threading.Thread(target=send, args=(f"waiting{i}", "/v1/audio/speech", "hi"))
                for i in range(2)]  # fmt: skip
        for t in held:
            t.start()
        time.sleep(0.3)
        t = time.monotonic()
        server.shutdown(10)
        assert time.monotonic() - t < 4, time.monotonic() - t
        for thread in (streamed, *held):
            thread.join(10)
        assert shut_down(*answers["waiting0"]) and shut_down(*answers["waiting1"]), answers
        assert answers["streamed"][0] == "cut", answers["streamed"]
        logged = lines_of(lines, n=3)
        assert [(r["status"], r["reason"]) for r in logged] == [(503, "shutting_down")] * 3
        metrics = server.app.metrics.render()[0].decode()
        assert 'speechlm_rejected_total{reason="shutting_down"} 3.0' in metrics
        assert 'status="500"' not in metrics and 'status="499"' not in metrics


def test_sigterm_on_the_server_process_answers_what_the_drain_cuts_with_a_json_503():
    """The server in its own process (tests/fake_serve.py), SIGTERM with --drain-seconds 1 and
    three requests of 8 s each in flight (one running, two queued, one of them streamed):
    each client gets the JSON 503 within the drain time, each is in the access log as 503
    ``shutting_down``, no traceback is printed and the process exits 0."""
    child = Child({"app": {"with_metrics": True}, "server": {"drain_s": 1.0}, "step_s": 0.2,
                   "max_batch": 1})  # fmt: skip
    try:
        answers: dict = {}

        def send(name: str, path: str) -> None:
            answers[name] = call(child.address, "POST", path, speech("x" * 40), JSON, 30)

        paths = ["/v1/audio/speech", "/v1/audio/speech", "/v1/audio/speech?stream=1"]
        threads = [threading.Thread(target=send, args=(i, p)) for i, p in enumerate(paths)]
        for t in threads:
            t.start()
            time.sleep(0.2)
        assert health(child.address)["queue_depth"] == 2
        child.proc.send_signal(signal.SIGTERM)
        t = time.monotonic()
        for thread in threads:
            thread.join(10)
        assert time.monotonic() - t < 5, time.monotonic() - t
        assert all(shut_down(*answers[i]) for i in range(3)), answers
        assert child.proc.wait(30) == 0
    finally:
        child.close()
    logged = [json.loads(x) for x in child.lines if x.startswith('{"method": "POST"')]
    assert [(r["status"], r["reason"]) for r in logged] == [(503, "shutting_down")] * 3
    assert not any("Traceback" in x or "Internal Server Error" in x for x in child.lines)


def test_low_a_connection_cut_by_the_header_timeout_is_logged_and_counted():
    with serving({"with_metrics": True}, server_kw={"header_timeout_s": 0.3}) as (
        server, model, lines, said,
    ):  # fmt: skip
        with socket.create_connection(server.server_address, timeout=10) as s:
            s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 408")
        logged = lines_of(lines, n=1)
        assert logged[0]["status"] == 408 and logged[0]["reason"] == "header_timeout"
        metrics = call(server.server_address, "GET", "/metrics")[2].decode()
        assert 'speechlm_rejected_total{reason="header_timeout"} 1.0' in metrics


def test_proxy_headers_are_read_from_a_trusted_proxy_only():
    """--proxy-headers: from a trusted proxy address (here 127.0.0.1, the flag alone), the
    access log's client and the per-client rate limit use X-Forwarded-For (its last address
    that is not a trusted proxy: the one the proxy appended, not one the client sent);
    without the flag, or with a proxy address that is not the sender's, the header is ignored
    (a client can neither pick its own address nor dodge its rate limit by changing it)."""
    from torchtitan_speechlm.commands.serve_args import build_parser

    assert build_parser().parse_args(["--model", "m", "--proxy-headers"]).proxy_headers == (
        "127.0.0.1"
    )
    assert build_parser().parse_args(["--model", "m"]).proxy_headers is None

    def seen(proxy_headers: str | None) -> tuple[list[dict], list[int]]:
        """Two requests forwarded for two clients, with the request ids they carry: their
        access lines and statuses under one request a minute per client."""
        with serving({"requests_per_minute": 1}, server_kw={"proxy_headers": proxy_headers}) as (
            server, model, lines, said,
        ):  # fmt: skip
            statuses = []
            for i, client in enumerate(("203.0.113.7", "198.51.100.9")):
                # what the client sent ("6.6.6.6", a spoof) and what the proxy appended
                head = {**JSON, "X-Forwarded-For": f"6.6.6.6, {client}",
                        "X-Request-Id": f"req-{i}"}  # fmt: skip
                status, got, _ = call(server.server_address, "POST", "/v1/audio/speech",
                                      speech(), head)  # fmt: skip
                assert got["x-request-id"] == f"req-{i}"
                statuses.append(status)
            return lines_of(lines, n=2), statuses

    trusted, statuses = seen("127.0.0.1")
    assert [r["client"].split(":")[0] for r in trusted] == ["203.0.113.7", "198.51.100.9"]
    assert [r["request_id"] for r in trusted] == ["req-0", "req-1"]
    assert statuses == [200, 200]  # one window per forwarded client
    for flag in (None, "10.9.9.9"):  # no flag; a proxy address that is not the sender's
        ignored, statuses = seen(flag)
        assert [r["client"].split(":")[0] for r in ignored] == ["127.0.0.1"] * 2, flag
        assert [r["request_id"] for r in ignored] == ["req-0", "req-1"]
        assert statuses == [200, 429], flag  # one window: the sender's own address


# ---- keys and rate limits ----------------------------------------------------------------
def test_keys_from_a_file_rotate_without_a_restart_and_each_has_its_own_limits(
    tmp_path, monkeypatch
):
    from torchtitan_speechlm.serving import keys as keys_module
    from torchtitan_speechlm.serving.gate import RateLimits
    from torchtitan_speechlm.serving.keys import KeyRing

    monkeypatch.setattr(keys_module, "RECHECK_S", 0.0)
    path = tmp_path / "keys"
    path.write_text("# name key\nalice key-a\nbob key-b\n")
    said: list[str] = []
    ring = KeyRing(None, str(path), say=said.append)
    app = {"keys": ring, "rate_limits": RateLimits(3, 1.0), "with_metrics": True}
    with serving(app) as (server, model, lines, _):
        address = server.server_address

        def as_(key: str, body=None, headers=None, path="/v1/audio/speech"):
            headers = {"Authorization": f"Bearer {key}", **(headers or JSON)}
            return call(address, "POST", path, body or speech(), headers)

        assert [as_("key-a")[0] for _ in range(3)] == [200] * 3
        status, head, body = as_("key-a")  # alice's fourth in a minute
        assert status == 429 and error(body)["code"] == "rate_limited", body
        assert "--requests-per-minute 3" in error(body)["message"] and int(head["retry-after"]) > 1
        assert as_("key-b")[0] == 200  # bob has his own window
        # audio seconds: bob's 100 samples of speech (0.0125 s) are charged; a 0.75 s upload
        # fits his 1 s a minute once, not twice
        wave = io.BytesIO()
        sf.write(wave, np.zeros(6000, np.float32), RATE, format="WAV")
        upload = form("a.wav", wave.getvalue())
        assert as_("key-b", *upload, path="/v1/audio/transcriptions")[0] == 200
        status, _, body = as_("key-b", *upload, path="/v1/audio/transcriptions")
        assert status == 429 and error(body)["code"] == "audio_rate_limited", body
        assert as_("nope")[0] == 401
        path.write_text("carol key-c\n")  # rotated: alice and bob out, carol in
        assert as_("key-c")[0] == 200 and as_("key-b")[0] == 401
        path.write_text("dave clé\n")  # unreadable as keys: carol's stays in force
        assert as_("key-c")[0] == 200
        assert any("stay in force" in line for line in said), said
        logged = lines_of(lines, n=10)
        assert {r.get("key") for r in logged if r["status"] == 200} == {"alice", "bob", "carol"}
        metrics = call(address, "GET", "/metrics", headers={"Authorization": "Bearer key-c"})[2]
        assert b'speechlm_rejected_total{reason="rate_limited"} 1.0' in metrics
        assert b'speechlm_rejected_total{reason="audio_rate_limited"} 1.0' in metrics


def test_a_keys_body_bytes_per_minute_refuse_oversized_senders_before_their_body_is_read():
    """H1/H2's cost: a 10 MB ``input`` or an 8-hour FLAC is refused only once it is read and
    parsed. With --body-mb-per-minute the bytes a key sends are charged from Content-Length
    first: a request over the key's window is a 429 ``body_rate_limited`` answered before any
    of its body arrives (a request whose headers promise a body never sent gets it at once),
    with Retry-After, or without one when the body alone is over the window; small requests of
    the same key still fit; both refusals are counted by reason."""
    from torchtitan_speechlm.serving.gate import RateLimits

    app = {"rate_limits": RateLimits(body_bytes_per_minute=100_000), "with_metrics": True}
    with serving(app) as (server, model, lines, _):
        address = server.server_address
        big = speech("a" * 60_000)  # over --max-input-chars: read, parsed, then refused
        status, _, body = call(address, "POST", "/v1/audio/speech", big, JSON)
        assert status == 400 and error(body)["code"] == "input_too_long", body

        def promised(length: int | str) -> tuple[int, dict, bytes]:
            """Headers promising ``length`` bytes of body, and none of it sent."""
            with socket.create_connection(address, timeout=5) as s:
                s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\n"
                          b"Content-Length: " + str(length).encode() + b"\r\n\r\n")  # fmt: skip
                answer = http.client.HTTPResponse(s)
                answer.begin()  # a server waiting for the body would time this out
                return (
                    answer.status,
                    {k.lower(): v for k, v in answer.headers.items()},
                    answer.read(),
                )

        status, head, body = promised(50_000)  # 60,0xx + 50,000 > 100,000
        assert status == 429 and error(body)["code"] == "body_rate_limited", body
        assert "--body-mb-per-minute" in error(body)["message"] and int(head["retry-after"]) >= 1
        assert call(address, "POST", "/v1/audio/speech", speech(), JSON)[0] == 200  # still fits
        status, _, body = promised("9" * 19)  # no body has that: BodyLimit's 413, never a 500
        assert status == 413 and error(body)["code"] == "request_too_large", body
        status, head, body = promised(200_000)  # more than the whole window
        assert status == 429 and error(body)["code"] == "body_rate_limited", body
        assert "retry-after" not in head and "is more than" in error(body)["message"]
        assert model.steps > 0  # the small request was spoken
        metrics = call(address, "GET", "/metrics")[2]
        assert b'speechlm_rejected_total{reason="body_rate_limited"} 2.0' in metrics


def test_a_chunked_body_is_charged_as_it_is_read(monkeypatch):
    """Without a Content-Length nothing can be charged up front: the bytes read are, and the
    key's next request finds its window spent until they leave it 60 s later."""
    from torchtitan_speechlm.serving import gate

    now = [1000.0]
    monkeypatch.setattr(gate.time, "monotonic", lambda: now[0])
    limits = gate.RateLimits(body_bytes_per_minute=1000)
    assert limits.admit("key a") is None  # chunked: 0 declared
    limits.charge_body("key a", 900)
    refused = limits.admit("key a", 200)
    assert refused.code == "body_rate_limited" and refused.headers["Retry-After"] == "60"
    assert limits.admit("key b", 200) is None and limits.admit("key a", 100) is None
    now[0] += 60.0  # the 900 bytes leave the window
    assert limits.admit("key a", 800) is None


def test_the_vllm_child_gets_its_own_key_and_never_ours(monkeypatch):
    """The vLLM server this command starts: its environment lacks our key and has a fresh
    one of its own (never on its command line); the client sends it, as --vllm-api-key's."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from torchtitan_speechlm.serving.vllm_engine import VllmClient
    from torchtitan_speechlm.serving.vllm_process import VllmProcess, child_env, command

    monkeypatch.setenv("TORCHTITAN_SERVE_API_KEY", "ours")
    process = VllmProcess("python", None)
    env = child_env(process.api_key)
    assert "TORCHTITAN_SERVE_API_KEY" not in env and env["VLLM_API_KEY"] == process.api_key
    assert len(process.api_key) >= 32 and process.api_key not in command("py", "lm", 1, 256)
    seen: list = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            ok_key = self.headers.get("Authorization") == "Bearer theirs"
            body = json.dumps({"data": [{"id": "m", "max_model_len": 64}]}).encode()
            self.send_response(200 if ok_key else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    stand_in = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=stand_in.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{stand_in.server_address[1]}"
        VllmClient(url, 5, "theirs").connect()
        with pytest.raises(ValueError, match="--vllm-api-key"):
            VllmClient(url, 5).connect()
        assert seen == ["Bearer theirs", None]
    finally:
        stand_in.shutdown()


# a stand-in for --vllm-python: answers check_python's version probe, and as the api_server
# writes the command line and environment it was started with to {work}/started.json, then
# answers GET /health on its --port until SIGTERM (vLLM itself cannot be installed here)
FAKE_VLLM_PYTHON = """#!{python}
import json, os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if sys.argv[1] == "-c":
    print("0.0.0+fake")
    sys.exit(0)
with open(os.path.join(os.getcwd(), "started.json"), "w") as f:  # its cwd: the work folder
    json.dump({{"argv": sys.argv, "env": dict(os.environ)}}, f)

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

port = int(sys.argv[sys.argv.index("--port") + 1])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_the_vllm_child_is_started_with_its_own_key_in_its_environment_only(tmp_path, monkeypatch):
    """What ``--vllm-python`` really starts (a stand-in python that records its command line
    and environment): our key (``TORCHTITAN_SERVE_API_KEY``) and --vllm-url's
    (``TORCHTITAN_VLLM_API_KEY``) are nowhere in either; its own fresh key is in
    ``VLLM_API_KEY`` and not on its command line (which any local user can read); it listens
    on loopback only; each start makes a new key."""
    from torchtitan_speechlm.serving.vllm_process import VllmProcess

    monkeypatch.setenv("TORCHTITAN_SERVE_API_KEY", "our-serve-key-0123456789")
    monkeypatch.setenv("TORCHTITAN_VLLM_API_KEY", "our-vllm-url-key-0123456789")
    fake = tmp_path / "python"
    fake.write_text(FAKE_VLLM_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    keys = []
    for i in range(2):
        work = tmp_path / f"work{i}"
        process = VllmProcess(str(fake), str(work), timeout_s=60, say=lambda line: None)
        monkeypatch.setattr(process, "export", lambda loaded, work=work: str(work / "lm"))
        (work / "lm").mkdir(parents=True)
        url = process.start(None)  # the export stubbed: no model
        try:
            started = json.loads((work / "started.json").read_text())
        finally:
            assert process.stop(timeout=10) == 0
        argv, env = started["argv"], started["env"]
        everything = json.dumps(started)
        assert "our-serve-key" not in everything and "our-vllm-url-key" not in everything
        assert "TORCHTITAN_SERVE_API_KEY" not in env and "TORCHTITAN_VLLM_API_KEY" not in env
        assert env["VLLM_API_KEY"] == process.api_key and len(process.api_key) >= 32
        assert process.api_key not in " ".join(argv) and "--api-key" not in argv
        assert argv[argv.index("--host") + 1] == "127.0.0.1" and url.startswith("http://127.0.0.1:")
        keys.append(process.api_key)
    assert keys[0] != keys[1]


def test_a_minutes_requests_cannot_be_spent_in_one_burst(monkeypatch):
    """--requests-per-minute 600: at most 20 in any one second (a thirtieth), 600 in 60 s."""
    from torchtitan_speechlm.serving import gate

    now = [1000.0]
    monkeypatch.setattr(gate.time, "monotonic", lambda: now[0])
    limits = gate.RateLimits(600)
    assert [limits.admit("key a") for _ in range(20)] == [None] * 20
    refused = limits.admit("key a")
    assert refused.status == 429 and refused.headers["Retry-After"] == "1"
    assert "20 in any one second" in refused.message and limits.admit("key b") is None
    for _ in range(29):  # 20 a second: the minute's 600 run out after 30 seconds
        now[0] += 1.0
        assert [limits.admit("key a") for _ in range(20)] == [None] * 20
    now[0] += 1.0
    refused = limits.admit("key a")
    assert (
        refused.code == "rate_limited" and "sent 600 requests in the last 60 s" in refused.message
    )
    assert int(refused.headers["Retry-After"]) == 30


def test_m2_connections_refused_at_a_high_rate_leave_nothing_behind():
    """300 uploads of ~1.9 MB refused from their headers as fast as a client sends them (401s:
    a wrong key; each answered, then its body dropped unread by the lingering close,
    serving/linger.py; a rate limit's 429s would hold such a client a second each): the
    server's memory does not grow with them (the header timer kept each closed connection,
    and the part of its body it had buffered, for --header-timeout seconds: ~125 KB each,
    hundreds of MB at a few hundred refusals a second)."""
    child = Child({"app": {"max_upload_bytes": 8 << 20, "api_key": "the-key-0123456789"},
                   "memory_mb": 1500})  # fmt: skip
    try:
        noise = io.BytesIO()
        sf.write(noise, np.random.default_rng(0).uniform(-1, 1, RATE * 120), RATE, format="FLAC")
        body, head = form("noise.flac", noise.getvalue())
        good = {**head, "Authorization": "Bearer the-key-0123456789"}
        assert call(child.address, "POST", "/v1/audio/transcriptions", body, good)[0] == 200
        before = child.rss_mb()
        for _ in range(300):
            status, _, answer = call(child.address, "POST", "/v1/audio/transcriptions", body,
                                     {**head, "Authorization": "Bearer wrong"})  # fmt: skip
            assert status == 401 and error(answer)["code"] == "invalid_api_key"
        assert child.rss_mb() - before < 15, (before, child.rss_mb())
    finally:
        assert child.close() == 0
