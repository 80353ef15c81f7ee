"""The arguments of ``torchtitan serve`` (commands/serve.py).

Standard library only: cli.py parses a command line with this parser before it imports the
server (torch, the model), so ``--help`` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse

from torchtitan_speechlm.commands.generate_args import add_decoding_args

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
        help="requests (all but GET /health) must send Authorization: Bearer KEY (default: the "
        "environment variable TORCHTITAN_SERVE_API_KEY; neither: no key is checked)",
    )
    a.add_argument(
        "--no-auth",
        action="store_true",
        help="serve a non-loopback --host without an API key (anyone who reaches it)",
    )
    g = p.add_argument_group("queue and batching")
    g.add_argument(
        "--queue-size", type=int, default=64, help="requests waiting at most; more get 503 (64)"
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
    t = p.add_argument_group("slow clients (seconds)")
    for flag, default, what in SLOW_CLIENT_TIMEOUTS:
        t.add_argument(flag, type=float, default=default, help=f"{what} ({default:g})")
    add_decoding_args(p)
    return p
