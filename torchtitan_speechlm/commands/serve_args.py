"""The arguments of ``torchtitan serve`` (commands/serve.py): ``ServeArgs``, one field per flag
(commands/flag_fields.py; the decoding flags are ``DecodingArgs``'), and its parser, generated
from them. ``ServeArgs.validate`` checks the flags themselves (``check_engine_flags``,
``check_bounds``, ``--replicas``); the keys and the exposure rule are checked by ``serve``, once.

Standard library only: cli.py parses a command line with this parser before it imports the
server (torch, the model), so ``--help`` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from torchtitan_speechlm.commands.flag_fields import add_flags, default_of, flag, flag_fields
from torchtitan_speechlm.commands.flag_fields import from_namespace as _from_namespace
from torchtitan_speechlm.commands.generate_args import MODEL_HELP, DecodingArgs

ACCESS = "access"
BOUNDS = "bounds per request"
OVERLOAD = "overload"
QUEUE = "queue and batching"
ENGINE = "engine (docs/serving.md, --engine vllm)"
SLOW = "slow clients (seconds)"


@dataclass(kw_only=True)
class ServeArgs(DecodingArgs):
    """The settings of ``torchtitan serve``: ``serve`` (commands/serve.py) takes the value
    whole; ``build_parser`` is generated from the fields."""

    model: str = flag(help=MODEL_HELP)
    host: str = flag(
        "127.0.0.1",
        help="the address to listen on (127.0.0.1); any other than a loopback address needs "
        "--api-key or --no-auth",
    )
    port: int = flag(8000, help="the port (0: any free one; 8000)")
    voices: str | None = flag(
        None,
        metavar="DIR",
        help="a folder of speaker prompts, one audio file per voice: voice=NAME speaks like "
        "NAME.wav (a model trained with tts_prompt; without --voices, voice is ignored)",
    )
    api_key: str | None = flag(
        None,
        group=ACCESS,
        metavar="KEY",
        help="requests (all but GET /health and GET /ready) must send Authorization: Bearer KEY "
        "(default: the "
        "environment variable TORCHTITAN_SERVE_API_KEY; neither: no key is checked)",
    )
    api_key_file: str | None = flag(
        None,
        group=ACCESS,
        metavar="FILE",
        help="several keys, one per line ('KEY' or 'NAME KEY'; # comments), read again when the "
        "file changes: keys rotate without a restart; the access log and the rate limits name "
        "the key by NAME",
    )
    no_auth: bool = flag(
        False,
        group=ACCESS,
        help="serve a non-loopback --host without an API key (anyone who reaches it)",
    )
    trusted_hosts: str | None = flag(
        None,
        group=ACCESS,
        metavar="HOSTS",
        help="the Host names requests may carry, comma-separated (*.example.com, *: any); "
        "others get 400 (default: on a loopback --host localhost,127.0.0.1,::1 and the host "
        "itself, which keeps DNS-rebinding pages out; else *)",
    )
    cors_origins: str = flag(
        "",
        group=ACCESS,
        metavar="ORIGINS",
        help="web page origins allowed to call the server, comma-separated (https://app.example, "
        "*: any); a request with another Origin gets 403 (default: none)",
    )
    proxy_headers: str | None = flag(
        None,
        group=ACCESS,
        nargs="?",
        const="127.0.0.1",
        metavar="ADDRESSES",
        help="behind a reverse proxy: take the client address and scheme from X-Forwarded-For "
        "/ X-Forwarded-Proto sent by these proxy addresses, comma-separated (alone: 127.0.0.1)",
    )
    max_input_chars: int = flag(
        4096,
        group=BOUNDS,
        metavar="N",
        help="the longest speech 'input', in characters (OpenAI's limit); longer is a 400 (4096)",
    )
    max_audio_seconds: float = flag(
        600.0,
        group=BOUNDS,
        metavar="S",
        help="the longest audio upload (a transcription's file, a prompt_audio), checked from "
        "its header and while it is decoded; longer is a 413 (600; lower when the model's "
        "context holds less: the start-up line says)",
    )
    max_requests: int | None = flag(
        None,
        group=OVERLOAD,
        metavar="N",
        type=int,
        help="requests being served at once, counted once their body has arrived (sockets "
        "sending headers or a body are not); more get a JSON 503 server_busy with Retry-After "
        "(default: --queue-size + --max-batch + 16)",
    )
    requests_per_minute: int = flag(
        0,
        group=OVERLOAD,
        metavar="N",
        help="per API key (per client address without keys): requests in any 60 s, and at most "
        "a thirtieth of them (or 5) in any one second; more get 429 with Retry-After, held up "
        "to 1 s when sent before the last one's Retry-After (0: no limit)",
    )
    audio_seconds_per_minute: float = flag(
        0.0,
        group=OVERLOAD,
        metavar="S",
        help="per API key (per client address without keys): seconds of audio uploaded or "
        "generated in any 60 s; more get 429 with Retry-After (0: no limit)",
    )
    body_mb_per_minute: float = flag(
        0.0,
        group=OVERLOAD,
        metavar="M",
        help="per API key (per client address without keys): MiB of request bodies in any 60 "
        "s, charged from Content-Length before a body is read; more get 429 with Retry-After, "
        "so that oversized requests cost their sender, not the server (0: no limit)",
    )
    ready_timeout: float = flag(
        30.0,
        group=OVERLOAD,
        metavar="S",
        help="GET /ready answers 503 while the model worker has made no progress (a decode "
        "step) for this many seconds (30)",
    )
    drain_seconds: float = flag(
        25.0,
        group=OVERLOAD,
        metavar="S",
        help="on SIGTERM, how long the requests in flight may take to finish; then they are "
        "cancelled (25: within Kubernetes' 30 s grace)",
    )
    queue_size: int = flag(64, group=QUEUE, help="requests waiting at most; more get 503 (64)")
    max_queued_per_key: int = flag(
        0,
        group=QUEUE,
        metavar="N",
        help="places one API key (one client address without keys) may hold: its requests "
        "queued or still decoding; more get 503 queue_full (0: no cap but --queue-size). "
        "Batches take each key's requests in turn",
    )
    max_batch: int = flag(8, group=QUEUE, help="rows of one task in one model call at most (8)")
    batch_wait_ms: float = flag(
        10.0,
        group=QUEUE,
        help="how long the worker waits for more requests of a task before running a batch (10)",
    )
    max_upload_mb: float = flag(
        25.0, group=QUEUE, help="request bodies over this many MiB are refused with 413 (25)"
    )
    request_timeout: float = flag(
        600.0,
        group=QUEUE,
        help="seconds a request waits for the model worker before it fails with 500 (600)",
    )
    replicas: int = flag(
        1,
        group=QUEUE,
        help="server processes behind the one port, each its own model on its own device: "
        "--device cuda gives replica i cuda:i, a list (cuda:0,cuda:2) one each in turn, cpu "
        "shares the cores out (1)",
    )
    engine: str = flag(
        "ours",
        group=ENGINE,
        choices=("ours", "vllm"),
        help="who runs the model: ours (this package's decoder; the default) or vllm (a "
        "flatten model on a vLLM server: --vllm-url or --vllm-python)",
    )
    vllm_url: str | None = flag(
        None,
        group=ENGINE,
        metavar="URL",
        help="a vLLM OpenAI-compatible server already serving this model's vllm_export folder "
        "with the FlattenAudioMask logits processor (docs/serving.md)",
    )
    vllm_api_key: str | None = flag(
        None,
        group=ENGINE,
        metavar="KEY",
        help="with --vllm-url: the key that vLLM server was started with (its --api-key); "
        "default: the environment variable TORCHTITAN_VLLM_API_KEY (a server started with "
        "--vllm-python gets a key of its own)",
    )
    vllm_python: str | None = flag(
        None,
        group=ENGINE,
        metavar="PATH",
        help="a Python with vLLM installed: the model is exported (vllm_export) and served by "
        "PATH -m vllm.entrypoints.openai.api_server on a free loopback port, stopped with "
        "this server",
    )
    vllm_work: str | None = flag(
        None,
        group=ENGINE,
        metavar="DIR",
        help="with --vllm-python: where the export, vLLM's log (vllm.log) and its compile "
        "cache go (default: a new temporary folder, removed at exit)",
    )
    vllm_arg: list[str] | None = flag(
        None,
        group=ENGINE,
        action="append",
        metavar="ARG",
        help="with --vllm-python: one more argument for vLLM's command line, after ours "
        "(repeat it; e.g. --vllm-arg=--enforce-eager)",
    )
    vllm_kv_cache_mb: int = flag(
        256,
        group=ENGINE,
        help="with --vllm-python: vLLM's KV cache (--kv-cache-memory-bytes) in MiB (256)",
    )
    vllm_start_timeout: float = flag(
        600.0, group=ENGINE, help="with --vllm-python: seconds to wait for vLLM's /health (600)"
    )
    vllm_batches_in_flight: int = flag(
        4,
        group=ENGINE,
        help="batches sent to vLLM at once (each one HTTP request; vLLM decodes them together) (4)",
    )
    header_timeout: float = flag(
        10.0,
        group=SLOW,
        help="a connection's time to send a request's headers; then 408, closed (10)",
    )
    body_timeout: float = flag(
        60.0, group=SLOW, help="a request's time to send its whole body; then 408, closed (60)"
    )
    keep_alive_timeout: float = flag(
        5.0, group=SLOW, help="how long an idle keep-alive connection stays open (5)"
    )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServeArgs:
        """The parsed ``torchtitan serve`` command line (``build_parser().parse_args``)."""
        return _from_namespace(cls, ns)

    def validate(self) -> None:
        """The checks of the flags themselves (before any key file, model or port is read): a
        ValueError naming the flag."""
        if self.replicas < 1:
            raise ValueError(f"--replicas {self.replicas}: at least 1")
        self.check_decoding()
        check_engine_flags(self)
        check_bounds(self)


# --engine vllm's flags and their defaults (check_engine_flags: none of them without it)
VLLM_FLAGS = ("vllm_url", "vllm_python", "vllm_work", "vllm_arg", "vllm_kv_cache_mb",
              "vllm_start_timeout", "vllm_batches_in_flight", "vllm_api_key")  # fmt: skip
_DEFAULTS = {f.name: default_of(f) for f in flag_fields(ServeArgs)}
VLLM_DEFAULTS = {name: _DEFAULTS[name] for name in VLLM_FLAGS}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchtitan serve",
        description="serve a SpeechLM over HTTP with OpenAI's audio routes (docs/serving.md)",
    )
    add_flags(p, ServeArgs)
    return p


def check_engine_flags(a: ServeArgs) -> None:
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
        "--best-of": (
            a.best_of != 1,
            "choosing among samples needs our decoder's ASR of each; vLLM returns one sample",
        ),
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


def check_bounds(a: ServeArgs) -> None:
    """Raise ValueError naming a bound or limit flag whose value cannot work."""
    at_least = {
        "--max-input-chars": (a.max_input_chars, 1),
        "--max-requests": (a.max_requests if a.max_requests is not None else 1, 1),
        "--requests-per-minute": (a.requests_per_minute, 0),
        "--max-queued-per-key": (a.max_queued_per_key, 0),
        "--audio-seconds-per-minute": (a.audio_seconds_per_minute, 0),
        "--body-mb-per-minute": (a.body_mb_per_minute, 0),
        "--drain-seconds": (a.drain_seconds, 0),
    }
    for name, (value, low) in at_least.items():
        if value < low:
            raise ValueError(f"{name} {value}: at least {low}")
    for name, value in (("--max-audio-seconds", a.max_audio_seconds),
                        ("--ready-timeout", a.ready_timeout)):  # fmt: skip
        if not value > 0:
            raise ValueError(f"{name} {value}: must be more than 0")
