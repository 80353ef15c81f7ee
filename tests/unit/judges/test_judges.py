"""The independent judges (torchtitan_speechlm/judges) on real espeak-ng speech.

Real models where a wheel ships one (pocketsphinx, resemblyzer, DNSMOS): a restricted
recogniser transcribes reference speech almost perfectly, the speaker encoder ranks a voice
above its content, DNSMOS ranks clean above noisy. The transformers judges run tiny random
models built here (their machinery, not their accuracy). Plus the input handling every judge
shares, the text normalisation and the error rates.
"""

from __future__ import annotations

import functools
import importlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import soundfile as sf

from torchtitan_speechlm.demo.assets import build_backbone, load_sentences
from torchtitan_speechlm.judges import (
    JUDGES,
    JudgeError,
    adapt_audio,
    build_judge,
    error_rates,
    item_errors,
    normalise_text,
)
from torchtitan_speechlm.utils.audio import resample
from torchtitan_speechlm.utils.registry import UnknownNameError

needs_espeak = pytest.mark.skipif(
    shutil.which("espeak-ng") is None, reason="espeak-ng binary not installed"
)
SENTENCES = load_sentences()[:4]


@functools.cache
def speak(text: str, voice: str = "en-us") -> tuple[np.ndarray, int]:
    """espeak-ng speech of ``text`` as (float32 mono, its rate: 22050 Hz)."""
    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        subprocess.run(["espeak-ng", "-w", f.name, "-v", voice, text], check=True)
        wav, rate = sf.read(f.name, dtype="float32")
    return wav, rate


@pytest.fixture(scope="module")
def restricted_asr():
    return build_judge("pocketsphinx", vocabulary=SENTENCES)


# ---- (a) ASR -----------------------------------------------------------------------------------
@needs_espeak
def test_restricted_pocketsphinx_transcribes_reference_speech(restricted_asr):
    hyps = [restricted_asr.transcribe(*speak(s)) for s in SENTENCES]
    assert all(isinstance(h, str) and h == h.lower() for h in hyps)
    assert error_rates(SENTENCES, hyps)["wer"] <= 0.1, hyps
    # The transcripts follow the audio, not the vocabulary: against the wrong sentences they
    # are mostly errors.
    wrong = SENTENCES[1:] + SENTENCES[:1]
    assert error_rates(wrong, hyps)["wer"] > 0.5


@needs_espeak
def test_restricted_pocketsphinx_only_outputs_vocabulary_words(restricted_asr):
    words = {w for s in SENTENCES for w in normalise_text(s).split()}
    hyp = restricted_asr.transcribe(*speak("Our neighbor plays the piano every evening."))
    assert set(hyp.split()) <= words


def test_pocketsphinx_silence_is_an_empty_transcript(restricted_asr):
    assert restricted_asr.transcribe(np.zeros(16000, np.float32), 16000) == ""


@needs_espeak
def test_pocketsphinx_grammar_file(tmp_path):
    grammar = tmp_path / "yes_no.gram"
    grammar.write_text("#JSGF V1.0;\ngrammar yn;\npublic <answer> = yes | no ;\n")
    judge = build_judge("pocketsphinx", grammar=str(grammar))
    assert judge.transcribe(*speak("yes")) in ("yes", "no", "")
    assert "JSGF" in judge.describe()
    with pytest.raises(JudgeError, match="does not exist"):
        build_judge("pocketsphinx", grammar=str(tmp_path / "missing.gram"))


def test_pocketsphinx_vocabulary_outside_the_dictionary():
    with pytest.raises(JudgeError, match="qzxvbnk") as e:
        build_judge("pocketsphinx", vocabulary=["hello", "Qzxvbnk", "world"])
    assert "hello" not in str(e.value) and "pronunciations" in str(e.value)
    judge = build_judge(
        "pocketsphinx", vocabulary=["hello", "qzxvbnk"], pronunciations={"qzxvbnk": "K W IH K"}
    )
    assert judge.vocabulary == ["hello", "qzxvbnk"]


# ---- (b) speaker similarity ----------------------------------------------------------------------
@needs_espeak
def test_resemblyzer_ranks_the_voice_above_the_content():
    judge = build_judge("resemblyzer")
    text_a, text_b = " ".join(load_sentences()[0:3]), " ".join(load_sentences()[3:6])
    voice_a = judge.embed(*speak(text_a, "en-us"))
    assert voice_a.shape == (256,) and np.isfinite(voice_a).all()
    same_voice = judge.similarity(voice_a, judge.embed(*speak(text_b, "en-us")))
    other_voice = judge.similarity(voice_a, judge.embed(*speak(text_a, "en-us+f3")))
    assert same_voice > other_voice
    assert judge.similarity(voice_a, judge.embed(*speak(text_a, "en-us"))) > 0.999


# ---- (c) quality ---------------------------------------------------------------------------------
@needs_espeak
def test_dnsmos_ranks_clean_above_noisy():
    judge = build_judge("dnsmos")
    wav, rate = speak(" ".join(SENTENCES[:3]))
    clean = np.resize(wav, int(9.5 * rate))  # one 9.01 s DNSMOS window: one model call
    noise = np.random.default_rng(0).standard_normal(clean.size).astype(np.float32)
    noisy = clean + noise * np.sqrt(np.mean(clean**2) / 10 ** (5 / 10))  # 5 dB SNR
    a, b = judge.score(clean, rate), judge.score(noisy, rate)
    assert set(a) == {"dnsmos_ovrl", "dnsmos_sig", "dnsmos_bak", "dnsmos_p808"}
    assert all(1.0 <= v <= 5.0 for v in a.values())
    assert a["dnsmos_ovrl"] > b["dnsmos_ovrl"] and a["dnsmos_bak"] > b["dnsmos_bak"]


# ---- (d) transformers judges on tiny random models ---------------------------------------------------
def _tiny_whisper(out: str, multilingual: bool) -> str:
    import torch
    from tokenizers import pre_tokenizers
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperTokenizer,
    )

    specials = ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>"]
    specials.append("<|notimestamps|>")
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for token in ["<|endoftext|>", *specials]:
        vocab[token] = len(vocab)
    tok = WhisperTokenizer(vocab=vocab, merges=[], additional_special_tokens=specials)
    eot = vocab["<|endoftext|>"]
    config = WhisperConfig(
        vocab_size=len(vocab), num_mel_bins=80, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_source_positions=1500, max_target_positions=16,
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=vocab["<|startoftranscript|>"],
        begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    gen = model.generation_config
    gen.max_length = 12
    gen._from_model_config = False  # else loading rebuilds it from the model config
    if multilingual:
        gen.is_multilingual = True
        gen.lang_to_id = {"<|en|>": vocab["<|en|>"]}
        gen.task_to_id = {
            "transcribe": vocab["<|transcribe|>"],
            "translate": vocab["<|translate|>"],
        }
        gen.no_timestamps_token_id = vocab["<|notimestamps|>"]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(out)
    return out


def _tiny_xvector(out: str) -> str:
    import torch
    from transformers import Wav2Vec2FeatureExtractor, WavLMConfig, WavLMForXVector

    config = WavLMConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, tdnn_dim=(16, 16, 32), tdnn_kernel=(5, 3, 1),
        tdnn_dilation=(1, 2, 1), xvector_output_dim=8, num_buckets=32, max_bucket_distance=100,
    )  # fmt: skip
    torch.manual_seed(0)
    WavLMForXVector(config).save_pretrained(out)
    Wav2Vec2FeatureExtractor(sampling_rate=16000, return_attention_mask=True).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_judges")
    return {
        "whisper": _tiny_whisper(str(root / "whisper"), multilingual=False),
        "whisper_ml": _tiny_whisper(str(root / "whisper_ml"), multilingual=True),
        "xvector": _tiny_xvector(str(root / "xvector")),
        "qwen3": build_backbone(str(root / "qwen3")),
    }


@needs_espeak
@pytest.mark.parametrize("which", ["whisper", "whisper_ml"])
def test_transformers_asr_runs_a_local_whisper(tiny_models, which):
    judge = build_judge("transformers-asr", path=tiny_models[which])
    assert judge.sample_rate == 16000 and "whisper" in judge.describe()
    expected = {"language": "en", "task": "transcribe"} if which == "whisper_ml" else {}
    assert judge.generate_kwargs == expected
    assert isinstance(judge.transcribe(*speak(SENTENCES[0])), str)


@needs_espeak
def test_transformers_sv_embeds_with_a_local_xvector_model(tiny_models):
    judge = build_judge("transformers-sv", path=tiny_models["xvector"])
    wav, rate = speak(SENTENCES[0])
    a = judge.embed(wav, rate)
    assert a.shape == (8,) and np.isfinite(a).all()
    np.testing.assert_allclose(judge.embed(wav, rate), a, rtol=1e-5, atol=1e-6)
    assert judge.similarity(a, judge.embed(*speak(SENTENCES[1]))) < 1.0


# ---- (e) bad inputs --------------------------------------------------------------------------------
def test_transformers_judges_reject_bad_folders(tiny_models, tmp_path):
    for name in ("transformers-asr", "transformers-sv"):
        with pytest.raises(JudgeError, match="does not exist"):
            build_judge(name, path=str(tmp_path / "nowhere"))
        with pytest.raises(JudgeError, match="no config.json"):
            build_judge(name, path=str(tmp_path))
        with pytest.raises(JudgeError, match="'qwen3'"):
            build_judge(name, path=tiny_models["qwen3"])
    with pytest.raises(JudgeError, match="'whisper'.*not a speaker"):
        build_judge("transformers-sv", path=tiny_models["whisper"])


def test_build_judge_rejects_unknown_names_and_options():
    assert {"pocketsphinx", "transformers-asr", "resemblyzer", "transformers-sv", "dnsmos"} <= set(
        JUDGES.names()
    )
    with pytest.raises(UnknownNameError, match="pocketsphinx"):
        build_judge("pocketsphinks")
    with pytest.raises(JudgeError, match="vocab.*options: vocabulary"):
        build_judge("pocketsphinx", vocab=["a"])


@needs_espeak
def test_44k_stereo_is_resampled_and_downmixed(restricted_asr):
    wav, rate = speak(SENTENCES[2])
    mono16 = resample(wav, rate, 16000)
    mono44 = resample(mono16, 16000, 44100)
    want = restricted_asr.transcribe(mono16, 16000)
    assert want
    assert restricted_asr.transcribe(np.stack([mono44, mono44], axis=1), 44100) == want  # [T, C]
    assert restricted_asr.transcribe(np.stack([mono44, mono44]), 44100) == want  # [C, T]
    # Downmix = mean over the (shorter) channel axis, then polyphase resampling.
    stereo = np.stack([mono44, 0.5 * mono44], axis=1)
    np.testing.assert_allclose(
        adapt_audio(stereo, 44100, 16000), resample(0.75 * mono44, 44100, 16000), atol=1e-6
    )
    pcm = (np.clip(mono16, -1, 1) * 32767).astype(np.int16)  # integer PCM is scaled to [-1, 1]
    np.testing.assert_allclose(adapt_audio(pcm, 16000, 16000), mono16, atol=1e-4)


def test_unusable_audio_is_a_judge_error(restricted_asr):
    with pytest.raises(JudgeError, match="empty"):
        restricted_asr.transcribe(np.zeros(0, np.float32), 16000)
    with pytest.raises(JudgeError, match="empty"):
        adapt_audio(np.zeros((2, 0), np.float32), 44100, 16000)
    with pytest.raises(JudgeError, match="NaN"):
        restricted_asr.transcribe(np.array([0.0, np.nan, 0.1], np.float32), 16000)
    with pytest.raises(JudgeError, match="shape"):
        adapt_audio(np.zeros((2, 2, 100), np.float32), 16000, 16000)


def test_a_missing_package_names_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "speechmos", None)  # None in sys.modules: ImportError
    monkeypatch.setitem(sys.modules, "speechmos.dnsmos", None)
    with pytest.raises(JudgeError, match=r"torchtitan-speechlm\[eval\].*speechmos"):
        build_judge("dnsmos")


def test_importing_the_judges_imports_no_optional_package(monkeypatch):
    """Every judge module re-imported with its optional packages unimportable."""
    for heavy in ("pocketsphinx", "resemblyzer", "speechmos", "speechmos.dnsmos", "webrtcvad"):
        monkeypatch.setitem(sys.modules, heavy, None)
    for heavy in ("onnxruntime", "librosa"):
        monkeypatch.setitem(sys.modules, heavy, None)
    import torchtitan_speechlm.judges as judges

    for module in ("dnsmos", "pocketsphinx_asr", "resemblyzer_sim", "transformers_asr"):
        importlib.reload(importlib.import_module(f"torchtitan_speechlm.judges.{module}"))
    importlib.reload(importlib.import_module("torchtitan_speechlm.judges.transformers_sv"))
    importlib.reload(judges)
    assert "pocketsphinx" in judges.JUDGES


# ---- text normalisation and error rates ------------------------------------------------------------
@pytest.mark.parametrize(
    "text, want",
    [
        ("The quick brown fox.", "the quick brown fox"),
        ("Could you pass me the salt, please?", "could you pass me the salt please"),
        ("Don't STOP—believing!", "don't stop believing"),
        ("It\u2019s Bob\u2019s", "it's bob's"),
        ("'Quoted' words, the dogs' toys", "quoted words the dogs toys"),
        ("A well-known e.g. U.S.A. fact", "a well known eg usa fact"),
        (
            "\uff26\uff55\uff4c\uff4c-width \uff12\uff10\uff12\uff14 and 3.5%",
            "full width 2024 and 35",
        ),
        ("  spaces\n\tand   tabs  ", "spaces and tabs"),
        ("Caf\u00e9 na\u00efve", "caf\u00e9 na\u00efve"),
        ("...!?", ""),
        ("", ""),
    ],
)
def test_normalise_text(text, want):
    assert normalise_text(text) == want


def test_error_rates_with_empty_hypotheses():
    # 5 reference words, the second item's 2 all deleted: WER 2/5; its 5 characters ("a dog")
    # deleted out of 16 ("the cat sat" + "a dog").
    rates = error_rates(["The cat sat.", "A dog!"], ["the cat sat", ""])
    assert rates["wer"] == pytest.approx(2 / 5) and rates["deletions"] == 2
    assert rates["cer"] == pytest.approx(5 / 16)
    assert error_rates(["one two three"], [""])["wer"] == 1.0
    assert error_rates(["Hello, World!"], ["hello world"])["wer"] == 0.0
    with pytest.raises(ValueError):
        error_rates(["a", "b"], ["a"])


def test_item_errors_alignment():
    e = item_errors("The cat sat on the mat.", "the big bat sat on mat")
    ref, hyp = e["ref"].split(), e["hyp"].split()
    assert [w for _, r, _ in e["ops"] for w in r] == ref  # every word once, in order
    assert [w for _, _, h in e["ops"] for w in h] == hyp
    ops = {op for op, _, _ in e["ops"]}
    assert ops == {"equal", "substitute", "delete", "insert"}
    for op, r, h in e["ops"]:
        assert (op == "equal") == (r == h)
        assert (op == "delete") == (not h) and (op == "insert") == (not r)
    # big inserted, cat -> bat, the deleted (or cat -> big, bat inserted): 3 edits, 6 words.
    assert e["wer"] == pytest.approx(3 / 6)
    empty = item_errors("one two", "")
    assert empty["wer"] == 1.0 and empty["ops"] == [("delete", ["one", "two"], [])]
    assert item_errors("", "")["wer"] == 0.0
