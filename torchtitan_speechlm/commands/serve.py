"""``torchtitan serve``: one model behind OpenAI's audio routes, on localhost (docs/serving.md).

    torchtitan serve --model DIR [--voices VOICES_DIR] [--host 127.0.0.1] [--port 8000]
        [--api-key KEY | --no-auth] [--queue-size 64] [--max-batch 8] [--batch-wait-ms 10]
        [--max-upload-mb 25] [--header-timeout 10] [--body-timeout 60] [decoding flags]

DIR is what ``torchtitan generate`` takes (an export or a checkpoint step folder). The server's
dependencies (the ``serve`` extra: FastAPI, uvicorn, python-multipart), the API key rule
(serving/auth.py), the model, its tokenizer and codec, and the ``--voices`` (serving/voices.py)
are checked before the server listens: each failure ends the command with one line and exit
status 2. Then the URL is printed, and one JSON line per request (serving/access_log.py).
SIGTERM or Ctrl-C drains: no new connections, the requests in flight finish, exit status 0
(a second signal stops waiting for them: the jobs still queued fail).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from torchtitan_speechlm.commands.generate import decode_config
from torchtitan_speechlm.commands.serve_args import build_parser
from torchtitan_speechlm.generation.loading import load_model
from torchtitan_speechlm.generation.tasks import PromptRefused, check_prompted, input_rate
from torchtitan_speechlm.serving.batcher import Batcher
from torchtitan_speechlm.serving.speech import runners
from torchtitan_speechlm.serving.voices import load_voices

SERVE_DEPS = ("fastapi", "uvicorn", "multipart", "starlette", "pydantic")
try:  # the serve extra; without it the command says what to install (``run``)
    from torchtitan_speechlm.serving.access_log import LOGGER
    from torchtitan_speechlm.serving.app import App
    from torchtitan_speechlm.serving.auth import ENV_KEY, check_exposure
    from torchtitan_speechlm.serving.server import SpeechServer

    MISSING: str | None = None
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in SERVE_DEPS:
        raise
    MISSING = e.name

ROUTES = (
    "POST /v1/audio/speech, POST /v1/audio/transcriptions, GET /health, GET /v1/models, "
    "GET /v1/voices"
)


def _say(line: str) -> None:
    print(line, flush=True)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _refusal(loaded) -> str | None:
    """Why the model takes no speaker prompt (``prompt_audio``), or None: it takes them."""
    try:
        check_prompted(loaded, "prompt_audio")
    except PromptRefused as e:
        return str(e)
    return None


def api_key(a: argparse.Namespace) -> str | None:
    """``--api-key``, else ``TORCHTITAN_SERVE_API_KEY``; None: no key is checked."""
    return a.api_key or os.environ.get(ENV_KEY) or None


def build(a: argparse.Namespace) -> tuple[SpeechServer, Batcher]:
    """The server, bound to its port, and its batcher, not started: everything that can fail
    at start-up (the key rule, the model, its codec, the voices, the port) has failed here, as
    ValueError or OSError."""
    key = api_key(a)
    check_exposure(a.host, key, a.no_auth)
    loaded = load_model(a.model, a.device)
    loaded.tokenizer, loaded.codec  # noqa: B018  (their errors now, not at the first request)
    voices = load_voices(loaded, a.voices) if a.voices else {}
    cfg = decode_config(a)
    batcher = Batcher(
        runners(loaded, cfg),
        queue_size=a.queue_size,
        max_batch=a.max_batch,
        batch_wait_s=a.batch_wait_ms / 1000,
        on_error=lambda where, e: _say(f"error: {where}: {type(e).__name__}: {_one_line(e)}"),
    )
    app = App(
        batcher,
        os.path.basename(os.path.normpath(os.path.abspath(a.model))),
        int(loaded.codec.sample_rate),
        input_rate(loaded),
        max_upload_bytes=int(a.max_upload_mb * (1 << 20)),
        request_timeout_s=a.request_timeout,
        body_timeout_s=a.body_timeout,
        voices=voices,
        prompt_refusal=_refusal(loaded),
        api_key=key,
        say=_say,
    )
    server = SpeechServer(
        app,
        a.host,
        a.port,
        keep_alive_s=a.keep_alive_timeout,
        header_timeout_s=a.header_timeout,
    )
    return server, batcher


def _log_to_stdout() -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


def run(a: argparse.Namespace) -> int:
    if MISSING is not None:
        print(
            f"torchtitan serve: error: the server needs the 'serve' extra (no module named "
            f"{MISSING!r}): pip install 'torchtitan-speechlm[serve]'",
            file=sys.stderr,
        )
        return 2
    try:
        server, batcher = build(a)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"torchtitan serve: error: {_one_line(e)}", file=sys.stderr)
        return 2
    _log_to_stdout()
    app = server.app
    batcher.start()
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        if stop.is_set():  # a second signal: stop waiting for the requests in flight
            server.server.force_exit = True
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    _say(f"torchtitan serve: {app.model_name} on {server.url} ({ROUTES})")
    if app.voices:
        _say(f"voices: {', '.join(sorted(app.voices))}")
    if app.api_key:
        _say("API key required (Authorization: Bearer KEY) on every route but GET /health")
    while thread.is_alive() and not stop.wait(0.2):
        pass
    _say("torchtitan serve: stopping: finishing the requests in flight")
    server.shutdown()  # the requests in flight finish: their jobs, queued or running, are run
    server.server_close()
    batcher.stop()
    _say("torchtitan serve: stopped")
    return 0 if stop.is_set() else 1  # 1: the server ended by itself (its error is above)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
