"""The HTTP layer (serving/app.py on uvicorn, serving/server.py) over fake runners, in this
process (no model): a full queue answers 503 with Retry-After at once, a runner's failure is the
request's 500 (ValueError: 400) and the server goes on, a streamed response sends its chunks
while the batch still runs, an oversized body is refused from its Content-Length before any of
it is sent or read (a chunked one as it arrives), and other methods, empty and chunked bodies
get their status. Through the openai client where it is the caller, raw sockets where the point
is what is on the wire."""

import http.client
import io
import json
import socket
import threading
import time
import wave

import numpy as np
import openai
import pytest

from torchtitan_speechlm.serving.app import App
from torchtitan_speechlm.serving.batcher import Batcher
from torchtitan_speechlm.serving.server import SpeechServer

RATE = 8000


class FakeModel:
    """Runners: ``tts`` speaks ``len(text)`` chunks of 100 samples; ``asr`` says the length.
    Texts "crash" / "invalid" make a call raise; ``gate`` holds a call until set."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.calls: list[list] = []

    def tts(self, rows, emit):
        texts = [r.text for r in rows]  # SpeechRow (serving/rows.py)
        self.calls.append(texts)
        for row, text in enumerate(texts):
            if text == "crash":
                raise RuntimeError("the decoder fell over")
            if text == "invalid":
                raise ValueError("this text is too long for the model")
            for k in range(len(text)):
                emit(row, np.full(100, 0.1 * (k + 1), np.float32))
                self.entered.set()
                self.gate.wait(10)
        return [100 * len(t) for t in texts]

    def asr(self, rows, emit):
        return [f"{len(r.wave)} samples" for r in rows]


@pytest.fixture
def served():
    model = FakeModel()
    batcher = Batcher({"tts": model.tts, "asr": model.asr}, queue_size=1, max_batch=1,
                      batch_wait_s=0)  # fmt: skip
    lines: list[str] = []
    app = App(batcher, "fake", RATE, RATE, max_upload_bytes=1000, log=lines.append)
    server = SpeechServer(app, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    batcher.start()
    thread.start()
    assert eventually(lambda: server.server.started)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    yield server, model, client, lines
    model.gate.set()
    server.shutdown()
    server.server_close()
    batcher.stop()


def statuses(lines: list[str]) -> list[int]:
    """The status of each access-log line (one JSON object per request)."""
    return [json.loads(line)["status"] for line in lines]


def eventually(check, timeout: float = 10.0) -> bool:
    """``check()`` turns true within ``timeout`` s: a request is counted and logged by its
    handler thread just after its answer is sent."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def health(server) -> dict:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request("GET", "/health")
    return json.loads(conn.getresponse().read())


def test_a_full_queue_answers_503_with_retry_after_at_once(served):
    server, model, client, lines = served
    model.gate.clear()
    first = threading.Thread(target=lambda: client.audio.speech.create(
        model="fake", voice="alloy", input="ab", response_format="wav"))  # fmt: skip
    first.start()
    assert model.entered.wait(10)  # the worker runs the first request, held at the gate
    waiting = threading.Thread(target=lambda: client.audio.speech.create(
        model="fake", voice="alloy", input="cd", response_format="wav"))  # fmt: skip
    waiting.start()
    while health(server)["queue_depth"] < 1:  # the second waits: the queue (size 1) is full
        pass
    with pytest.raises(openai.InternalServerError) as e:
        client.audio.speech.create(model="fake", voice="alloy", input="ef", response_format="wav")
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    assert e.value.body["code"] == "queue_full" and "queue is full" in e.value.body["message"]
    model.gate.set()
    first.join(10)
    waiting.join(10)
    assert eventually(lambda: 503 in statuses(lines))
    assert eventually(lambda: health(server)["requests_failed"] == 1)


def test_a_failing_request_gets_its_error_and_the_server_goes_on(served):
    server, model, client, lines = served
    with pytest.raises(openai.InternalServerError) as e:
        client.audio.speech.create(model="fake", voice="alloy", input="crash")
    assert e.value.status_code == 500 and "the decoder fell over" in e.value.body["message"]
    assert e.value.body["type"] == "server_error"
    with pytest.raises(openai.BadRequestError, match="too long for the model"):
        client.audio.speech.create(model="fake", voice="alloy", input="invalid")
    audio = client.audio.speech.create(model="fake", voice="alloy", input="abc").content
    with wave.open(io.BytesIO(audio)) as w:
        assert (w.getframerate(), w.getnframes(), w.getsampwidth()) == (RATE, 300, 2)
    assert eventually(lambda: health(server)["requests_served"] == 1)
    h = health(server)
    assert h["status"] == "ok" and (h["requests_served"], h["requests_failed"]) == (1, 2)


def test_a_streamed_response_sends_chunks_while_the_batch_still_runs(served):
    server, model, client, lines = served
    model.gate.clear()
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request("POST", "/v1/audio/speech?stream=1", json.dumps({"input": "abc"}),
                 {"Content-Type": "application/json"})  # fmt: skip
    r = conn.getresponse()
    assert r.status == 200 and r.headers["Transfer-Encoding"] == "chunked"
    head = r.read1(44 + 200)  # the header and the first chunk, before the model went on
    assert head[:4] == b"RIFF" and len(model.calls) == 1
    model.gate.set()
    rest = r.read()
    samples = np.frombuffer((head + rest)[44:], "<i2")
    assert len(samples) == 300 and samples[0] == round(0.1 * 32767)
    assert samples[-1] == round(0.3 * 32767)
    with wave.open(io.BytesIO(head + rest)) as w:  # the streamed header: length unknown
        assert w.getframerate() == RATE and len(w.readframes(10**6)) == 600


def raw(server, request: bytes) -> bytes:
    with socket.create_connection(server.server_address[:2], timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_an_oversized_body_is_refused_from_its_content_length_before_it_is_read(served):
    server, model, client, lines = served
    # headers only: the body (a million bytes) is never sent, and the answer comes anyway
    got = raw(server, b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: localhost\r\n"
                      b"Content-Type: multipart/form-data; boundary=b\r\n"
                      b"Content-Length: 1000000\r\n\r\n")  # fmt: skip
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and "1000000 bytes" in err["message"]
    # Expect: 100-continue (curl over 1 MB): refused instead of the 100
    got = raw(server, b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5000\r\n"
                      b"Expect: 100-continue\r\n\r\n")  # fmt: skip
    assert got.startswith(b"HTTP/1.1 413") and b"100 Continue" not in got
    # through the client: a body just over the limit, sent in full and refused
    with pytest.raises(openai.APIStatusError) as e:
        client.audio.transcriptions.create(model="fake", file=("a.wav", b"x" * 2000))
    assert e.value.status_code == 413
    assert eventually(lambda: len(lines) == 3)
    assert statuses(lines) == [413, 413, 413]
    assert health(server)["status"] == "ok"


def test_methods_lengths_and_routes(served):
    server, model, client, lines = served
    assert raw(server, b"PUT /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n"
                       b"Connection: close\r\n\r\n").startswith(b"HTTP/1.1 405")  # fmt: skip
    # no Content-Length and not chunked: an empty body (HTTP/1.1), not JSON
    got = raw(
        server, b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    assert got.startswith(b"HTTP/1.1 400") and b"could not parse the JSON" in got
    # a chunked body is read as it comes (and counted against the limit: test below)
    assert raw(server, b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n").startswith(b"HTTP/1.1 400")  # fmt: skip
    got = raw(server, b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                      b'Transfer-Encoding: chunked\r\n\r\n7\r\n{"input\r\n7\r\n": "a"}\r\n0\r\n\r\n')  # fmt: skip
    assert got.startswith(b"HTTP/1.1 200") and b"RIFF" in got
    assert raw(server, b"POST /v1/nope HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n"
                       b"Connection: close\r\n\r\n{}").startswith(b"HTTP/1.1 404")  # fmt: skip
    # keep-alive: a refused request's body is read, the next request on the connection works
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request("POST", "/v1/audio/speech", b'{"input": ""}')
    r = conn.getresponse()
    assert r.status == 400 and b"empty" in r.read()
    conn.request("POST", "/v1/audio/speech", b'{"input": "a"}')
    r = conn.getresponse()
    assert r.status == 200 and len(r.read()) == 44 + 200
