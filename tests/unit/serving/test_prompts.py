"""A speech request's speaker prompt (serving/prompts.py) and the ``--voices`` folder's names
(serving/voices.py ``voice_files``), without a model: which field wins, the forms taken
(OpenAI's ``{"id"}`` voice, a data URL, wrapped base64), and each refusal's field and code."""

import base64
import io

import numpy as np
import pytest
import soundfile as sf

from torchtitan_speechlm.serving.prompts import PromptError, Voice, request_prompt
from torchtitan_speechlm.serving.voices import voice_files

RATE = 8000
CODES = np.zeros((3, 2), np.int64)
VOICES = {"alice": Voice("alice", "v/alice.wav", 1.0, 1.0, CODES)}


def wav_b64(seconds: float = 0.1, rate: int = 16000, wrap: bool = False) -> str:
    buf = io.BytesIO()
    sf.write(buf, np.full(int(seconds * rate), 0.1, np.float32), rate, format="WAV")
    text = base64.encodebytes(buf.getvalue()) if wrap else base64.b64encode(buf.getvalue())
    return text.decode()


def test_voice_selects_codes_only_with_voices_and_prompt_audio_wins():
    assert request_prompt({"voice": "alloy"}, {}, None, RATE).codes is None  # no --voices
    assert request_prompt({"voice": "alice"}, VOICES, None, RATE).codes is CODES
    assert request_prompt({"voice": {"id": "alice"}}, VOICES, None, RATE).codes is CODES
    assert request_prompt({}, VOICES, None, RATE).codes is None  # no voice: unprompted
    got = request_prompt({"voice": "nobody", "prompt_audio": wav_b64()}, VOICES, None, RATE)
    assert got.codes is None and got.wave.shape == (800,)  # resampled to RATE


@pytest.mark.parametrize("form", ["wrapped", "data-url"])
def test_prompt_audio_forms(form):
    text = wav_b64(wrap=True) if form == "wrapped" else "data:audio/wav;base64," + wav_b64()
    assert len(request_prompt({"prompt_audio": text}, {}, None, RATE).wave) == 800


@pytest.mark.parametrize(
    "req, param, code",
    [
        ({"voice": "alloy"}, "voice", "voice_not_found"),
        ({"voice": 3}, "voice", None),
        ({"prompt_audio": 3}, "prompt_audio", None),
        ({"prompt_audio": "%%%"}, "prompt_audio", "invalid_base64"),
        ({"prompt_audio": base64.b64encode(b"text").decode()}, "prompt_audio", "invalid_audio"),
    ],
)
def test_refusals_name_their_field(req, param, code):
    with pytest.raises(PromptError) as e:
        request_prompt(req, VOICES, None, RATE)
    assert (e.value.param, e.value.code) == (param, code)
    assert "BytesIO" not in e.value.message


def test_a_model_without_prompts_refuses_prompt_audio_with_its_reason():
    with pytest.raises(PromptError, match="no prompts here") as e:
        request_prompt({"prompt_audio": "%%%"}, {}, "no prompts here", RATE)
    assert e.value.code == "prompt_refused"  # the reason before the upload is even read


def test_voice_files(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        voice_files(str(tmp_path / "missing"))
    (tmp_path / ".hidden.wav").write_bytes(b"")
    with pytest.raises(ValueError, match="holds no audio files"):
        voice_files(str(tmp_path))
    (tmp_path / "bob.flac").write_bytes(b"")
    (tmp_path / "alice.wav").write_bytes(b"")
    assert list(voice_files(str(tmp_path))) == ["alice", "bob"]
    (tmp_path / "alice.mp3").write_bytes(b"")
    with pytest.raises(ValueError, match="alice.mp3 and alice.wav are both voice 'alice'"):
        voice_files(str(tmp_path))
