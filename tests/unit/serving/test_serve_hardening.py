"""What the HTTP layer refuses, over fake runners in this process (no model), each refusal
followed by a request that still works: the API key (401 in OpenAI's shape, ``/health`` open,
a non-loopback ``--host`` refused without a key), inputs meant to break the server (a wav whose
header claims 2^31 samples, a body that is not UTF-8, JSON nested 100,000 deep, a ``voice`` that
is a path), bodies over the limit as they stream in (chunked), slow clients (headers or body
trickling past short timeouts: 408 and the connection closed), refusals made from the headers
of a large upload reaching a client still sending it (the lingering close), the access log's
JSON line, and the command without the ``serve`` extra."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import pytest

from torchtitan_speechlm import cli
from torchtitan_speechlm.serving import gate
from torchtitan_speechlm.serving.app import App
from torchtitan_speechlm.serving.auth import bearer_ok, check_exposure
from torchtitan_speechlm.serving.batcher import Batcher
from torchtitan_speechlm.serving.gate import RateLimits
from torchtitan_speechlm.serving.prompts import Voice
from torchtitan_speechlm.serving.server import SpeechServer

RATE = 8000
KEY = "s3cret-key"


def tts(rows, emit):
    for i, row in enumerate(rows):
        emit(i, np.full(100 * len(row.text), 0.1, np.float32))
    return [100 * len(r.text) for r in rows]


def asr(waves, emit):
    return [f"{len(w)} samples" for w in waves]


@contextlib.contextmanager
def serving(header_timeout_s: float = 10.0, **app_kw):
    """A server over the fake runners on a free port: (server, access-log lines)."""
    batcher = Batcher({"tts": tts, "asr": asr}, queue_size=4, max_batch=2, batch_wait_s=0)
    lines: list[str] = []
    app_kw.setdefault("max_upload_bytes", 1 << 20)
    app = App(batcher, "fake", RATE, RATE, log=lines.append, say=lambda line: None, **app_kw)
    server = SpeechServer(app, "127.0.0.1", 0, header_timeout_s=header_timeout_s)
    batcher.start()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server, lines
    finally:
        server.shutdown(10)
        server.server_close()
        batcher.stop()


def call(server, method: str, path: str, body: bytes | None = None, headers=None):
    conn = http.client.HTTPConnection(*server.server_address, timeout=10)
    conn.request(method, path, body, headers or {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict(r.headers), data


def alive(server, headers=None) -> None:
    """The server still answers: its health, and a speech request end to end."""
    status, _, body = call(server, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = call(server, "POST", "/v1/audio/speech", b'{"input": "hi"}', headers)
    assert status == 200 and body[:4] == b"RIFF", body[:200]


def error(body: bytes) -> dict:
    return json.loads(body)["error"]


def test_the_api_key_is_required_on_every_route_but_health():
    with serving(api_key=KEY) as (server, lines):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, head, body = call(server, "POST", "/v1/audio/speech", b'{"input": "a"}',
                                      headers)  # fmt: skip
            assert status == 401 and head["www-authenticate"] == "Bearer"
            assert error(body)["code"] == "invalid_api_key"
            assert error(body)["type"] == "invalid_request_error"
        assert call(server, "GET", "/v1/models")[0] == 401
        assert call(server, "GET", "/no/such/route")[0] == 401  # routes are not revealed
        assert call(server, "GET", "/health")[0] == 200
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["fake"]
        alive(server, {"Authorization": f"Bearer {KEY}"})
    assert bearer_ok(f"bearer {KEY}", KEY) and not bearer_ok(f"Bearer {KEY}x", KEY)
    assert not bearer_ok(None, KEY) and not bearer_ok(f"Basic {KEY}", KEY)


def test_a_non_loopback_host_needs_a_key_or_no_auth(monkeypatch, capsys):
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_exposure(host, None, False)
    for host in ("0.0.0.0", "192.168.1.5", "::", "example.com"):
        with pytest.raises(ValueError, match="--api-key"):
            check_exposure(host, None, False)
        check_exposure(host, KEY, False)
        check_exposure(host, None, True)
    # the command refuses before loading the model (there is none here)
    monkeypatch.delenv("TORCHTITAN_SERVE_API_KEY", raising=False)
    assert cli.main(["serve", "--model", "/no/model", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "listens beyond this machine without an API key" in err and "--no-auth" in err
    monkeypatch.setenv("TORCHTITAN_SERVE_API_KEY", KEY)  # the key from the environment
    assert cli.main(["serve", "--model", "/no/model", "--host", "0.0.0.0"]) == 2
    assert "API key" not in capsys.readouterr().err  # past the key rule: the model is missing


def huge_wav_header() -> bytes:
    """A 16-bit mono wav whose data chunk claims 2^31 samples and holds 1,600."""
    size = 2**32 - 2  # 2^31 - 1 samples of 2 bytes: the largest the field holds
    return (b"RIFF" + struct.pack("<I", (36 + size) & 0xFFFFFFFF) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, RATE, 2 * RATE, 2, 16)
            + b"data" + struct.pack("<I", size) + b"\0" * 3200)  # fmt: skip


def form(name: str, data: bytes) -> tuple[bytes, dict]:
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + name.encode()
            + b"\"\r\nContent-Type: audio/wav\r\n\r\n" + data + b"\r\n--XyZ--\r\n")  # fmt: skip
    return body, {"Content-Type": "multipart/form-data; boundary=XyZ"}


def test_inputs_meant_to_break_the_server_are_400s_and_it_goes_on():
    voice = Voice("alice", "/voices/alice.wav", 1.0, 1.0, np.zeros((4, 2), np.int64))
    with serving(voices={"alice": voice}) as (server, lines):
        status, _, body = call(server, "POST", "/v1/audio/transcriptions",
                               *form("huge.wav", huge_wav_header()))  # fmt: skip
        assert status == 400 and error(body)["code"] == "invalid_audio"
        assert "truncated" in error(body)["message"]
        alive(server)
        status, _, body = call(server, "POST", "/v1/audio/speech", b'{"input": "\xff\xfe caf\xe9"}')
        assert status == 400 and "could not parse the JSON" in error(body)["message"]
        alive(server)
        for nested in (b"[" * 100_000 + b"]" * 100_000,
                       b'{"input": "a", "voice": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):  # fmt: skip
            status, _, body = call(server, "POST", "/v1/audio/speech", nested)
            assert status == 400 and "nested too deeply" in error(body)["message"]
            alive(server)
        for name in ("../alice", "/voices/alice.wav", "alice/../alice", "./alice", "alice.wav"):
            req = json.dumps({"input": "hi", "voice": name}).encode()
            status, _, body = call(server, "POST", "/v1/audio/speech", req)
            assert status == 400 and error(body)["code"] == "voice_not_found", (name, body)
            alive(server)
        status, _, body = call(server, "POST", "/v1/audio/speech",
                               b'{"input": "hi", "voice": "alice"}')  # fmt: skip
        assert status == 200


def test_a_symlink_out_of_the_voices_folder_is_refused_at_start(tmp_path):
    from torchtitan_speechlm.serving.voices import voice_files

    voices, outside = tmp_path / "voices", tmp_path / "secret.wav"
    voices.mkdir()
    outside.write_bytes(b"RIFF")
    (voices / "alice.wav").write_bytes(b"RIFF")
    (voices / "bob.wav").symlink_to(voices / "alice.wav")  # inside the folder: a voice
    assert sorted(voice_files(str(voices))) == ["alice", "bob"]
    (voices / "eve.wav").symlink_to(outside)
    with pytest.raises(ValueError, match="eve.wav is a link to .*outside the folder"):
        voice_files(str(voices))


def raw(server, *pieces: bytes, pause: float = 0.0) -> tuple[bytes, float]:
    """Send ``pieces`` (``pause`` s apart), read to the end: (what came back, seconds taken)."""
    t0 = time.monotonic()
    with socket.create_connection(server.server_address, timeout=10) as s:
        for piece in pieces:
            s.sendall(piece)
            time.sleep(pause)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out, time.monotonic() - t0


def test_a_refusal_from_the_headers_reaches_a_client_still_sending_a_large_body():
    """A 401, a 413 and a 429 decided before the body is read: ``http.client`` sends its whole
    8 MB body, then reads. The server answers, shuts its side and drops the rest unread
    (serving/linger.py); closing at once instead resets the connection under the client's
    send (ConnectionResetError / BrokenPipeError) and it never sees why. A client that sends a
    large body again before its 429's Retry-After is closed at once (reset): it pays for the
    ignored wait, not the server."""
    big = b"x" * (8 << 20)
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    limits = RateLimits(2)
    with serving(api_key=KEY, rate_limits=limits, max_upload_bytes=1 << 20) as (server, lines):
        status, head, body = call(server, "POST", "/v1/audio/speech", big, {})
        assert status == 401 and error(body)["code"] == "invalid_api_key"
        assert head["connection"] == "close"
        status, head, body = call(server, "POST", "/v1/audio/speech", big, auth)
        assert status == 413 and error(body)["code"] == "request_too_large"
        status, _, body = call(server, "POST", "/v1/audio/speech", b'{"input": "hi"}', auth)
        assert status == 200 and body[:4] == b"RIFF"
        status, head, body = call(server, "POST", "/v1/audio/speech", big, auth)
        assert status == 429 and error(body)["code"] == "rate_limited", body[:300]
        assert head["connection"] == "close" and int(head["retry-after"]) >= 1
        assert limits.came_early("key api-key")  # the next comes before the Retry-After
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            call(server, "POST", "/v1/audio/speech", b"x" * (12 << 20), auth)
        # a small body refused by the same limit keeps its connection (skipped, not lingered)
        status, head, _ = call(server, "POST", "/v1/audio/speech", b'{"input": "hi"}', auth)
        assert status == 429 and "connection" not in head
        deadline = time.monotonic() + 10  # each line is written just after its answer
        while len(lines) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [json.loads(line)["status"] for line in lines] == [401, 413, 200, 429, 429, 429]


def test_a_key_that_ignores_retry_after_waits_for_its_next_429(monkeypatch):
    """The first 429 is answered at once; a request sent before its Retry-After has passed
    waits ``HOLD_S`` for its own (so a client that ignores the wait sends one a second per
    connection, not hundreds), unless ``HELD_MAX`` wait already; requests within the limits
    are never held."""
    monkeypatch.setattr(gate, "HOLD_S", 3.0)
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    speech = ("POST", "/v1/audio/speech", b'{"input": "hi"}', auth)

    def timed() -> tuple[int, float]:
        t = time.monotonic()
        status = call(server, *speech)[0]
        return status, time.monotonic() - t

    with serving(api_key=KEY, rate_limits=RateLimits(2)) as (server, lines):
        assert [timed()[0] for _ in range(2)] == [200, 200]
        status, first = timed()
        assert status == 429 and first < 1.5, first
        status, held = timed()
        assert status == 429 and held >= 2.9, held
        monkeypatch.setattr(gate, "HELD_MAX", 0)
        status, unheld = timed()
        assert status == 429 and unheld < 1.5, unheld


def test_a_chunked_body_is_counted_as_it_arrives():
    with serving(max_upload_bytes=1000) as (server, lines):
        head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n"
                b"Content-Type: application/json\r\n\r\n")  # fmt: skip
        chunk = b"190\r\n" + b" " * 400 + b"\r\n"  # 400 bytes each: the third passes 1000
        got, _ = raw(server, head, chunk, chunk, chunk, chunk, pause=0.05)
        assert got.startswith(b"HTTP/1.1 413")
        assert error(got.split(b"\r\n\r\n", 1)[1])["code"] == "request_too_large"
        alive(server)


def test_slow_clients_get_408_and_their_connection_closed():
    with serving(header_timeout_s=0.5, body_timeout_s=0.5) as (server, lines):
        # headers trickling: cut off at the header timeout
        got, took = raw(
            server, b"POST /v1/audio/speech HTTP/1.1\r\n", b"Host: localhost\r\n", pause=0.3
        )
        assert got.startswith(b"HTTP/1.1 408") and took < 5, (got, took)
        # a connection that never sends anything: closed
        got, took = raw(server)
        assert got == b"" and took < 5
        # a body that stops half-way: the body timeout
        got, took = raw(server, b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\n"
                                b"Content-Length: 100\r\n\r\n{\"input\"")  # fmt: skip
        assert got.startswith(b"HTTP/1.1 408") and took < 5, (got, took)
        assert error(got.split(b"\r\n\r\n", 1)[1])["code"] == "request_timeout"
        alive(server)


def test_each_request_is_one_json_access_log_line():
    with serving(api_key=KEY) as (server, lines):
        auth = {"Authorization": f"Bearer {KEY}"}
        alive(server, auth)
        call(server, "POST", "/v1/audio/speech", b'{"input": ""}', auth)
        call(server, "GET", "/v1/models")
        deadline = time.monotonic() + 10
        while len(lines) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    records = [json.loads(line) for line in lines]
    assert [(r["method"], r["path"], r["status"]) for r in records] == [
        ("GET", "/health", 200), ("POST", "/v1/audio/speech", 200),
        ("POST", "/v1/audio/speech", 400), ("GET", "/v1/models", 401)]  # fmt: skip
    speech = records[1]
    assert speech["bytes"] == 44 + 2 * 200 and speech["batch"] == 1 and speech["ms"] > 0
    assert speech["client"].startswith("127.0.0.1:") and records[2]["batch"] is None


def test_serve_without_the_serve_extra_names_what_to_install():
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from torchtitan_speechlm import cli\n"
            "sys.exit(cli.main(['serve', '--model', 'nowhere']))\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pip install 'torchtitan-speechlm[serve]'" in r.stderr and "fastapi" in r.stderr
