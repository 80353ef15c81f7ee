"""`torchtitan serve` end to end, called with the official `openai` client: a tiny trained and
exported model (tests/helpers.py ``tiny_export``) behind the server in its own process. Speech
comes back as the library's wav at the codec's rate (streamed while generated: as long, the
same spectrum), transcription as text
equal to the library's own for the same audio (another rate and stereo: resampled, downmixed),
8 concurrent calls run in batches larger than one (a ninth, too long for the model, fails its
batch and alone gets its 400), every bad request gets its status and
OpenAI's error JSON (the client raises the matching class), and the server still answers after
all of them. A folder that is not a SpeechLM ends the command at start with one line. (A full
queue's 503 and a failing row's 500: tests/unit/serving/test_serving_http.py, deterministic.)"""

from __future__ import annotations

import io
import json
import os
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


@pytest.fixture(scope="module")
def server(model):
    cmd = [sys.executable, "-m", "torchtitan_speechlm.cli", "serve", "--model", model["export"],
           "--port", "0", "--max-frames", str(MAX_FRAMES), "--batch-wait-ms", "100",
           "--max-upload-mb", "0.1"]  # fmt: skip
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
    yield {"url": url[0], "client": client, "lines": lines, "proc": proc}
    proc.terminate()
    proc.wait(30)


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

    def speech_lines() -> list[str]:
        return [x for x in server["lines"] if x.startswith("POST /v1/audio/speech")]

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
    statuses = sorted(line.split()[2] for line in speech)  # method route status ms batch
    assert statuses == ["200"] * 8 + ["400"]
    assert max(int(line.split()[-1]) for line in speech) > 1


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

    def statuses() -> set[str]:
        return {x.split()[2] for x in server["lines"] if x.startswith(("GET", "POST"))}

    assert eventually(lambda: {"400", "404", "413"} <= statuses()), server["lines"][-20:]


def test_a_folder_that_is_not_a_speechlm_ends_the_command_with_one_line(tmp_path, capsys):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    for folder in (tmp_path / "llama", tmp_path / "missing", tmp_path):
        t = time.monotonic()
        assert cli.main(["serve", "--model", str(folder), "--port", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("torchtitan serve: error: ") and "\n" not in err, err
        assert time.monotonic() - t < 30
