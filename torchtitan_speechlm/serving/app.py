"""OpenAI's audio routes as a FastAPI app over a started batcher (serving/batcher.py).

Routes (docs/serving.md):

- ``POST /v1/audio/speech``: JSON (``SpeechRequest``) -> speech in ``response_format`` (wav,
  pcm, flac, mp3, opus, aac: serving/formats.py) at ``speed``, whole or, with ``"stream":
  true``, ``?stream=1`` or ``"stream_format": "audio"``, chunked as it is generated, or with
  ``"stream_format": "sse"`` as OpenAI's server-sent events; ``voice`` (one of ``--voices``) or
  ``prompt_audio`` (base64 audio): a speaker prompt (serving/prompts.py);
- ``POST /v1/audio/transcriptions``: multipart ``file`` (any rate, any channels), ``model``,
  ``response_format`` json|text|verbose_json|srt|vtt, ``language``, ``temperature`` (read by
  python-multipart through Starlette);
- ``GET /health``, ``GET /v1/models``, ``GET /v1/voices``, ``GET /metrics`` (Prometheus).

The routes run on the server's event loop and never block it: decoding an upload and waiting
for a job run on ``waiters``, a thread pool as large as the batcher's queue and one batch, so
that every request the queue admits can wait at once. Around the routes (``asgi``): the access
log (serving/access_log.py), the API key (serving/auth.py), the body limits
(serving/limits.py). Every refusal is OpenAI's error JSON (serving/errors.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from torchtitan_speechlm.serving import formats
from torchtitan_speechlm.serving.access_log import RECORD, AccessLog, Record, log_line
from torchtitan_speechlm.serving.auth import ApiKeyAuth
from torchtitan_speechlm.serving.batcher import Batcher, Job, QueueFull
from torchtitan_speechlm.serving.errors import ApiError
from torchtitan_speechlm.serving.limits import BodyLimit
from torchtitan_speechlm.serving.metrics import ServeMetrics
from torchtitan_speechlm.serving.prompts import PromptError, Voice, request_prompt
from torchtitan_speechlm.serving.rows import AsrRow, SpeechRow
from torchtitan_speechlm.utils.audio import BadAudioError, decode_audio_bytes

MAX_FORM_FIELDS = 32
ROUTES = ("/v1/audio/speech", "/v1/audio/transcriptions", "/health", "/v1/models",
          "/v1/voices", "/metrics")  # fmt: skip
TEMPERATURE_RANGE = (0.0, 1.0)


class SpeechRequest(BaseModel):
    """The JSON body of ``POST /v1/audio/speech``: OpenAI's fields and ours. ``voice``,
    ``stream``, ``speed`` and ``prompt_audio`` are checked where they are used (a client's
    unknown fields are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    input: StrictStr | None = None
    model: Any = None
    voice: Any = None
    response_format: StrictStr | None = None
    stream_format: StrictStr | None = None
    stream: Any = None
    speed: Any = None
    instructions: Any = None
    prompt_audio: Any = None


@dataclass
class App:
    """The routes' state. ``voices``: ``--voices`` (serving/voices.py; empty: ``voice`` is
    ignored); ``prompt_refusal``: why the model takes no speaker prompt (None: it takes them);
    ``api_key``: None serves anyone (serving/auth.py); ``log``: where each request's JSON line
    goes (serving/access_log.py)."""

    batcher: Batcher
    model_name: str
    sample_rate: int  # of the speech written
    upload_rate: int  # uploads are resampled to this
    max_upload_bytes: int = 25 << 20
    retry_after_s: int = 1
    request_timeout_s: float = 600.0
    body_timeout_s: float = 60.0
    voices: dict[str, Voice] = field(default_factory=dict)
    prompt_refusal: str | None = None
    api_key: str | None = None
    metrics: ServeMetrics | None = None  # GET /metrics (serving/metrics.py)
    # a streamed answer's usage (the SSE done event): (input text, samples) -> OpenAI's usage
    usage: Callable[[str, int], dict] = lambda text, samples: {}
    log: Callable[[str], None] = log_line
    say: Callable[[str], None] = print  # error lines
    started: float = field(default_factory=time.time)
    served: int = 0
    failed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _waiters: ThreadPoolExecutor | None = None

    # ---- the ASGI stack ----------------------------------------------------------------------
    def asgi(self):
        """The routes inside the body limits, the key check and the access log."""
        api = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        api.add_api_route("/v1/audio/speech", self.speech, methods=["POST"])
        api.add_api_route("/v1/audio/transcriptions", self.transcriptions, methods=["POST"])
        api.add_api_route("/health", self.health, methods=["GET"])
        api.add_api_route("/v1/models", self.models, methods=["GET"])
        api.add_api_route("/v1/voices", self.list_voices, methods=["GET"])
        api.add_api_route("/metrics", self.metrics_text, methods=["GET"])
        api.add_exception_handler(ApiError, _answer)
        api.add_exception_handler(HTTPException, _routing_error)
        api.add_exception_handler(Exception, self._internal_error)
        return AccessLog(ApiKeyAuth(BodyLimit(api, self.max_upload_bytes, self.body_timeout_s),
                                    self.api_key), self.done)  # fmt: skip

    def done(self, record: Record) -> None:
        """Count a request (not /health) and log its line."""
        if record.path != "/health":
            with self._lock:
                if 0 < record.status < 400:
                    self.served += 1
                else:
                    self.failed += 1
        if record.error:
            self.say(f"error: {record.method} {record.path}: {record.error}")
        if self.metrics is not None:
            route = record.path if record.path in ROUTES else "other"
            self.metrics.request(route, record.status, time.perf_counter() - record.started)
        self.log(record.line())

    async def _internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        return _answer(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    async def off_loop(self, fn: Callable, *args):
        """``fn(*args)`` on a waiter thread (blocking work: a job's wait, an audio decode)."""
        if self._waiters is None:
            size = self.batcher.queue_size + self.batcher.max_batch + 16  # + uploads decoding
            self._waiters = ThreadPoolExecutor(size, thread_name_prefix="serve-wait")
        return await asyncio.get_running_loop().run_in_executor(self._waiters, fn, *args)

    def close(self) -> None:
        if self._waiters is not None:
            self._waiters.shutdown(wait=False, cancel_futures=True)

    # ---- routes ------------------------------------------------------------------------------
    async def speech(self, request: Request) -> Response:
        raw = _json_object(await request.body())
        try:
            req = SpeechRequest.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            param = str(first["loc"][0]) if first["loc"] else None
            raise ApiError(400, f"'{param}': {first['msg']}", param) from None
        if req.input is None:
            raise ApiError(400, "you must provide the text to speak as 'input'", "input")
        if not req.input.strip():
            raise ApiError(400, "'input' is empty: give a text to speak", "input")
        if str(req.instructions or "").strip():
            raise ApiError(400, "instructions are not supported: this model takes no style "
                                "instructions (a voice or prompt_audio sets the speaker)",
                           "instructions", "unsupported_instructions")  # fmt: skip
        query = request.query_params.get("stream", "")
        asked = req.stream is True or query.lower() in ("1", "true", "yes")
        answer = formats.speech_request(req.response_format, req.speed, req.stream_format, asked)
        stream = answer.stream is not None
        args = (raw, self.voices, self.prompt_refusal, self.sample_rate)
        try:  # an uploaded prompt is decoded off the event loop; a voice is a lookup
            uploaded = raw.get("prompt_audio") is not None
            prompt = (
                await self.off_loop(request_prompt, *args) if uploaded else request_prompt(*args)
            )
        except PromptError as e:
            raise ApiError(400, e.message, e.param, e.code) from None
        job = self.submit(request, "tts", SpeechRow(req.input, stream, prompt.codes, prompt.wave))
        pieces = job.stream(self.request_timeout_s)
        if not stream:
            audio = await self.off_loop(_all, pieces)
            samples = np.concatenate(audio) if audio else np.zeros(0, np.float32)
            body = await self.off_loop(answer.whole, samples, self.sample_rate)
            return Response(body, media_type=answer.content_type)
        first = await self.off_loop(_next, pieces)  # the row's errors still get their status
        writer = answer.pieces(self.sample_rate, lambda: self.usage(req.input, job.value))
        return StreamingResponse(
            self._streamed(writer, first, pieces), media_type=answer.content_type
        )

    async def _streamed(self, writer, first, pieces: Iterator) -> AsyncIterator[bytes]:
        piece = first
        while piece is not None:
            data = writer.feed(piece)
            if data:
                yield data
            piece = await self.off_loop(_next, pieces)
        yield writer.close()

    async def transcriptions(self, request: Request) -> Response:
        content_type = request.headers.get("content-type", "")
        if not content_type.lower().startswith("multipart/form-data"):
            raise ApiError(
                400,
                "could not read the form: expected a multipart/form-data body, got "
                f"Content-Type {content_type or 'none'!r}",
            )
        try:
            async with request.form(max_files=1, max_fields=MAX_FORM_FIELDS) as form:
                upload = form.get("file")
                if not isinstance(upload, UploadFile):
                    raise ApiError(
                        400, "you must provide an audio file as the form field 'file'", "file"
                    )
                answer = formats.transcript_request(
                    form.get("response_format"), form.get("language")
                )
                temperature = _transcription_options(form)
                name = upload.filename or "file"
                data = await upload.read()
        except (MultiPartException, HTTPException) as e:
            detail = getattr(e, "message", None) or getattr(e, "detail", str(e))
            raise ApiError(400, f"could not read the form: {detail}") from None
        try:
            wave = await self.off_loop(decode_audio_bytes, data, self.upload_rate, name)
        except BadAudioError as e:
            reason = re.sub(r"<_io\.BytesIO object at \w+>", "the upload", e.reason)
            raise ApiError(
                400, f"the file {name!r} is not audio this server can read: {reason}", "file",
                "invalid_audio",
            ) from None  # fmt: skip
        job = self.submit(request, "asr", AsrRow(wave, temperature))
        text = await self.off_loop(_result, job, self.request_timeout_s)
        body = answer.encode(text, len(wave) / self.upload_rate)
        return Response(body, media_type=answer.content_type)

    async def health(self) -> JSONResponse:
        with self._lock:
            served, failed = self.served, self.failed
        return JSONResponse({
            "status": "ok" if self.batcher.alive else "worker stopped",
            "model": self.model_name,
            **self.batcher.stats(),
            "requests_served": served,
            "requests_failed": failed,
            "sample_rate": self.sample_rate,
            "uptime_s": round(time.time() - self.started, 1),
            "pid": os.getpid(),  # which replica answered (serving/replicas.py)
        })  # fmt: skip

    async def models(self) -> JSONResponse:
        entry = {"id": self.model_name, "object": "model", "created": int(self.started),
                 "owned_by": "torchtitan-speechlm"}  # fmt: skip
        return JSONResponse({"object": "list", "data": [entry]})

    async def metrics_text(self) -> Response:
        """Prometheus's text format (serving/metrics.py); 404 without metrics."""
        if self.metrics is None:
            raise ApiError(404, "this server keeps no metrics", code="not_found")
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def list_voices(self) -> JSONResponse:
        """``--voices``, one entry each (none without it: ``voice`` is then ignored)."""
        data = [self.voices[name].entry() for name in sorted(self.voices)]
        return JSONResponse({"object": "list", "data": data})

    # ---- the queue ---------------------------------------------------------------------------
    def submit(self, request: Request, task: str, payload) -> Job:
        try:
            job = self.batcher.submit(task, payload)
        except QueueFull as e:
            raise ApiError(
                503, f"{e}; retry after {self.retry_after_s} s", code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None  # fmt: skip
        record = request.scope.get(RECORD)
        if record is not None:
            record.job = job  # the access log names the batch it ran in
        return job


def _transcription_options(form) -> float | None:
    """OpenAI's transcription fields beyond the format: ``temperature`` (the text's sampling
    temperature for this request, 0-1; none: the server's), and refusals of what this model
    cannot do, so that nothing asked for is silently dropped: a ``prompt`` (it takes no text
    context), word timestamps, a streamed transcript."""
    if str(form.get("prompt") or "").strip():
        raise ApiError(400, "prompt is not supported: this model transcribes without a text "
                            "context; leave prompt out", "prompt", "unsupported_prompt")  # fmt: skip
    grains = form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")
    if any(g != "segment" for g in grains):
        raise ApiError(400, f"timestamp_granularities {grains}: only 'segment' is supported "
                            "(verbose_json's segments); this model has no word timing",
                       "timestamp_granularities")  # fmt: skip
    if str(form.get("stream") or "").lower() in ("true", "1"):
        raise ApiError(400, "stream is not supported for transcriptions: the transcript comes "
                            "whole", "stream")  # fmt: skip
    raw = form.get("temperature")
    if raw in (None, ""):
        return None
    try:
        t = float(raw)
    except (TypeError, ValueError):
        t = float("nan")
    if not TEMPERATURE_RANGE[0] <= t <= TEMPERATURE_RANGE[1]:
        raise ApiError(400, f"temperature {raw!r} must be a number from 0 to 1", "temperature")
    return t


def _row_error(e: Exception) -> ApiError:
    """A row's failure: the request's fault (ValueError: an empty text, a prompt over the
    context, audio the codec refuses) -> 400; anything else -> 500."""
    if isinstance(e, TimeoutError):
        return ApiError(500, str(e), code="timeout")
    if isinstance(e, ValueError):
        return ApiError(400, str(e))
    return ApiError(500, f"the model failed on this request: {type(e).__name__}: {e}")


def _next(pieces: Iterator):
    """A job's next piece (None at its end); its error as the ApiError to answer with."""
    try:
        return next(pieces, None)
    except Exception as e:
        raise _row_error(e) from None


def _all(pieces: Iterator) -> list:
    out = []
    while (piece := _next(pieces)) is not None:
        out.append(piece)
    return out


def _result(job: Job, timeout: float):
    try:
        return job.result(timeout)
    except Exception as e:
        raise _row_error(e) from None


def _json_object(body: bytes) -> dict:
    try:
        req = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"We could not parse the JSON body of your request: {e}") from None
    except RecursionError:
        raise ApiError(400, "We could not parse the JSON body of your request: it is nested "
                            "too deeply") from None  # fmt: skip
    if not isinstance(req, dict):
        raise ApiError(400, "the JSON body must be an object")
    return req


def _answer(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _routing_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's 404 / 405 (and any other HTTPException) as OpenAI's error."""
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        error = ApiError(404, f"Invalid URL ({method} {path})", code="not_found")
    elif exc.status_code == 405:
        error = ApiError(405, f"{method} is not allowed on {path}", headers=exc.headers or {})
    else:
        error = ApiError(exc.status_code, str(exc.detail), headers=exc.headers or {})
    return _answer(request, error)
