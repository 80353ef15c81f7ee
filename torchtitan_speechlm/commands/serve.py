"""``torchtitan serve``: one model behind OpenAI's audio routes, on localhost (docs/serving.md).

    torchtitan serve --model DIR [--voices VOICES_DIR] [--host 127.0.0.1] [--port 8000]
        [--api-key KEY | --no-auth] [--queue-size 64] [--max-batch 8] [--batch-wait-ms 10]
        [--max-upload-mb 25] [--header-timeout 10] [--body-timeout 60] [decoding flags]
        [--engine vllm (--vllm-url URL | --vllm-python PATH)]

DIR is what ``torchtitan generate`` takes (an export or a checkpoint step folder). The server's
dependencies (the ``serve`` extra: FastAPI, uvicorn, python-multipart), the API key rule
(serving/auth.py), the model, its tokenizer and codec, and the ``--voices`` (serving/voices.py)
are checked before the server listens: each failure ends the command with one line and exit
status 2. Then the URL is printed, and one JSON line per request (serving/access_log.py).
SIGTERM or Ctrl-C drains: no new connections, the requests in flight finish, exit status 0
(a second signal stops waiting for them: the jobs still queued fail). ``--engine vllm`` runs a
flatten model on a vLLM server (serving/vllm_engine.py; one it starts with --vllm-python is
stopped after the drain).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from torchtitan_speechlm.commands.generate import decode_config
from torchtitan_speechlm.commands.serve_args import build_parser, check_engine_flags
from torchtitan_speechlm.generation.loading import load_model
from torchtitan_speechlm.generation.tasks import PromptRefused, check_prompted, input_rate
from torchtitan_speechlm.serving.batcher import Batcher
from torchtitan_speechlm.serving.speech import runners
from torchtitan_speechlm.serving.vllm_engine import connect, refusal
from torchtitan_speechlm.serving.vllm_process import VllmProcess
from torchtitan_speechlm.serving.voices import load_voices

SERVE_DEPS = ("fastapi", "uvicorn", "multipart", "starlette", "pydantic")
try:  # the serve extra; without it the command says what to install (``run``)
    from torchtitan_speechlm.serving.access_log import LOGGER
    from torchtitan_speechlm.serving.app import App
    from torchtitan_speechlm.serving.auth import ENV_KEY, check_exposure
    from torchtitan_speechlm.serving.metrics import ServeMetrics
    from torchtitan_speechlm.serving.replicas import Replicas
    from torchtitan_speechlm.serving.server import SpeechServer, bind

    MISSING: str | None = None
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in SERVE_DEPS:
        raise
    MISSING = e.name

ROUTES = (
    "POST /v1/audio/speech, POST /v1/audio/transcriptions, GET /health, GET /v1/models, "
    "GET /v1/voices, GET /metrics"
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


def build(a: argparse.Namespace, sock=None, device: str | None = None
          ) -> tuple[SpeechServer, Batcher]:  # fmt: skip
    """The server, bound to its port (or on ``sock``, a replica's), and its batcher, not
    started: everything that can fail at start-up (the key rule, the engine's flags, the
    model, its codec, the voices, a vLLM server, the port) has failed here, as ValueError or
    OSError."""
    key = api_key(a)
    check_exposure(a.host, key, a.no_auth)
    check_engine_flags(a)
    loaded = load_model(a.model, device or a.device)
    loaded.tokenizer, loaded.codec  # noqa: B018  (their errors now, not at the first request)
    voices = load_voices(loaded, a.voices) if a.voices else {}
    cfg = decode_config(a)
    metrics = ServeMetrics(lambda task, rows, results: generated_tokens(loaded, task, results))
    run, workers, process = engine(a, loaded, cfg)
    try:
        batcher = Batcher(
            run,
            queue_size=a.queue_size,
            max_batch=a.max_batch,
            batch_wait_s=a.batch_wait_ms / 1000,
            on_error=lambda where, e: _say(f"error: {where}: {type(e).__name__}: {_one_line(e)}"),
            on_queue=metrics.queue_depth,
            on_batch=metrics.batch,
            workers=workers,
            on_stop=process.stop if process is not None else None,
        )
        return _server(a, sock, key, loaded, voices, metrics, batcher), batcher
    except BaseException:
        if process is not None:
            process.stop()
        raise


def engine(a: argparse.Namespace, loaded, cfg) -> tuple[dict, int, VllmProcess | None]:
    """The batcher's runners, its worker threads, and the vLLM server started for them (or
    None): ``--engine ours``, our decoder on one worker; ``--engine vllm``, the model on the
    vLLM server at --vllm-url or started with --vllm-python (serving/vllm_engine.py)."""
    if a.engine != "vllm":
        return runners(loaded, cfg), 1, None
    why = refusal(loaded)
    if why:
        raise ValueError(why)
    process, url = None, a.vllm_url
    if a.vllm_python:
        process = VllmProcess(a.vllm_python, a.vllm_work, a.vllm_kv_cache_mb, a.vllm_arg,
                              a.vllm_start_timeout, say=_say)  # fmt: skip
        url = process.start(loaded)
    try:
        run = connect(loaded, cfg, url, a.request_timeout).runners()
    except BaseException:
        if process is not None:
            process.stop(keep_work=True)  # its log tells why
        raise
    _say(f"engine: vllm at {url} ({a.vllm_batches_in_flight} batches in flight)")
    return run, a.vllm_batches_in_flight, process


def _server(a, sock, key, loaded, voices, metrics, batcher) -> SpeechServer:
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
        metrics=metrics,
        usage=lambda text, samples: speech_usage(loaded, text, samples),
    )
    return SpeechServer(
        app,
        a.host,
        a.port,
        keep_alive_s=a.keep_alive_timeout,
        header_timeout_s=a.header_timeout,
        sock=sock,
    )


def generated_tokens(loaded, task: str, results) -> int | None:
    """Codec tokens a tts batch generated (frames x codebooks, from its rows' sample
    counts); None for asr (its output is text)."""
    if task != "tts":
        return None
    codec = loaded.codec
    frames = sum(-(-int(n) // int(codec.samples_per_frame)) for n in results)
    return frames * int(codec.num_streams)


def speech_usage(loaded, text: str, samples: int | None) -> dict:
    """OpenAI's usage of a speech answer: the text's tokens in, the codec tokens out."""
    n_in = len(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    n_out = generated_tokens(loaded, "tts", [samples or 0]) or 0
    return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}


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
    if a.replicas < 1:
        print(f"torchtitan serve: error: --replicas {a.replicas}: at least 1", file=sys.stderr)
        return 2
    try:
        check_engine_flags(a)
    except ValueError as e:
        print(f"torchtitan serve: error: {e}", file=sys.stderr)
        return 2
    if a.replicas > 1:
        return run_replicas(a)
    try:
        server, batcher = build(a)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"torchtitan serve: error: {_one_line(e)}", file=sys.stderr)
        return 2
    return serve_until_stopped(a, server, batcher)


def serve_until_stopped(a: argparse.Namespace, server: SpeechServer, batcher: Batcher,
                        ready=None, index: int | None = None) -> int:  # fmt: skip
    """Serve until SIGTERM / Ctrl-C, then drain; a replica reports ready on ``ready``."""
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
    if ready is not None:
        ready.put((index, None))
        _say(f"replica {index} (pid {os.getpid()}) serving")
    else:
        _say(f"torchtitan serve: {app.model_name} on {server.url} ({ROUTES})")
    if app.voices and ready is None:
        _say(f"voices: {', '.join(sorted(app.voices))}")
    if app.api_key and ready is None:
        _say("API key required (Authorization: Bearer KEY) on every route but GET /health")
    while thread.is_alive() and not stop.wait(0.2):
        pass
    _say("torchtitan serve: stopping: finishing the requests in flight")
    server.shutdown()  # the requests in flight finish: their jobs, queued or running, are run
    server.server_close()
    batcher.stop()
    _say("torchtitan serve: stopped")
    return 0 if stop.is_set() else 1  # 1: the server ended by itself (its error is above)


def run_replicas(a: argparse.Namespace) -> int:
    """``--replicas N``: the port bound here, N replica processes serving it
    (serving/replicas.py), the drain on SIGTERM / Ctrl-C."""
    key = api_key(a)
    try:
        check_exposure(a.host, key, a.no_auth)
        sock = bind(a.host, a.port)
    except (ValueError, OSError) as e:
        print(f"torchtitan serve: error: {_one_line(e)}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    replicas = Replicas(a.replicas, sock, replica_main, a, a.device, say=_say)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    error = replicas.start()
    if error is not None:
        print(f"torchtitan serve: error: {_one_line(error)}", file=sys.stderr)
        return 2
    name = os.path.basename(os.path.normpath(os.path.abspath(a.model)))
    _say(f"torchtitan serve: {name} on {url} ({ROUTES}; {a.replicas} replicas)")
    if key:
        _say("API key required (Authorization: Bearer KEY) on every route but GET /health")
    watcher = threading.Thread(target=replicas.watch, daemon=True)
    watcher.start()
    stop.wait()
    _say("torchtitan serve: stopping: each replica finishes its requests in flight")
    status = replicas.stop()
    sock.close()
    _say("torchtitan serve: stopped")
    return status


def replica_main(a: argparse.Namespace, sock, index: int, device: str, threads: int,
                 ready) -> None:  # fmt: skip
    """One replica process (spawned): its model on ``device``, the shared socket, served
    until SIGTERM; its start-up error goes to ``ready``."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    try:
        server, batcher = build(a, sock=sock, device=device)
    except (ValueError, FileNotFoundError, OSError) as e:
        ready.put((index, _one_line(e)))
        sys.exit(2)
    sys.exit(serve_until_stopped(a, server, batcher, ready, index))


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
