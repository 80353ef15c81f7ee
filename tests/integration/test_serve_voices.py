"""Speaker-prompted speech through `torchtitan serve`, called with the official `openai` client:
a tiny model trained a few steps with the tts_prompt task (and one without it) behind the
server, here in this process (commands/serve.py ``build``: the command's own start-up, without
a second import of torch). ``--voices DIR``: ``voice="alice"`` speaks exactly what `torchtitan
generate --prompt alice.wav` writes (to the sample before the writers' rounding); ``prompt_audio`` (base64, through ``extra_body``) is the same
voice for one request; concurrent requests of two voices (and one unprompted) run in one batch
and each gets its answer alone; an unknown voice, bad base64 and an upload that is not audio
get 400s naming their field; a model trained without prompts refuses ``--voices`` at start-up
and ``prompt_audio`` with a 400, both with the reason, and still ignores ``voice`` as before."""

from __future__ import annotations

import base64
import contextlib
import io
import threading

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from tests.helpers import make_tiny_run_assets, train_mixture
from torchtitan_speechlm import cli
from torchtitan_speechlm.commands.generate import generate_main
from torchtitan_speechlm.commands.serve import access, build
from torchtitan_speechlm.commands.serve_args import ServeArgs, build_parser
from torchtitan_speechlm.data.template_pieces import Segment
from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder, Sampling
from torchtitan_speechlm.generation.loading import load_model
from torchtitan_speechlm.generation.requests import Request, run_requests
from torchtitan_speechlm.generation.tasks import tts_with_ends
from torchtitan_speechlm.utils.audio import load_audio

pytestmark = [pytest.mark.slow, pytest.mark.long]  # end-to-end runs of prompted TTS: make faults
MAX_FRAMES = 12
# sampled, not greedy: 4 steps of training give one frame over and over greedily, whatever the
# prompt; sampled, each row with its own seeded generator, the voices tell apart
DECODING = ("--max-frames", str(MAX_FRAMES), "--temperature", "1.0")
TEXT = "She sells fresh bread."


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_voices")
    assets = make_tiny_run_assets(tmp / "assets", n_items=8, speakers=2)
    prompted, _ = train_mixture(tmp, assets, "prompted", ["tts_prompt:tiny:0.5", "asr:tiny:0.5"])
    plain, _ = train_mixture(tmp, assets, "plain", ["tts:tiny:0.5", "asr:tiny:0.5"])
    voices = tmp / "voices"
    voices.mkdir()
    t = np.arange(int(22050 * 5.0)) / 22050  # alice: 5 s, stereo, 22.05 kHz (cut to 3 s)
    tone = (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)
    sf.write(voices / "alice.wav", np.stack([tone, tone], 1), 22050)
    wave, rate = sf.read(tmp / "assets" / "wavs" / "u1.wav", dtype="float32")
    sf.write(voices / "bob.flac", wave, rate)  # bob: an utterance of the corpus, as a flac
    return {"prompted": prompted, "plain": plain, "voices": str(voices), "tmp": tmp}


@contextlib.contextmanager
def serving(*argv: str):
    """`torchtitan serve ARGV` started as the command starts it, on a free port: the openai
    client, the access log's JSON lines, its batcher."""
    a = ServeArgs.from_namespace(build_parser().parse_args([*argv, "--port", "0", *DECODING]))
    server, batcher = build(a, access(a))
    lines: list[str] = []
    server.app.log = lines.append
    batcher.start()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    try:
        yield client, lines, batcher
    finally:
        server.shutdown()
        server.server_close()
        batcher.stop()


@pytest.fixture(scope="module")
def voiced(runs):
    with serving("--model", runs["prompted"], "--voices", runs["voices"],
                 "--batch-wait-ms", "300") as served:  # fmt: skip
        yield served


def first_logits(loaded, prompt: np.ndarray) -> list:
    """The model's logits, per stream, for the first audio frame of TEXT spoken in ``prompt``'s
    voice (the prefix ``tts_with_ends`` builds)."""
    b = loaded.builder
    turns = [Segment("user", "audio", b.cut_prompt(prompt)),
             Segment("user", "text", tasks.text_ids(loaded, TEXT))]  # fmt: skip
    prefix = b.prefix(turns, "assistant", "audio")
    return Decoder(loaded.model, DecodeConfig(max_frames=MAX_FRAMES)).forward.start([prefix])


def samples(audio: bytes) -> np.ndarray:
    return sf.read(io.BytesIO(audio), dtype="int16")[0]


def speak(client, text: str = TEXT, **kw) -> np.ndarray:
    return samples(client.audio.speech.create(model="m", input=text, response_format="wav", **kw)
                   .content)  # fmt: skip


def unprompted(client, text: str) -> np.ndarray:
    """A request without ``voice`` (not the openai client's speech call: it always sends one)."""
    return samples(
        client.post("/audio/speech", cast_to=httpx.Response, body={"input": text}).content
    )


def test_voice_selects_its_file_as_generate_prompt_does(voiced, runs, capsys, monkeypatch):
    client, _, _ = voiced
    listed = client.get("/voices", cast_to=object)["data"]
    assert [(v["id"], v["file"]) for v in listed] == [("alice", "alice.wav"), ("bob", "bob.flac")]
    assert listed[0]["seconds"] == 5.0 and listed[0]["prompt_seconds"] == 3.0
    got = speak(client, voice="alice")
    out = runs["tmp"] / "alice.wav"
    argv = ["--model", runs["prompted"], "--task", "tts", "--text", TEXT, *DECODING,
            "--prompt", f"{runs['voices']}/alice.wav", "--out", str(out)]  # fmt: skip
    assert generate_main(argv) == 0, capsys.readouterr().err
    written = sf.read(out, dtype="int16")[0]
    assert len(got) == len(written) > 0
    # soundfile scales floats by 32768 to write 16 bits, serving/wav.py by 32767: at most 1 apart
    assert np.abs(got.astype(int) - written).max() <= 1
    # and to the sample, what generate decoded before writing it (its requests' path)
    loaded = load_model(runs["prompted"])
    req = Request("tts", TEXT, prompt=f"{runs['voices']}/alice.wav")
    codes = run_requests(loaded, [req], DecodeConfig(max_frames=MAX_FRAMES, audio=Sampling(1.0)))[
        0
    ].codes
    expected = loaded.codec.decode(codes)
    np.testing.assert_array_equal(got, np.round(np.clip(expected, -1, 1) * 32767))
    # the voice is heard: bob's request hands the model bob's codes (a tiny model sampled at
    # temperature 1 is near uniform: its samples need not differ, its logits do)
    sent = []

    def spy(loaded, texts, cfg, seeds=None, on_frames=None, prompts_codes=None, **rest):
        sent.extend(prompts_codes or [])
        return tts_with_ends(loaded, texts, cfg, seeds, on_frames, prompts_codes, **rest)

    monkeypatch.setattr(tasks, "tts_with_ends", spy)
    speak(client, voice="bob")
    bob = tasks.speaker_prompt(
        loaded, load_audio(f"{runs['voices']}/bob.flac", loaded.codec.sample_rate)
    )
    alice = tasks.speaker_prompt(loaded, load_audio(req.prompt, loaded.codec.sample_rate))
    assert (
        len(sent) == 1
        and np.array_equal(sent[0], bob)
        and not np.array_equal(bob, alice[: len(bob)])
    )
    first = [first_logits(loaded, p) for p in (alice, bob)]
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(*first, strict=True))
    # prompt_audio: the same file uploaded, one request's voice (the voice field is then ignored)
    b64 = base64.b64encode(open(f"{runs['voices']}/alice.wav", "rb").read()).decode()
    np.testing.assert_array_equal(speak(client, voice="bob", extra_body={"prompt_audio": b64}), got)


def test_unknown_voice_and_bad_prompt_audio_are_400s_naming_their_field(voiced):
    client, _, _ = voiced
    with pytest.raises(openai.BadRequestError) as e:
        speak(client, voice="alloy")
    body = e.value.body
    assert body["param"] == "voice" and body["code"] == "voice_not_found"
    assert "'alloy'" in body["message"] and "alice, bob" in body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        speak(client, voice="alice", extra_body={"prompt_audio": "not base64!"})
    assert e.value.body["param"] == "prompt_audio" and "base64" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        not_audio = base64.b64encode(b"not audio" * 50).decode()
        speak(client, voice="alice", extra_body={"prompt_audio": not_audio})
    assert e.value.body["param"] == "prompt_audio" and e.value.body["code"] == "invalid_audio"
    assert "BytesIO" not in e.value.body["message"]


def test_concurrent_requests_of_two_voices_run_in_one_batch_as_each_would_alone(voiced):
    client, _, batcher = voiced
    calls = [("alice", "The train leaves at noon."), ("bob", "Sentence number two."),
             (None, "A plain one.")]  # fmt: skip

    def call(voice, text):
        return speak(client, text, voice=voice) if voice else unprompted(client, text)

    alone = [call(v, t) for v, t in calls]
    before = batcher.batches_run
    got: dict[int, np.ndarray] = {}
    threads = [
        threading.Thread(target=lambda i=i, c=c: got.__setitem__(i, call(*c)))
        for i, c in enumerate(calls)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(got) == [0, 1, 2]
    # one batch of all three (sent at once, well within --batch-wait-ms 300): both voices and
    # the unprompted row in one model call
    assert batcher.batches_run - before == 1 and batcher.largest_batch == 3
    for i, want in enumerate(alone):  # decoded in a batch by the codec: to float tolerance
        assert len(got[i]) == len(want)
        np.testing.assert_allclose(got[i], want, atol=2)


def error_lines(err: str) -> list[str]:
    """The command's error lines (stderr also holds the weights' loading progress bars)."""
    return [x for x in err.splitlines() if "error" in x]


def test_a_model_trained_without_prompts_refuses_them_with_the_reason(runs, tmp_path, capsys):
    assert cli.main(["serve", "--model", runs["plain"], "--voices", runs["voices"]]) == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert err.startswith("torchtitan serve: error: ")
    assert "trained without speaker prompts" in err and "drop --voices" in err
    with serving("--model", runs["plain"]) as (client, _, _):
        assert len(speak(client, voice="alloy")) > 0  # without --voices: voice is ignored
        wav = base64.b64encode(open(f"{runs['voices']}/alice.wav", "rb").read()).decode()
        with pytest.raises(openai.BadRequestError) as e:
            speak(client, voice="alloy", extra_body={"prompt_audio": wav})
    assert e.value.body["param"] == "prompt_audio" and e.value.body["code"] == "prompt_refused"
    assert "trained without speaker prompts" in e.value.body["message"]


def test_a_voice_file_that_is_not_audio_stops_the_start_with_its_name(runs, tmp_path, capsys):
    (tmp_path / "carol.wav").write_bytes(b"not audio" * 50)
    assert cli.main(["serve", "--model", runs["prompted"], "--voices", str(tmp_path)]) == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert (
        err.startswith("torchtitan serve: error: ") and "carol.wav" in err and "not audio" in err
    ), err
