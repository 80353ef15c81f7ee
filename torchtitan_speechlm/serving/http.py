"""The OpenAI-compatible routes on the standard library's ``ThreadingHTTPServer``.

One thread per connection parses and checks a request, decodes an upload, and puts a job on
the batcher's queue (serving/batcher.py); the model worker runs it; the request thread writes
the answer. Routes (docs/serving.md):

- ``POST /v1/audio/speech``: JSON ``{"model", "input", "voice", "response_format": "wav",
  "speed", "stream", "prompt_audio"}`` -> ``audio/wav`` (16-bit PCM at the codec's rate);
  ``"stream": true``, ``?stream=1`` or ``"stream_format": "audio"``: chunked transfer, the
  samples as they are generated (serving/speech.py); ``voice`` (one of ``--voices``) or
  ``prompt_audio`` (base64 audio): a speaker prompt (serving/prompts.py);
- ``POST /v1/audio/transcriptions``: multipart ``file`` (any rate, any channels) and
  ``model``, ``response_format`` json|text -> ``{"text": ...}`` or the text;
- ``GET /health``, ``GET /v1/models``, ``GET /v1/voices``.

Errors are OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``: 400 a bad
request, 404 an unknown route, 405 a known route with another method, 411 a POST without
Content-Length, 413 a body over ``max_upload_bytes`` (decided from Content-Length before the
body is read), 500 the model failed on the row, 503 (with Retry-After) the queue is full.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import numpy as np

from torchtitan_speechlm.serving.batcher import Batcher, QueueFull
from torchtitan_speechlm.serving.multipart import MultipartError, parse_multipart
from torchtitan_speechlm.serving.prompts import PromptError, Voice, request_prompt
from torchtitan_speechlm.serving.rows import SpeechRow
from torchtitan_speechlm.serving.wav import pcm16, wav_bytes, wav_header
from torchtitan_speechlm.utils.audio import BadAudioError, decode_audio_bytes

SPEECH_FORMATS = ("wav",)
TRANSCRIPTION_FORMATS = ("json", "text")
STREAM_FORMATS = ("audio",)
DRAIN_LIMIT = 16 << 20  # bytes of a refused body read and dropped so that the client sees the 413


class HttpError(Exception):
    """An answer other than success, as OpenAI's error JSON."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
             411: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}  # fmt: skip

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


@dataclass
class App:
    """The routes over a started batcher (tasks ``tts`` and ``asr``, serving/speech.py).
    ``voices``: ``--voices`` (serving/voices.py; empty: ``voice`` is ignored);
    ``prompt_refusal``: why the model takes no speaker prompt (None: it takes them)."""

    batcher: Batcher
    model_name: str
    sample_rate: int  # of the speech written
    upload_rate: int  # uploads are resampled to this
    max_upload_bytes: int = 25 << 20
    retry_after_s: int = 1
    request_timeout_s: float = 600.0
    voices: dict[str, Voice] = field(default_factory=dict)
    prompt_refusal: str | None = None
    log: Callable[[str], None] = print
    started: float = field(default_factory=time.time)
    served: int = 0
    failed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- dispatch ----------------------------------------------------------------------------
    def routes(self) -> dict[tuple[str, str], Callable]:
        return {
            ("POST", "/v1/audio/speech"): self.speech,
            ("POST", "/v1/audio/transcriptions"): self.transcriptions,
            ("GET", "/health"): self.health,
            ("GET", "/v1/models"): self.models,
            ("GET", "/v1/voices"): self.list_voices,
        }

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        t0 = time.perf_counter()
        url = urlsplit(h.path)
        status, batch = 500, 0
        # the job of this request once queued (a keep-alive connection reuses its handler)
        h.serve_job = None
        try:
            body = self.read_body(h) if method == "POST" else b""
            route = self.routes().get((method, url.path))
            if route is None:
                if any(path == url.path for _, path in self.routes()):
                    raise HttpError(405, f"{method} is not allowed on {url.path}")
                raise HttpError(404, f"Invalid URL ({method} {url.path})", code="not_found")
            status, batch = route(h, body, parse_qs(url.query))
        except HttpError as e:
            status = e.status
            send_json(h, e.status, e.body(), e.headers)
        except (BrokenPipeError, ConnectionResetError):
            status, h.close_connection = 499, True  # the client went away
        except Exception as e:  # a bug of ours: an answer all the same
            status = 500
            self.log(f"error: {method} {url.path}: {type(e).__name__}: {e}")
            try:
                send_json(h, 500, HttpError(500, f"internal error: {e}").body())
            except OSError:
                h.close_connection = True
        if h.serve_job is not None:  # a failed row too: the batch it ran in
            batch = h.serve_job.batch_size
        self.done(method, url.path, status, 1000 * (time.perf_counter() - t0), batch)

    def done(self, method: str, path: str, status: int, ms: float, batch: int = 0) -> None:
        """Count a request (not /health) and log its line."""
        if path != "/health":
            with self._lock:
                if status < 400:
                    self.served += 1
                else:
                    self.failed += 1
        self.log(f"{method} {path} {status} {ms:.1f} ms batch {batch or '-'}")

    def check_length(self, h: BaseHTTPRequestHandler) -> int:
        """The Content-Length of a POST, refused (413) before any of the body is read."""
        if "chunked" in h.headers.get("Transfer-Encoding", "").lower():
            raise HttpError(411, "send the request body with a Content-Length, not chunked")
        try:
            n = int(h.headers.get("Content-Length", ""))
        except ValueError:
            raise HttpError(411, "a POST needs a Content-Length header") from None
        if n < 0:
            raise HttpError(400, "a negative Content-Length")
        if n > self.max_upload_bytes:
            mb = self.max_upload_bytes / (1 << 20)
            raise HttpError(
                413,
                f"the request body is {n} bytes, over this server's limit of "
                f"{self.max_upload_bytes} bytes (--max-upload-mb {mb:g})",
                code="request_too_large",
            )
        return n

    def read_body(self, h: BaseHTTPRequestHandler) -> bytes:
        try:
            n = self.check_length(h)
        except HttpError as e:
            if e.status == 413:
                _drain(h, int(h.headers.get("Content-Length", "0")))  # dropped, never kept
            h.close_connection = True
            raise
        data = h.rfile.read(n)
        if len(data) != n:
            h.close_connection = True
            raise HttpError(400, f"the body ended after {len(data)} of {n} bytes")
        return data

    # ---- routes ------------------------------------------------------------------------------
    def speech(self, h, body: bytes, query: dict) -> tuple[int, int]:
        req = _json_object(body)
        text = req.get("input")
        if text is None:
            raise HttpError(400, "you must provide the text to speak as 'input'", "input")
        if not isinstance(text, str):
            raise HttpError(400, "'input' must be a string", "input")
        if not text.strip():
            raise HttpError(400, "'input' is empty: give a text to speak", "input")
        fmt = req.get("response_format") or "wav"
        if fmt not in SPEECH_FORMATS:
            raise HttpError(
                400,
                f"response_format {fmt!r} is not supported; supported: {', '.join(SPEECH_FORMATS)}",
                "response_format",
                "unsupported_response_format",
            )
        stream_format = req.get("stream_format")
        if stream_format is not None and stream_format not in STREAM_FORMATS:
            raise HttpError(
                400,
                f"stream_format {stream_format!r} is not supported; supported: "
                f"{', '.join(STREAM_FORMATS)}",
                "stream_format",
            )
        stream = (
            req.get("stream") is True
            or stream_format == "audio"
            or query.get("stream", [""])[-1].lower() in ("1", "true", "yes")
        )
        try:
            prompt = request_prompt(req, self.voices, self.prompt_refusal, self.sample_rate)
        except PromptError as e:
            raise HttpError(400, e.message, e.param, e.code) from None
        job = self.submit(h, "tts", SpeechRow(text, stream, prompt.codes, prompt.wave))
        chunks = self.pieces(job.stream(self.request_timeout_s))
        if not stream:
            audio = [c for c in chunks]
            samples = np.concatenate(audio) if audio else np.zeros(0, np.float32)
            send_bytes(h, 200, wav_bytes(samples, self.sample_rate), "audio/wav")
            return 200, job.batch_size
        first = next(chunks, None)  # the row's errors still answer with their status
        h.send_response(200)
        h.send_header("Content-Type", "audio/wav")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        _chunk(h, wav_header(self.sample_rate, None))
        try:
            if first is not None:
                _chunk(h, pcm16(first))
            for piece in chunks:
                _chunk(h, pcm16(piece))
        except HttpError as e:  # the status is sent: end the stream unfinished
            self.log(f"error: the stream ended early: {e.message}")
            h.close_connection = True
            return e.status, job.batch_size
        _chunk(h, b"")
        return 200, job.batch_size

    def transcriptions(self, h, body: bytes, query: dict) -> tuple[int, int]:
        try:
            form = parse_multipart(body, h.headers.get("Content-Type", ""))
        except MultipartError as e:
            raise HttpError(400, f"could not read the form: {e}") from None
        upload = form.get("file")
        if upload is None:
            raise HttpError(400, "you must provide an audio file as the form field 'file'", "file")
        fmt = form["response_format"].text() if "response_format" in form else "json"
        if fmt not in TRANSCRIPTION_FORMATS:
            raise HttpError(
                400,
                f"response_format {fmt!r} is not supported; supported: "
                f"{', '.join(TRANSCRIPTION_FORMATS)}",
                "response_format",
                "unsupported_response_format",
            )
        name = upload.filename or "file"
        try:
            wave = decode_audio_bytes(upload.data, self.upload_rate, name)
        except BadAudioError as e:
            reason = re.sub(r"<_io\.BytesIO object at \w+>", "the upload", e.reason)
            raise HttpError(
                400, f"the file {name!r} is not audio this server can read: {reason}", "file",
                "invalid_audio",
            ) from None  # fmt: skip
        job = self.submit(h, "asr", wave)
        text = self.result(job)
        if fmt == "text":
            send_bytes(h, 200, (text + "\n").encode(), "text/plain; charset=utf-8")
        else:
            send_json(h, 200, {"text": text})
        return 200, job.batch_size

    def health(self, h, body: bytes, query: dict) -> tuple[int, int]:
        with self._lock:
            served, failed = self.served, self.failed
        send_json(h, 200, {
            "status": "ok" if self.batcher.alive else "worker stopped",
            "model": self.model_name,
            **self.batcher.stats(),
            "requests_served": served,
            "requests_failed": failed,
            "sample_rate": self.sample_rate,
            "uptime_s": round(time.time() - self.started, 1),
        })  # fmt: skip
        return 200, 0

    def models(self, h, body: bytes, query: dict) -> tuple[int, int]:
        entry = {"id": self.model_name, "object": "model", "created": int(self.started),
                 "owned_by": "torchtitan-speechlm"}  # fmt: skip
        send_json(h, 200, {"object": "list", "data": [entry]})
        return 200, 0

    def list_voices(self, h, body: bytes, query: dict) -> tuple[int, int]:
        """``--voices``, one entry each (none without it: ``voice`` is then ignored)."""
        data = [self.voices[name].entry() for name in sorted(self.voices)]
        send_json(h, 200, {"object": "list", "data": data})
        return 200, 0

    # ---- the queue ---------------------------------------------------------------------------
    def submit(self, h, task: str, payload):
        try:
            h.serve_job = self.batcher.submit(task, payload)
            return h.serve_job
        except QueueFull as e:
            raise HttpError(
                503, f"{e}; retry after {self.retry_after_s} s", code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None  # fmt: skip

    def pieces(self, it: Iterator) -> Iterator:
        """A job's pieces, its error as the HttpError to answer with."""
        try:
            yield from it
        except Exception as e:
            raise _row_error(e) from None

    def result(self, job):
        try:
            return job.result(self.request_timeout_s)
        except Exception as e:
            raise _row_error(e) from None


def _row_error(e: Exception) -> HttpError:
    """A row's failure: the request's fault (ValueError: an empty text, a prompt over the
    context, audio the codec refuses) -> 400; anything else -> 500."""
    if isinstance(e, TimeoutError):
        return HttpError(500, str(e), code="timeout")
    if isinstance(e, ValueError):
        return HttpError(400, str(e))
    return HttpError(500, f"the model failed on this request: {type(e).__name__}: {e}")


def _json_object(body: bytes) -> dict:
    try:
        req = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HttpError(400, f"We could not parse the JSON body of your request: {e}") from None
    if not isinstance(req, dict):
        raise HttpError(400, "the JSON body must be an object")
    return req


def send_bytes(h, status: int, data: bytes, content_type: str, headers: dict | None = None):
    h.send_response(status)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    if h.close_connection:
        h.send_header("Connection", "close")
    h.end_headers()
    h.wfile.write(data)


def send_json(h, status: int, obj, headers: dict | None = None):
    send_bytes(h, status, json.dumps(obj).encode(), "application/json", headers)


def _chunk(h, data: bytes) -> None:
    h.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
    h.wfile.flush()


def _drain(h, n: int) -> None:
    """Read and drop up to ``n`` bytes (at most DRAIN_LIMIT, 2 s) of a refused body, so that the
    client, still sending it, reads the answer rather than a reset connection."""
    left = min(n, DRAIN_LIMIT)
    h.connection.settimeout(2.0)
    try:
        while left > 0:
            got = h.rfile.read1(min(left, 1 << 16)) if hasattr(h.rfile, "read1") else b""
            if not got:
                break
            left -= len(got)
    except OSError:  # the timeout too
        pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked responses
    server_version = "torchtitan-speechlm"
    server: SpeechServer

    def do_GET(self):
        self.server.app.handle(self, "GET")

    def do_POST(self):
        self.server.app.handle(self, "POST")

    def do_PUT(self):
        self.server.app.handle(self, "PUT")

    def do_DELETE(self):
        self.server.app.handle(self, "DELETE")

    def handle_expect_100(self):
        """``Expect: 100-continue`` (curl, over 1 MB): an oversized body is refused before the
        client sends it."""
        try:
            self.server.app.check_length(self)
        except HttpError as e:
            if e.status != 413:
                return super().handle_expect_100()
            self.close_connection = True
            send_json(self, 413, e.body())
            self.server.app.done(self.command, urlsplit(self.path).path, 413, 0.0)
            return False
        return super().handle_expect_100()

    def log_message(self, format, *args):  # noqa: A002  (App.handle logs one line per request)
        pass


class SpeechServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, app: App, host: str = "127.0.0.1", port: int = 8000):
        self.app = app
        super().__init__((host, port), Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"
