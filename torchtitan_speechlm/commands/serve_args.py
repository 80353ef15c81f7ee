"""The arguments of ``torchtitan serve`` (commands/serve.py).

Standard library only: cli.py parses a command line with this parser before it imports the
server (torch, the model), so ``--help`` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse

from torchtitan_speechlm.commands.generate_args import add_decoding_args

# (flag, type, default, help) of the numbers that bound one request's work and the server's load
BOUNDS = (
    ("--max-input-chars", int, 4096,
     "the longest speech 'input', in characters (OpenAI's limit); longer is a 400 (4096)"),
    ("--max-audio-seconds", float, 600.0,
     "the longest audio upload (a transcription's file, a prompt_audio), checked from its "
     "header and while it is decoded; longer is a 413 (600; lower when the model's context "
     "holds less: the start-up line says)"),
)  # fmt: skip
OVERLOAD = (
    ("--max-requests", int, None,
     "requests being served at once, counted once their body has arrived (sockets sending "
     "headers or a body are not); more get a JSON 503 server_busy with Retry-After (default: "
     "--queue-size + --max-batch + 16)"),
    ("--requests-per-minute", int, 0,
     "per API key (per client address without keys): requests in any 60 s, and at most a "
     "thirtieth of them (or 5) in any one second; more get 429 with Retry-After (0: no limit)"),
    ("--audio-seconds-per-minute", float, 0.0,
     "per API key (per client address without keys): seconds of audio uploaded or generated "
     "in any 60 s; more get 429 with Retry-After (0: no limit)"),
    ("--ready-timeout", float, 30.0,
     "GET /ready answers 503 while the model worker has made no progress (a decode step) for "
     "this many seconds (30)"),
    ("--drain-seconds", float, 25.0,
     "on SIGTERM, how long the requests in flight may take to finish; then they are cancelled "
     "(25: within Kubernetes' 30 s grace)"),
)  # fmt: skip
SLOW_CLIENT_TIMEOUTS = (
    ("--header-timeout", 10.0, "a connection's time to send a request's headers; then 408, closed"),
    ("--body-timeout", 60.0, "a request's time to send its whole body; then 408, closed"),
    ("--keep-alive-timeout", 5.0, "how long an idle keep-alive connection stays open"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchtitan serve",
        description="serve a SpeechLM over HTTP with OpenAI's audio routes (docs/serving.md)",
    )
    p.add_argument("--model", required=True, help="a checkpoint step folder or an export folder")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (127.0.0.1); any other than a loopback address needs "
        "--api-key or --no-auth",
    )
    p.add_argument("--port", type=int, default=8000, help="the port (0: any free one; 8000)")
    p.add_argument(
        "--voices",
        metavar="DIR",
        help="a folder of speaker prompts, one audio file per voice: voice=NAME speaks like "
        "NAME.wav (a model trained with tts_prompt; without --voices, voice is ignored)",
    )
    a = p.add_argument_group("access")
    a.add_argument(
        "--api-key",
        metavar="KEY",
        help="requests (all but GET /health and GET /ready) must send Authorization: Bearer KEY "
        "(default: the "
        "environment variable TORCHTITAN_SERVE_API_KEY; neither: no key is checked)",
    )
    a.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="several keys, one per line ('KEY' or 'NAME KEY'; # comments), read again when the "
        "file changes: keys rotate without a restart; the access log and the rate limits name "
        "the key by NAME",
    )
    a.add_argument(
        "--no-auth",
        action="store_true",
        help="serve a non-loopback --host without an API key (anyone who reaches it)",
    )
    a.add_argument(
        "--trusted-hosts",
        metavar="HOSTS",
        help="the Host names requests may carry, comma-separated (*.example.com, *: any); "
        "others get 400 (default: on a loopback --host localhost,127.0.0.1,::1 and the host "
        "itself, which keeps DNS-rebinding pages out; else *)",
    )
    a.add_argument(
        "--cors-origins",
        metavar="ORIGINS",
        default="",
        help="web page origins allowed to call the server, comma-separated (https://app.example, "
        "*: any); a request with another Origin gets 403 (default: none)",
    )
    a.add_argument(
        "--proxy-headers",
        nargs="?",
        const="127.0.0.1",
        metavar="ADDRESSES",
        help="behind a reverse proxy: take the client address and scheme from X-Forwarded-For "
        "/ X-Forwarded-Proto sent by these proxy addresses, comma-separated (alone: 127.0.0.1)",
    )
    for title, rows in (("bounds per request", BOUNDS), ("overload", OVERLOAD)):
        group = p.add_argument_group(title)
        for flag, kind, default, what in rows:
            group.add_argument(flag, metavar="N" if kind is int else "S", type=kind,
                               default=default, help=what)  # fmt: skip
    g = p.add_argument_group("queue and batching")
    g.add_argument(
        "--queue-size", type=int, default=64, help="requests waiting at most; more get 503 (64)"
    )
    g.add_argument(
        "--max-queued-per-key",
        metavar="N",
        type=int,
        default=0,
        help="queue places one API key (one client address without keys) may hold; more get "
        "503 queue_full (0: no cap but --queue-size). Batches take each key's requests in turn",
    )
    g.add_argument(
        "--max-batch", type=int, default=8, help="rows of one task in one model call at most (8)"
    )
    g.add_argument(
        "--batch-wait-ms",
        type=float,
        default=10.0,
        help="how long the worker waits for more requests of a task before running a batch (10)",
    )
    g.add_argument(
        "--max-upload-mb",
        type=float,
        default=25.0,
        help="request bodies over this many MiB are refused with 413 (25)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request waits for the model worker before it fails with 500 (600)",
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="server processes behind the one port, each its own model on its own device: "
        "--device cuda gives replica i cuda:i, a list (cuda:0,cuda:2) one each in turn, cpu "
        "shares the cores out (1)",
    )
    add_engine_args(p)
    t = p.add_argument_group("slow clients (seconds)")
    for flag, default, what in SLOW_CLIENT_TIMEOUTS:
        t.add_argument(flag, type=float, default=default, help=f"{what} ({default:g})")
    add_decoding_args(p)
    return p


# --engine vllm's flags and their defaults (check_engine_flags: none of them without it)
VLLM_DEFAULTS = {
    "vllm_url": None,
    "vllm_python": None,
    "vllm_work": None,
    "vllm_arg": None,
    "vllm_kv_cache_mb": 256,
    "vllm_start_timeout": 600.0,
    "vllm_batches_in_flight": 4,
    "vllm_api_key": None,
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("engine (docs/serving.md, --engine vllm)")
    e.add_argument(
        "--engine",
        default="ours",
        choices=("ours", "vllm"),
        help="who runs the model: ours (this package's decoder; the default) or vllm (a "
        "flatten model on a vLLM server: --vllm-url or --vllm-python)",
    )
    e.add_argument(
        "--vllm-url",
        metavar="URL",
        help="a vLLM OpenAI-compatible server already serving this model's vllm_export folder "
        "with the FlattenAudioMask logits processor (docs/serving.md)",
    )
    e.add_argument(
        "--vllm-api-key",
        metavar="KEY",
        help="with --vllm-url: the key that vLLM server was started with (its --api-key); "
        "default: the environment variable TORCHTITAN_VLLM_API_KEY (a server started with "
        "--vllm-python gets a key of its own)",
    )
    e.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="a Python with vLLM installed: the model is exported (vllm_export) and served by "
        "PATH -m vllm.entrypoints.openai.api_server on a free loopback port, stopped with "
        "this server",
    )
    e.add_argument(
        "--vllm-work",
        metavar="DIR",
        help="with --vllm-python: where the export, vLLM's log (vllm.log) and its compile "
        "cache go (default: a new temporary folder, removed at exit)",
    )
    e.add_argument(
        "--vllm-arg",
        action="append",
        metavar="ARG",
        help="with --vllm-python: one more argument for vLLM's command line, after ours "
        "(repeat it; e.g. --vllm-arg=--enforce-eager)",
    )
    e.add_argument(
        "--vllm-kv-cache-mb",
        type=int,
        default=VLLM_DEFAULTS["vllm_kv_cache_mb"],
        help="with --vllm-python: vLLM's KV cache (--kv-cache-memory-bytes) in MiB (256)",
    )
    e.add_argument(
        "--vllm-start-timeout",
        type=float,
        default=VLLM_DEFAULTS["vllm_start_timeout"],
        help="with --vllm-python: seconds to wait for vLLM's /health (600)",
    )
    e.add_argument(
        "--vllm-batches-in-flight",
        type=int,
        default=VLLM_DEFAULTS["vllm_batches_in_flight"],
        help="batches sent to vLLM at once (each one HTTP request; vLLM decodes them together) (4)",
    )


def check_engine_flags(a: argparse.Namespace) -> None:
    """Raise ValueError naming a flag that makes no sense with ``--engine``: the vllm flags
    without ``--engine vllm``; with it, neither or both of --vllm-url and --vllm-python, the
    --vllm-python flags with --vllm-url, and our decoder's flags vLLM has no use for."""

    def given(name: str) -> bool:
        return getattr(a, name) != VLLM_DEFAULTS[name]

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    if a.engine != "vllm":
        extra = [flag(n) for n in VLLM_DEFAULTS if given(n)]
        if extra:
            raise ValueError(f"{', '.join(extra)}: only with --engine vllm")
        return
    if bool(a.vllm_url) == bool(a.vllm_python):
        raise ValueError(
            "--engine vllm: give --vllm-url URL (a vLLM server you started) or --vllm-python "
            "PATH (a Python with vLLM: this command exports the model and starts it), one of them"
        )
    if a.vllm_url:
        spawn_only = [flag(n) for n in VLLM_DEFAULTS
                      if n not in ("vllm_url", "vllm_python", "vllm_batches_in_flight",
                                   "vllm_api_key")
                      and given(n)]  # fmt: skip
        if spawn_only:
            raise ValueError(
                f"{', '.join(spawn_only)}: only with --vllm-python (a server at --vllm-url is "
                "configured where it was started)"
            )
    if a.vllm_python and a.vllm_api_key:
        raise ValueError("--vllm-api-key is for --vllm-url: a vLLM started with --vllm-python "
                         "gets a key of its own")  # fmt: skip
    if a.vllm_batches_in_flight < 1:
        raise ValueError(f"--vllm-batches-in-flight {a.vllm_batches_in_flight}: at least 1")
    if a.vllm_kv_cache_mb < 1:
        raise ValueError(f"--vllm-kv-cache-mb {a.vllm_kv_cache_mb}: at least 1")
    ours_only = {
        "--cfg-scale": (
            a.cfg_scale != 1.0,
            "guidance mixes a second, unconditional sequence into each step's logits; vLLM "
            "samples each request's sequence alone",
        ),
        "--no-cache": (a.no_cache, "vLLM always decodes with its paged KV cache"),
        "--compile": (
            a.compile != "auto",
            "our decoder's compilation; vLLM compiles its own way (--vllm-arg=--enforce-eager "
            "turns it off)",
        ),
        "--replicas": (
            a.replicas != 1,
            "the model's work is vLLM's, which batches every request in flight itself; give "
            "vLLM more devices instead",
        ),
    }
    for name, (bad, why) in ours_only.items():
        if bad:
            raise ValueError(f"{name} is not taken with --engine vllm: {why}; drop {name}, or "
                             "serve with --engine ours")  # fmt: skip


def check_bounds(a: argparse.Namespace) -> None:
    """Raise ValueError naming a bound or limit flag whose value cannot work."""
    at_least = {
        "--max-input-chars": (a.max_input_chars, 1),
        "--max-requests": (a.max_requests if a.max_requests is not None else 1, 1),
        "--requests-per-minute": (a.requests_per_minute, 0),
        "--max-queued-per-key": (a.max_queued_per_key, 0),
        "--audio-seconds-per-minute": (a.audio_seconds_per_minute, 0),
        "--drain-seconds": (a.drain_seconds, 0),
    }
    for name, (value, low) in at_least.items():
        if value < low:
            raise ValueError(f"{name} {value}: at least {low}")
    for name, value in (("--max-audio-seconds", a.max_audio_seconds),
                        ("--ready-timeout", a.ready_timeout)):  # fmt: skip
        if not value > 0:
            raise ValueError(f"{name} {value}: must be more than 0")
