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

import base64
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.helpers import start_server, tiny_export
from torchtitan_speechlm import cli

pytestmark = pytest.mark.slow
MAX_FRAMES = 30


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("serve"), steps=60)


def start(model, *flags: str) -> dict:
    """`torchtitan serve --model EXPORT --port 0 FLAGS` in its own process, once it listens
    (tests/helpers.py ``start_server``)."""
    return start_server(model["export"], *flags)


@pytest.fixture(scope="module")
def server(model):
    served = start(model, "--max-frames", str(MAX_FRAMES), "--batch-wait-ms", "100",
                   "--max-upload-mb", "0.1", "--max-input-chars", "8000")  # fmt: skip
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


def stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP): its state in /proc is T."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def children(pid: int) -> set[int]:
    """The processes ``pid`` started (every thread's /proc children list)."""
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out.update(int(c) for c in f.read().split())
    return out


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
        model="export", voice="alloy", input=text, response_format="wav"
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
    with pytest.raises(openai.BadRequestError, match="supported: mp3, opus, aac, flac, wav, pcm"):
        client.audio.speech.create(model="export", voice="alloy", input="Hi.",
                                   response_format="ogg")  # fmt: skip
    with pytest.raises(openai.NotFoundError, match="Invalid URL"):
        client.get("/no/such/route", cast_to=object)
    with pytest.raises(openai.BadRequestError, match="not audio") as e:
        client.audio.transcriptions.create(model="export", file=("notes.wav", b"not audio" * 50))
    assert e.value.body["param"] == "file" and "BytesIO" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="supported: json, text, srt, verbose_json"):
        with open(utterance(model), "rb") as f:
            client.audio.transcriptions.create(model="export", file=f, response_format="docx")
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


def test_engine_vllm_refuses_a_delay_model_and_flags_it_cannot_take(model, capsys):
    """`--engine vllm` on this (delay) model ends at start with one line naming the fix, before
    any vLLM is reached; flags that make no sense with it end before the model loads
    (tests/unit/serving/test_vllm_engine.py: every refusal; tests/integration/test_serve_vllm.py:
    a real vLLM)."""
    base = ["serve", "--model", model["export"], "--port", "0", "--engine", "vllm"]
    assert cli.main([*base, "--vllm-url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (after transformers' progress bar)
    assert err.startswith("torchtitan serve: error: --engine vllm cannot serve "), err
    assert "pattern 'delay'" in err and "--engine ours" in err, err
    assert cli.main([*base, "--vllm-url", "http://127.0.0.1:9", "--cfg-scale", "2"]) == 2
    assert "--cfg-scale is not taken with --engine vllm" in capsys.readouterr().err
    assert cli.main(["serve", "--model", model["export"], "--vllm-url", "http://x"]) == 2
    assert "only with --engine vllm" in capsys.readouterr().err


@pytest.mark.long  # its own server (~11 s): make faults
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


def test_a_request_arriving_while_a_batch_runs_joins_it_and_gets_what_it_gets_alone(model):
    """Continuous batching: a streamed request runs 120 frames; a second, sent once the first's
    samples come, joins its batch at the next decode step (no second batch), and each gets
    the very bytes it gets alone."""
    frames = "120"
    served = start(model, "--min-frames", frames, "--max-frames", frames)
    host, port = served["url"].removeprefix("http://").split(":")
    running = threading.Event()

    def speak(path: str, text: str, answers: dict) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", path, json.dumps({"input": text}),
                     {"Content-Type": "application/json"})  # fmt: skip
        r = conn.getresponse()
        running.set()
        answers[path, text] = r.status, r.read()

    first = ("/v1/audio/speech?stream=1", "She sells fresh bread.")
    second = ("/v1/audio/speech", "The train leaves at noon.")
    try:
        together: dict = {}
        a = threading.Thread(target=speak, args=(*first, together))
        a.start()
        assert running.wait(120)  # its first samples came: its batch runs
        speak(*second, together)
        a.join(120)
        h = health(served)
        assert h["rows_joined"] == 1 and h["batches_run"] == 1, h
        alone: dict = {}
        speak(*first, alone)
        speak(*second, alone)
        assert health(served)["batches_run"] == 3
        assert together == alone and all(status == 200 for status, _ in alone.values())
    finally:
        served["proc"].terminate()
        served["proc"].wait(30)


# ---- OpenAI parity, field by field (docs/serving.md, *OpenAI's fields*) ----------------------
def speech_bytes(client, fmt: str, **kw) -> tuple[bytes, str]:
    r = client.audio.speech.with_raw_response.create(
        model="export", voice="alloy", input="The quick brown fox.", response_format=fmt, **kw
    )
    return r.content, r.headers["content-type"]


def decoded(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """float mono samples and their rate, read by libraries (not our encoder)."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767, 24000
    if fmt == "aac":
        import av

        with av.open(io.BytesIO(data)) as f:
            frames = [fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)]
            return np.concatenate(frames).astype(np.float32), f.streams.audio[0].rate
    wave, rate = sf.read(io.BytesIO(data), dtype="float32")
    return wave.reshape(len(wave), -1)[:, 0], rate


def band_energies(x: np.ndarray, rate: int) -> np.ndarray:
    """log energies of 8 bands from 150 Hz, per 512-sample frame (the DC and hum a lossy
    codec's high-pass removes left out: the tiny model's audio has much of both)."""
    from scipy.signal import stft

    f, _, z = stft(x - x.mean(), fs=rate, nperseg=512)
    power, edges = np.abs(z) ** 2, np.geomspace(150, 0.45 * rate, 9)
    return np.log10(np.stack([power[(f >= a) & (f < b)].mean(0)
                              for a, b in zip(edges[:-1], edges[1:], strict=True)]) + 1e-10)  # fmt: skip


def test_every_response_format_is_the_same_speech(server, library):
    """Each format decodes (soundfile / PyAV) to the wav answer's speech: exact for flac, the
    same waveform for the 24 kHz pcm (resampled here by FFT, not our filter), the same band
    energies for the lossy codecs (after their encoder delay)."""
    from scipy.signal import resample

    from torchtitan_speechlm.serving.audio_formats import SPEECH_FORMATS

    client = server["client"]
    wav, _ = speech_bytes(client, "wav")
    ref, rate = sf.read(io.BytesIO(wav), dtype="float32")
    seconds = len(ref) / rate
    kinds = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
             "opus": "audio/ogg", "aac": "audio/aac"}  # fmt: skip
    assert set(SPEECH_FORMATS) >= {"wav", "pcm", "flac", "mp3", "opus"}
    for fmt in SPEECH_FORMATS:
        data, ctype = speech_bytes(client, fmt)
        assert ctype.startswith(kinds[fmt]), (fmt, ctype)
        got, got_rate = decoded(data, fmt)
        if fmt in ("flac", "wav"):
            np.testing.assert_array_equal(got, ref)
            continue
        want = resample(ref, round(len(ref) * got_rate / rate)) if got_rate != rate else ref
        assert abs(len(got) / got_rate - seconds) < 0.15, fmt  # codec padding at most
        if fmt == "pcm":
            assert np.corrcoef(got, want)[0, 1] > 0.99
            continue
        z = got - got.mean()
        lag = int(np.argmax(np.correlate(z, want - want.mean(), "valid"))) if len(got) > len(
            want) else 0  # fmt: skip
        a, b = band_energies(want, got_rate), band_energies(got[lag : lag + len(want)], got_rate)
        assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.9, fmt


def test_speed_stretches_time_and_is_checked(server):
    client = server["client"]
    base = sf.info(io.BytesIO(speech_bytes(client, "wav")[0])).frames
    for speed in (0.5, 2.0):
        frames = sf.info(io.BytesIO(speech_bytes(client, "wav", speed=speed)[0])).frames
        assert frames == pytest.approx(base / speed, rel=0.03), speed
    with pytest.raises(openai.BadRequestError) as e:
        speech_bytes(client, "wav", speed=5.0)
    assert e.value.body["param"] == "speed"
    with pytest.raises(openai.BadRequestError, match="time-stretch"):
        speech_bytes(client, "pcm", speed=2.0, extra_body={"stream": True})


def test_sse_and_audio_streams(server, library):
    """stream_format "sse": OpenAI's events, the deltas' bytes the pcm answer's length, usage
    counted independently; "audio": the bytes as generated; a format written whole is refused
    when streamed."""
    client = server["client"]
    pcm, _ = speech_bytes(client, "pcm")
    with client.audio.speech.with_streaming_response.create(
        model="export", voice="alloy", input="The quick brown fox.", response_format="pcm",
        stream_format="sse",
    ) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = [json.loads(x[6:]) for x in body.split("\n\n") if x.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    streamed = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(streamed) == len(pcm)
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    wav, _ = speech_bytes(client, "wav")
    frames = -(-sf.info(io.BytesIO(wav)).frames // library.codec.samples_per_frame)
    n_in = len(library.tokenizer("The quick brown fox.", add_special_tokens=False)["input_ids"])
    assert done["usage"] == {"input_tokens": n_in, "output_tokens": frames *
                             library.codec.num_streams, "total_tokens": n_in + frames *
                             library.codec.num_streams}  # fmt: skip
    with client.audio.speech.with_streaming_response.create(
        model="export", voice="alloy", input="The quick brown fox.", response_format="pcm",
        stream_format="audio",
    ) as r:  # fmt: skip
        assert r.headers["transfer-encoding"] == "chunked"
        assert len(b"".join(r.iter_bytes())) == len(pcm)
    with pytest.raises(openai.BadRequestError, match="written whole"):
        speech_bytes(client, "mp3", stream_format="sse")
    with pytest.raises(openai.BadRequestError, match="instructions are not supported"):
        speech_bytes(client, "wav", instructions="Speak softly.")


def test_transcription_formats_and_fields(server, model, library):
    from openai.types.audio import TranscriptionVerbose

    client = server["client"]
    path = utterance(model)
    seconds = sf.info(path).duration

    def call(**kw):
        with open(path, "rb") as f:
            return client.audio.transcriptions.create(model="export", file=f, **kw)

    text = call().text
    verbose = call(response_format="verbose_json", language="en",
                   timestamp_granularities=["segment"])  # fmt: skip
    assert isinstance(verbose, TranscriptionVerbose)
    assert verbose.text == text and verbose.language == "en"
    assert verbose.duration == pytest.approx(seconds, abs=1e-3)
    assert verbose.segments[0].start == 0 and verbose.segments[-1].end == pytest.approx(seconds)

    def clock(t: float, sep: str) -> str:  # SubRip / WebVTT time, computed here
        ms = round(t * 1000)
        return (
            f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"
        )

    srt = call(response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> ") and clock(seconds, ",") in srt and text in srt
    vtt = call(response_format="vtt")
    assert vtt.startswith("WEBVTT") and clock(seconds, ".") in vtt
    assert call(temperature=0.0).text == text  # greedy, as the server's default
    for kw, param in (({"temperature": 2.0}, "temperature"), ({"prompt": "Hello."}, "prompt"),
                      ({"timestamp_granularities": ["word"]}, "timestamp_granularities")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            call(**kw)
        assert e.value.body["param"] == param


def test_metrics_count_what_was_served_read_by_curl(server):
    """GET /metrics with curl: Prometheus's text, parsed by prometheus_client's parser; the
    speech answers grow by exactly the calls made."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        out = subprocess.run(["curl", "-sf", server["url"] + "/metrics"], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(out) for s in f.samples}  # fmt: skip

    key = ("speechlm_requests_total", (("route", "/v1/audio/speech"), ("status", "200")))
    tokens = ("speechlm_generated_tokens_total", (("task", "tts"),))
    before = scrape()
    for _ in range(3):
        speech_bytes(server["client"], "wav")
    assert eventually(lambda: scrape().get(key, 0) == before.get(key, 0) + 3)
    after = scrape()
    assert after[tokens] > before.get(tokens, 0)
    assert after["speechlm_batch_size_count", (("task", "tts"),)] >= 3
    assert ("speechlm_queue_depth", ()) in after


@pytest.mark.long  # a second server of two processes (~14 s): make faults
def test_two_replicas_serve_one_port_and_drain(model):
    """--replicas 2 on the CPU: two processes answer on one port (their pids in /health), the
    metrics of either are the sum of both, SIGTERM drains both and the command exits 0."""
    served = start(model, "--replicas", "2", "--max-frames", "10")
    try:
        results: list[int] = []

        def call(i: int) -> None:
            data, _ = speech_bytes(served["client"], "wav")
            results.append(len(data))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 8 and min(results) > 44
        # Both replicas accept on the one socket. Which one takes a fresh connection is up to
        # the scheduler (on a loaded machine the same one took 40 in a row), so one is stopped:
        # then the other must answer, and the first answers again once it is continued.
        first = health(served)["pid"]
        os.kill(first, signal.SIGSTOP)
        try:
            assert eventually(lambda: stopped(first)), f"replica {first} did not stop"
            other = health(served)["pid"]
        finally:
            os.kill(first, signal.SIGCONT)
        assert other != first
        assert {first, other} <= children(served["proc"].pid)  # the command's two replicas
        text = urllib.request.urlopen(served["url"] + "/metrics", timeout=30).read().decode()
        line = 'speechlm_requests_total{route="/v1/audio/speech",status="200"} '
        assert float(text.split(line)[1].split()[0]) == 8
    finally:
        served["proc"].send_signal(signal.SIGTERM)
        assert served["proc"].wait(60) == 0
    assert sum("replica" in x and "serving" in x for x in served["lines"]) == 2
