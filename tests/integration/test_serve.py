"""`torchtitan serve` end to end, called with the official `openai` client: a tiny trained and
exported model (tests/helpers.py ``tiny_export``) behind the server in its own process. Speech
comes back as the library's wav at the codec's rate (streamed while generated: as long, the
same spectrum), transcription as text
equal to the library's own for the same audio (another rate and stereo: resampled, downmixed),
8 concurrent calls run in batches larger than one (a ninth, too long for the model, fails its
batch and alone gets its 400), every bad request gets its status and
OpenAI's error JSON (the client raises the matching class), and the server still answers after
all of them. A folder that is not a SpeechLM ends the command at start with one line. SIGTERM
drains: the streamed request running and the one queued behind it both get their whole 200, no
new connection is taken, and the process exits 0. (A full queue's 503 and a failing row's 500:
tests/unit/serving/test_serving_http.py, deterministic; what the server refuses:
tests/unit/serving/test_serve_hardening.py.)"""

from __future__ import annotations

import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.helpers import tiny_export
from torchtitan_speechlm import cli

pytestmark = pytest.mark.slow
MAX_FRAMES = 30


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("serve"), steps=60)


def start(model, *flags: str) -> dict:
    """`torchtitan serve --model EXPORT --port 0 FLAGS` in its own process, once it listens:
    its URL, its process and its stdout lines (the access log's JSON lines among them)."""
    cmd = [sys.executable, "-m", "torchtitan_speechlm.cli", "serve", "--model", model["export"],
           "--port", "0", *flags]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    lines: list[str] = []
    url: list[str] = []
    started = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if " on http://" in line and not url:
                url.append(line.split(" on ")[1].split()[0])
                started.set()
        started.set()

    threading.Thread(target=read, daemon=True).start()
    assert started.wait(180) and url, "\n".join(lines[-30:])
    client = openai.OpenAI(base_url=url[0] + "/v1", api_key="none", max_retries=0, timeout=120)
    return {"url": url[0], "client": client, "lines": lines, "proc": proc}


@pytest.fixture(scope="module")
def server(model):
    served = start(model, "--max-frames", str(MAX_FRAMES), "--batch-wait-ms", "100",
                   "--max-upload-mb", "0.1")  # fmt: skip
    yield served
    served["proc"].terminate()
    served["proc"].wait(30)


def access(lines: list[str]) -> list[dict]:
    """The access log's records (one JSON line per request) among the server's lines."""
    return [json.loads(x) for x in list(lines) if x.startswith('{"method"')]


@pytest.fixture(scope="module")
def library(model):
    """The same model in this process: what the server must give."""
    from torchtitan_speechlm.generation.loading import load_model

    return load_model(model["export"])


def eventually(check, timeout: float = 10.0) -> bool:
    """``check()`` turns true within ``timeout`` s: the server counts and logs a request just
    after its answer is sent, and its lines reach this process through a pipe."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def health(server) -> dict:
    with urllib.request.urlopen(server["url"] + "/health", timeout=30) as r:
        return json.loads(r.read())


def utterance(model, i: int = 1) -> str:
    rows = [json.loads(line) for line in open(model["manifest"])]
    return rows[i]["audio"]


def test_models_and_health(server, model):
    ids = [m.id for m in server["client"].models.list().data]
    assert ids == ["export"]
    h = health(server)
    assert h["status"] == "ok" and h["model"] == "export" and h["queue_depth"] == 0


def test_speech_is_the_library_s_wav_at_the_codec_rate_and_streams_as_long(server, library):
    from scipy.signal import stft

    from torchtitan_speechlm.generation import tasks
    from torchtitan_speechlm.generation.decode import DecodeConfig

    client = server["client"]
    text = "The quick brown fox."
    audio = client.audio.speech.create(
        model="export", voice="alloy", input=text, response_format="wav", speed=1.5
    ).content
    wave, rate = sf.read(io.BytesIO(audio), dtype="int16")
    assert rate == library.codec.sample_rate
    assert 0 < len(wave) <= MAX_FRAMES * library.codec.samples_per_frame
    codes = tasks.tts(library, [text], DecodeConfig(max_frames=MAX_FRAMES))
    expected = tasks.decode_audio(library, codes)[0]  # what `torchtitan generate` writes
    np.testing.assert_array_equal(wave, np.round(np.clip(expected, -1, 1) * 32767))
    with client.audio.speech.with_streaming_response.create(
        model="export", voice="alloy", input=text, response_format="wav",
        extra_body={"stream": True},
    ) as r:  # fmt: skip
        assert r.headers["transfer-encoding"] == "chunked"
        streamed = np.frombuffer(b"".join(r.iter_bytes())[44:], "<i2")
    # the codec's stream decoder, frame by frame: the same length, the same spectrum
    assert len(streamed) == len(wave)
    a, b = (
        np.log1p(np.abs(stft(x.astype(float), nperseg=512)[2])).ravel() for x in (wave, streamed)
    )
    assert np.corrcoef(a, b)[0, 1] > 0.8


def test_the_worker_s_speech_call_streams_rows_while_decoding(library):
    """serving/speech.py ``speak`` on one batch of a streamed and a whole row: the streamed
    row's samples come in many pieces, as its frames complete; the other's in one piece, the
    batch's whole decode."""
    from torchtitan_speechlm.generation import tasks
    from torchtitan_speechlm.generation.decode import DecodeConfig
    from torchtitan_speechlm.serving.rows import SpeechRow
    from torchtitan_speechlm.serving.speech import speak

    cfg = DecodeConfig(max_frames=MAX_FRAMES)
    pieces: dict[int, list] = {0: [], 1: []}
    texts = ["She sells fresh bread.", "The train leaves at noon."]
    rows = [SpeechRow(texts[0], stream=True), SpeechRow(texts[1])]
    samples = speak(library, rows, cfg, lambda i, block: pieces[i].append(block))
    assert len(pieces[0]) > 2 and len(pieces[1]) == 1
    assert samples == [sum(map(len, pieces[0])), len(pieces[1][0])]
    whole = tasks.decode_audio(library, tasks.tts(library, texts, cfg))
    np.testing.assert_allclose(
        pieces[1][0], whole[1], atol=1e-5
    )  # decode_batch: to float tolerance
    assert samples[0] == len(whole[0])


def test_transcription_is_the_library_s_text_and_any_rate_or_channels_are_taken(
    server, model, library, tmp_path
):
    from torchtitan_speechlm.generation import tasks
    from torchtitan_speechlm.generation.decode import DecodeConfig

    client = server["client"]
    path = utterance(model)
    with open(path, "rb") as f:
        got = client.audio.transcriptions.create(model="export", file=f)
    expected = tasks.transcribe(library, path, DecodeConfig(max_frames=MAX_FRAMES))
    assert got.text == expected and expected.strip()  # words: 60 steps of training
    with open(path, "rb") as f:
        text = client.audio.transcriptions.create(model="export", file=f, response_format="text")
    assert text.strip() == expected
    # 22.05 kHz stereo (the codec takes 16 kHz mono): resampled and downmixed, as a flac
    wave, rate = sf.read(path, dtype="float32")
    from torchtitan_speechlm.utils.audio import resample

    other = resample(wave, rate, 22050)
    stereo = tmp_path / "stereo.flac"
    sf.write(stereo, np.stack([other, 0.5 * other], axis=1), 22050)
    with open(stereo, "rb") as f:
        assert isinstance(client.audio.transcriptions.create(model="export", file=f).text, str)


def test_eight_concurrent_calls_are_served_in_batches(server):
    client = server["client"]
    before = health(server)
    results: dict[int, int] = {}

    def speech_lines() -> list[dict]:
        return [r for r in access(server["lines"]) if r["path"] == "/v1/audio/speech"]

    logged = len(speech_lines())

    def call(i: int) -> None:
        audio = client.audio.speech.create(
            model="export", voice="alloy", input=f"Sentence number {i}.", response_format="wav"
        ).content
        results[i] = len(sf.read(io.BytesIO(audio))[0])

    def too_long() -> None:  # over the model's 4096 positions: its batch fails, then it alone
        try:
            client.audio.speech.create(model="export", voice="alloy", input="word " * 1000)
        except openai.BadRequestError as e:
            results[-1] = e.message

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    threads.insert(3, threading.Thread(target=too_long))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert "the model's context is 4096" in results.pop(-1)
    assert sorted(results) == list(range(8)) and all(n > 0 for n in results.values())
    after = health(server)
    batches = after["batches_run"] - before["batches_run"]
    assert after["largest_batch"] > 1 and batches < 9, after
    assert eventually(lambda: len(speech_lines()) >= logged + 9)
    speech = speech_lines()[logged:]
    assert sorted(r["status"] for r in speech) == [200] * 8 + [400]
    assert max(r["batch"] for r in speech) > 1


def test_bad_requests_get_their_status_and_openai_errors(server, model, tmp_path):
    client = server["client"]
    json_header = {"headers": {"Content-Type": "application/json"}}
    with pytest.raises(openai.BadRequestError, match="could not parse the JSON"):
        client.post("/audio/speech", cast_to=object, content=b"{bad", options=json_header)
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/audio/speech", cast_to=object, body={"model": "export"})
    assert e.value.body["param"] == "input" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="'input' is empty"):
        client.audio.speech.create(model="export", voice="alloy", input="   ")
    with pytest.raises(openai.BadRequestError, match="supported: wav"):
        client.audio.speech.create(model="export", voice="alloy", input="Hi.",
                                   response_format="mp3")  # fmt: skip
    with pytest.raises(openai.NotFoundError, match="Invalid URL"):
        client.get("/no/such/route", cast_to=object)
    with pytest.raises(openai.BadRequestError, match="not audio") as e:
        client.audio.transcriptions.create(model="export", file=("notes.wav", b"not audio" * 50))
    assert e.value.body["param"] == "file" and "BytesIO" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="supported: json, text"):
        with open(utterance(model), "rb") as f:
            client.audio.transcriptions.create(model="export", file=f, response_format="srt")
    big = tmp_path / "long.wav"  # 4 s at 16 kHz: 128 KB, over --max-upload-mb 0.1
    sf.write(big, np.zeros(64000, np.float32), 16000, subtype="PCM_16")
    with pytest.raises(openai.APIStatusError) as e, open(big, "rb") as f:
        client.audio.transcriptions.create(model="export", file=f)
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
    # and after all of that the server is up, its worker alive, every request counted
    assert eventually(lambda: health(server)["requests_failed"] >= 8)
    assert health(server)["status"] == "ok" and server["proc"].poll() is None

    def statuses() -> set[int]:
        return {r["status"] for r in access(server["lines"])}

    assert eventually(lambda: {400, 404, 413} <= statuses()), server["lines"][-20:]


def test_a_folder_that_is_not_a_speechlm_ends_the_command_with_one_line(tmp_path, capsys):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    for folder in (tmp_path / "llama", tmp_path / "missing", tmp_path):
        t = time.monotonic()
        assert cli.main(["serve", "--model", str(folder), "--port", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("torchtitan serve: error: ") and "\n" not in err, err
        assert time.monotonic() - t < 30


def test_sigterm_drains_the_requests_in_flight_and_exits_0(model):
    """One worker, batches of one, 300 frames a request: a streamed request runs, a second
    waits in the queue; SIGTERM; both get their whole 200, and the process exits 0."""
    frames = "300"
    served = start(model, "--max-batch", "1", "--min-frames", frames, "--max-frames", frames)
    host, port = served["url"].removeprefix("http://").split(":")
    answers: dict[str, bytes] = {}
    running = threading.Event()

    def speak(name: str, path: str) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", path, json.dumps({"input": "She sells fresh bread."}),
                     {"Content-Type": "application/json"})  # fmt: skip
        r = conn.getresponse()
        running.set()
        answers[name] = r.status, r.read()  # a stream cut short raises IncompleteRead

    streamed = threading.Thread(target=speak, args=("streamed", "/v1/audio/speech?stream=1"))
    streamed.start()
    assert running.wait(120)  # its first samples came: the worker runs it
    queued = threading.Thread(target=speak, args=("queued", "/v1/audio/speech"))
    queued.start()
    assert eventually(lambda: health(served)["queue_depth"] == 1), served["lines"][-10:]
    served["proc"].send_signal(signal.SIGTERM)
    assert eventually(lambda: any("stopping" in x for x in served["lines"]))

    def refused() -> bool:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return True
        return False

    assert eventually(refused)  # no new connection while the two finish
    streamed.join(120)
    queued.join(120)
    assert served["proc"].wait(60) == 0, served["lines"][-20:]
    assert answers["streamed"][0] == answers["queued"][0] == 200
    whole = sf.read(io.BytesIO(answers["queued"][1]), dtype="int16")[0]
    assert len(whole) > 0 and len(answers["streamed"][1]) == 44 + 2 * len(whole)
    assert served["lines"][-1] == "torchtitan serve: stopped"
    assert [r["status"] for r in access(served["lines"]) if r["method"] == "POST"] == [200, 200]
