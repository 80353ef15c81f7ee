"""`torchtitan serve --engine vllm` on a real vLLM, called with the `openai` client beside
`--engine ours` on the same model: the same speech (the wav bytes), streamed and whole, the
same transcripts, under greedy decoding.

The model is the tests' tiny run trained with the flatten pattern (tests/helpers.py
``tiny_export``: a Qwen3 decoder of hidden 64 with 2 heads of 32, as vLLM's CPU attention takes
no head below 32; the tiny codec, 4 x 64 codes). One server serves it with our decoder, the
other with ``--vllm-python``: the command exports it, starts vLLM's OpenAI server (its default,
compiled mode) with our logits processor, and stops it when it drains (SIGTERM: exit 0, vLLM's
process gone, its temporary folder removed).

Runs only where the environment variable TORCHTITAN_VLLM_PYTHON names a Python with vLLM
(docs/vllm.md: /tmp/vllm_venv/bin/python); about 2 minutes on 2 CPU cores, most of it vLLM's
start. Marked ``long`` (`make faults`)."""

from __future__ import annotations

import io
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.helpers import start_server, tiny_export

VLLM_PYTHON = os.environ.get("TORCHTITAN_VLLM_PYTHON")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.long,
    pytest.mark.skipif(
        not VLLM_PYTHON,
        reason="set TORCHTITAN_VLLM_PYTHON to a Python with vLLM installed (docs/vllm.md)",
    ),
]
MAX_FRAMES = 40
TEXTS = [
    "She sells fresh bread.",
    "The train to the city leaves at noon.",
    "Please close the window before you leave.",
    "Hi.",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("serve_vllm"), steps=60, pattern="flatten",
                       hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)  # fmt: skip


def start(model: dict, *flags: str) -> dict:
    return start_server(model["export"], "--max-frames", str(MAX_FRAMES), *flags, wait_s=900,
                        timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def servers(model):
    ours = start(model)
    vllm = start(model, "--engine", "vllm", "--vllm-python", VLLM_PYTHON)
    yield {"ours": ours, "vllm": vllm}
    for s in (ours, vllm):
        if s["proc"].poll() is None:
            s["proc"].kill()
            s["proc"].wait(60)


def speech(client, text: str, **kw) -> bytes:
    return client.audio.speech.create(
        model="m", voice="alloy", input=text, response_format="wav", **kw
    ).content


def streamed(client, text: str) -> bytes:
    with client.audio.speech.with_streaming_response.create(
        model="m", voice="alloy", input=text, response_format="wav", extra_body={"stream": True}
    ) as r:
        return b"".join(r.iter_bytes())


def test_speech_and_transcripts_equal_our_engine(servers):
    ours, vllm = servers["ours"]["client"], servers["vllm"]["client"]
    mine = [speech(ours, t) for t in TEXTS]
    theirs = [speech(vllm, t) for t in TEXTS]
    assert [len(w) for w in theirs] == [len(w) for w in mine]
    assert theirs == mine  # the wav bytes: the same codes through the same codec
    assert len({len(w) for w in mine}) > 1  # the model chose its ends (not all at max frames)

    def heard(client, wav: bytes) -> str:
        return client.audio.transcriptions.create(model="m", file=("a.wav", io.BytesIO(wav))).text

    texts = [heard(vllm, w) for w in mine]
    assert texts == [heard(ours, w) for w in mine] and all(texts)
    assert streamed(vllm, TEXTS[1]) == streamed(ours, TEXTS[1])

    with ThreadPoolExecutor(4) as pool:  # concurrent: batched on both sides, all answered
        together = list(pool.map(lambda t: speech(vllm, t), TEXTS))
    assert [len(w) for w in together] == [len(w) for w in mine]


def test_the_same_refusals(servers, tmp_path):
    for name in ("ours", "vllm"):
        client = servers[name]["client"]
        with pytest.raises(openai.BadRequestError, match="'input' is empty"):
            speech(client, "")
        with pytest.raises(openai.BadRequestError, match="trained without speaker prompts"):
            speech(client, "Hi.", extra_body={"prompt_audio": "UklGRg=="})


def living_in_group(pgid: int, wait_s: float = 10.0) -> list[int]:
    """The processes of group ``pgid`` that are not zombies, after up to ``wait_s`` for them to
    go (a killed engine core is reparented to PID 1, which may reap it late: a zombie runs
    nothing, but still answers ``killpg(pgid, 0)``)."""
    deadline = time.monotonic() + wait_s
    while True:
        living = []
        for d in os.listdir("/proc"):
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # not a process, or gone meanwhile
            if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp
                living.append(int(d))
        if not living or time.monotonic() > deadline:
            return living
        time.sleep(0.2)


def test_sigterm_drains_and_stops_vllm(servers):
    served = servers["vllm"]
    line = next(x for x in served["lines"] if x.startswith("vllm ") and "(pid " in x)
    pid, log = re.search(r"\(pid (\d+), log (\S+)\)", line).groups()
    assert os.path.exists(log)
    served["proc"].send_signal(signal.SIGTERM)
    assert served["proc"].wait(120) == 0
    assert living_in_group(int(pid)) == []  # vLLM's process group is gone
    assert not os.path.exists(os.path.dirname(log))  # its temporary folder removed
    assert served["lines"][-1] == "torchtitan serve: stopped"
