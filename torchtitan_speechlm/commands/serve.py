"""``torchtitan serve``: one model behind OpenAI's audio routes, on localhost (docs/serving.md).

    torchtitan serve --model DIR [--voices VOICES_DIR] [--host 127.0.0.1] [--port 8000]
        [--api-key KEY | --api-key-file FILE | --no-auth] [--queue-size 64] [--max-batch 8]
        [--batch-wait-ms 10] [--max-upload-mb 25] [--max-input-chars 4096]
        [--max-audio-seconds 600] [--max-requests N] [--requests-per-minute N]
        [--audio-seconds-per-minute S] [--body-mb-per-minute M] [--header-timeout 10]
        [--body-timeout 60] [--drain-seconds 25] [decoding flags]
        [--engine vllm (--vllm-url URL | --vllm-python PATH)]

DIR is what ``torchtitan generate`` takes (an export or a checkpoint step folder). The server's
dependencies (the ``serve`` extra: FastAPI, uvicorn, python-multipart), the API key rule
(serving/auth.py), the model, its tokenizer and codec, and the ``--voices`` (serving/voices.py)
are checked before the server listens: each failure ends the command with one line and exit
status 2. Then the URL is printed, and one JSON line per request (serving/access_log.py).
SIGTERM or Ctrl-C drains: no new connections, the requests in flight finish within
``--drain-seconds`` (then they are cancelled), exit status 0 (a second signal stops waiting
for them: the jobs still queued fail). ``--engine vllm`` runs a
flatten model on a vLLM server (serving/vllm_engine.py; one it starts with --vllm-python is
stopped after the drain).

``serve(ServeArgs)`` is the command as a Python function (commands/serve_args.py: the settings,
one field per flag); ``main(argv)`` parses a command line into it. Its checks run once, before
anything is loaded: the flags (``ServeArgs.validate``: the engine's, the bounds, --replicas),
then the keys and who may reach the server (``access``: the key ring, the exposure rule); the
server is then built with that key ring (``build``), in this process or, with ``--replicas``,
in each replica process (the ring travels to it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from torchtitan_speechlm.commands.decoding import decode_config
from torchtitan_speechlm.commands.serve_args import ServeArgs, build_parser
from torchtitan_speechlm.generation.loading import load_model
from torchtitan_speechlm.generation.tasks import (
    PromptRefused,
    check_prompted,
    input_rate,
    max_input_seconds,
)
from torchtitan_speechlm.serving.auth import ENV_KEY, check_exposure
from torchtitan_speechlm.serving.batcher import Batcher
from torchtitan_speechlm.serving.keys import KeyRing
from torchtitan_speechlm.serving.speech import runners
from torchtitan_speechlm.serving.vllm_engine import connect, refusal
from torchtitan_speechlm.serving.vllm_process import VllmProcess
from torchtitan_speechlm.serving.voices import load_voices

SERVE_DEPS = ("fastapi", "uvicorn", "multipart", "starlette", "pydantic")
try:  # the serve extra; without it the command says what to install (``serve``)
    from torchtitan_speechlm.serving.access_log import LOGGER
    from torchtitan_speechlm.serving.app import App
    from torchtitan_speechlm.serving.browsers import default_trusted_hosts, split_list
    from torchtitan_speechlm.serving.errors import Redactions
    from torchtitan_speechlm.serving.gate import MIB, RateLimits
    from torchtitan_speechlm.serving.metrics import ServeMetrics
    from torchtitan_speechlm.serving.replicas import Replicas
    from torchtitan_speechlm.serving.server import SpeechServer, bind

    MISSING: str | None = None
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in SERVE_DEPS:
        raise
    MISSING = e.name

ROUTES = (
    "POST /v1/audio/speech, POST /v1/audio/transcriptions, GET /health, GET /ready, "
    "GET /v1/models, GET /v1/voices, GET /metrics"
)
VLLM_KEY_ENV = "TORCHTITAN_VLLM_API_KEY"  # --vllm-api-key's default
STOP_WORKER_S = 3.0  # after the drain: the worker's batch, then its rows are cancelled


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


def api_key(a: ServeArgs) -> str | None:
    """``--api-key``, else ``TORCHTITAN_SERVE_API_KEY``; None: no key is checked."""
    return a.api_key or os.environ.get(ENV_KEY) or None


def key_ring(a: ServeArgs) -> KeyRing:
    """The keys of ``--api-key`` (or its variable) and ``--api-key-file``; ValueError naming
    a key no request could send (not printable ASCII) or a bad key file."""
    return KeyRing(api_key(a), a.api_key_file, say=_say)


def access(a: ServeArgs) -> KeyRing:
    """The key ring, once the exposure rule holds (a non-loopback ``--host`` needs a key or
    ``--no-auth``); ValueError naming what is wrong."""
    keys = key_ring(a)
    check_exposure(a.host, keys.enabled, a.no_auth)
    return keys


def build(a: ServeArgs, keys: KeyRing, sock=None, device: str | None = None
          ) -> tuple[SpeechServer, Batcher]:  # fmt: skip
    """The server with the key ring ``keys`` (``access``), bound to its port (or on ``sock``,
    a replica's), and its batcher, not started: what can fail at start-up after the checks of
    ``serve`` (the model, its codec, the voices, a vLLM server, the port) has failed here, as
    ValueError or OSError."""
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
            max_queued_per_key=a.max_queued_per_key,
        )
        return _server(a, sock, keys, loaded, voices, metrics, batcher), batcher
    except BaseException:
        if process is not None:
            process.stop()
        raise


def engine(a: ServeArgs, loaded, cfg) -> tuple[dict, int, VllmProcess | None]:
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
    key = process.api_key if process is not None else (a.vllm_api_key or
                                                         os.environ.get(VLLM_KEY_ENV) or None)  # fmt: skip
    try:
        run = connect(loaded, cfg, url, a.request_timeout, key).runners()
    except BaseException:
        if process is not None:
            process.stop(keep_work=True)  # its log tells why
        raise
    _say(f"engine: vllm at {url} ({a.vllm_batches_in_flight} batches in flight)")
    return run, a.vllm_batches_in_flight, process


def _server(a, sock, keys, loaded, voices, metrics, batcher) -> SpeechServer:
    name = os.path.basename(os.path.normpath(os.path.abspath(a.model)))
    audio_s, bound = audio_bound(a, loaded)
    app = App(
        batcher,
        name,
        int(loaded.codec.sample_rate),
        input_rate(loaded),
        max_upload_bytes=int(a.max_upload_mb * (1 << 20)),
        request_timeout_s=a.request_timeout,
        body_timeout_s=a.body_timeout,
        voices=voices,
        prompt_refusal=_refusal(loaded),
        keys=keys,
        max_input_chars=a.max_input_chars,
        max_audio_seconds=audio_s,
        audio_bound=bound,
        max_requests=a.max_requests,
        rate_limits=RateLimits(
            a.requests_per_minute,
            a.audio_seconds_per_minute,
            body_bytes_per_minute=int(a.body_mb_per_minute * MIB),
        ),
        trusted_hosts=split_list(a.trusted_hosts) or default_trusted_hosts(a.host),
        cors_origins=split_list(a.cors_origins),
        ready_timeout_s=a.ready_timeout,
        redact=Redactions.of(
            [(a.model, name), (a.voices, "voices"), (str(loaded.source), name)]
        ),  # fmt: skip
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
        drain_s=a.drain_seconds,
        proxy_headers=a.proxy_headers,
    )


def audio_bound(a: ServeArgs, loaded) -> tuple[float, str]:
    """The longest upload taken, and what sets it: ``--max-audio-seconds``, or the model's
    context when it holds less (a longer upload could only fail in the model worker)."""
    flag = f"--max-audio-seconds {a.max_audio_seconds:g}"
    try:
        context = max_input_seconds(loaded)
    except Exception:  # a model whose prompts cannot be measured: the flag alone
        context = None
    if context is not None and context < a.max_audio_seconds:
        return context, f"the model's context holds {context:.1f} s of audio; {flag}"
    return a.max_audio_seconds, flag


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


def main(argv: list[str] | None = None) -> int:
    """``torchtitan serve`` of a command line (without the command's name)."""
    return serve(ServeArgs.from_namespace(build_parser().parse_args(argv)))


def run(a: argparse.Namespace) -> int:
    """``torchtitan serve`` of the command line cli.py parsed."""
    return serve(ServeArgs.from_namespace(a))


def serve(args: ServeArgs) -> int:
    """``torchtitan serve``: serve ``args.model`` until SIGTERM / Ctrl-C; the exit status (2: a
    start-up error, said on stderr in one line). The checks run once, here: the flags
    (``args.validate()``), then the keys and the exposure rule (``access``)."""
    if MISSING is not None:
        print(
            f"torchtitan serve: error: the server needs the 'serve' extra (no module named "
            f"{MISSING!r}): pip install 'torchtitan-speechlm[serve]'",
            file=sys.stderr,
        )
        return 2
    try:
        args.validate()
        keys = access(args)  # a key no request could send: refused before the model loads
    except ValueError as e:
        print(f"torchtitan serve: error: {_one_line(e)}", file=sys.stderr)
        return 2
    if args.replicas > 1:
        return run_replicas(args, keys)
    try:
        server, batcher = build(args, keys)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"torchtitan serve: error: {_one_line(e)}", file=sys.stderr)
        return 2
    return serve_until_stopped(args, server, batcher)


def serve_until_stopped(a: ServeArgs, server: SpeechServer, batcher: Batcher,
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
    if app.keys is not None and app.keys.enabled and ready is None:
        _say("API key required (Authorization: Bearer KEY) on every route but GET /health "
             "and GET /ready")  # fmt: skip
    if ready is None:
        _say(f"bounds: input {app.max_input_chars} characters, audio {app.max_audio_seconds:g} s "
             f"({app.audio_bound}), {app.max_requests or app.pool_size} requests at once")  # fmt: skip
    while thread.is_alive() and not stop.wait(0.2):
        pass
    _say(f"torchtitan serve: stopping: finishing the requests in flight (at most "
         f"{server.drain_s:g} s, --drain-seconds)")  # fmt: skip
    server.shutdown()  # the requests in flight finish: their jobs, queued or running, are run
    server.server_close()
    batcher.stop(timeout=STOP_WORKER_S)  # a row still running after it is cancelled
    _say("torchtitan serve: stopped")
    return 0 if stop.is_set() else 1  # 1: the server ended by itself (its error is above)


def run_replicas(a: ServeArgs, keys: KeyRing) -> int:
    """``--replicas N``: the port bound here, N replica processes serving it
    (serving/replicas.py) with the key ring ``keys``, the drain on SIGTERM / Ctrl-C."""
    try:
        sock = bind(a.host, a.port)
    except OSError as e:
        print(f"torchtitan serve: error: {_one_line(e)}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    replicas = Replicas(a.replicas, sock, replica_main, (a, keys), a.device, say=_say)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    error = replicas.start()
    if error is not None:
        print(f"torchtitan serve: error: {_one_line(error)}", file=sys.stderr)
        return 2
    name = os.path.basename(os.path.normpath(os.path.abspath(a.model)))
    _say(f"torchtitan serve: {name} on {url} ({ROUTES}; {a.replicas} replicas)")
    if keys.enabled:
        _say("API key required (Authorization: Bearer KEY) on every route but GET /health "
             "and GET /ready")  # fmt: skip
    watcher = threading.Thread(target=replicas.watch, daemon=True)
    watcher.start()
    stop.wait()
    _say("torchtitan serve: stopping: each replica finishes its requests in flight")
    status = replicas.stop(a.drain_seconds + STOP_WORKER_S + 30)
    sock.close()
    _say("torchtitan serve: stopped")
    return status


def replica_main(settings: tuple[ServeArgs, KeyRing], sock, index: int, device: str,
                 threads: int, ready) -> None:  # fmt: skip
    """One replica process (spawned): its model on ``device``, the shared socket, the key
    ring checked by the supervisor (``settings``: its args and keys), served until SIGTERM;
    its start-up error goes to ``ready``."""
    import torch

    a, keys = settings
    if threads:
        torch.set_num_threads(threads)
    try:
        server, batcher = build(a, keys, sock=sock, device=device)
    except (ValueError, FileNotFoundError, OSError) as e:
        ready.put((index, _one_line(e)))
        sys.exit(2)
    sys.exit(serve_until_stopped(a, server, batcher, ready, index))


if __name__ == "__main__":
    sys.exit(main())
