"""``torchtitan serve``: one model behind OpenAI's audio routes, on localhost (docs/serving.md).

    torchtitan serve --model DIR [--voices VOICES_DIR] [--host 127.0.0.1] [--port 8000]
        [--queue-size 64] [--max-batch 8] [--batch-wait-ms 10] [--max-upload-mb 25]
        [decoding flags]

DIR is what ``torchtitan generate`` takes (an export or a checkpoint step folder). The model,
its tokenizer and codec load, and the ``--voices`` are read (serving/voices.py), before the
server listens: a folder that is not a SpeechLM's, a model trained without speaker prompts
given ``--voices``, or a voice file that is not audio ends the command with one line. Then the URL is printed, and one line per request (method, route,
status, milliseconds, the size of the batch it ran in). Ctrl-C or SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from torchtitan_speechlm.commands.generate import decode_config
from torchtitan_speechlm.commands.serve_args import build_parser
from torchtitan_speechlm.generation.loading import load_model
from torchtitan_speechlm.generation.tasks import PromptRefused, check_prompted, input_rate
from torchtitan_speechlm.serving.batcher import Batcher
from torchtitan_speechlm.serving.http import App, SpeechServer
from torchtitan_speechlm.serving.speech import runners
from torchtitan_speechlm.serving.voices import load_voices

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


def build(a: argparse.Namespace) -> tuple[SpeechServer, Batcher]:
    """The server, bound to its port, and its batcher, not started: everything that can fail
    at start-up (the model, its codec, the voices, the port) has failed here, as ValueError or
    OSError."""
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
        log=_say,
        voices=voices,
        prompt_refusal=_refusal(loaded),
    )
    return SpeechServer(app, a.host, a.port), batcher


def run(a: argparse.Namespace) -> int:
    try:
        server, batcher = build(a)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"torchtitan serve: error: {_one_line(e)}", file=sys.stderr)
        return 2
    app = server.app
    batcher.start()

    def stop(signum, frame):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    _say(f"torchtitan serve: {app.model_name} on {server.url} ({ROUTES})")
    if app.voices:
        _say(f"voices: {', '.join(sorted(app.voices))}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        batcher.stop()
    _say("torchtitan serve: stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
