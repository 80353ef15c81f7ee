"""The continuous audio input (model/audio/tower.py, model/audio/hf_encoder.py): features, the
assembled model against an independent assembly of transformers' parts, padding and packing."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import (
    build_speechlm,
    make_tiny_run_assets,
    save_tiny_backbone,
    spoken_qa_dataset,
    text_only_inputs,
    write_tiny_config,
)
from tests.tiny_whisper import SR, WINDOW, save_tiny_whisper, whisper_config  # noqa: E402
from torchtitan_speechlm.model.audio.encoders import AudioEncoderError
from torchtitan_speechlm.model.audio.tower import AudioEncoderArgs


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio_encoder")
    return {
        "whisper": save_tiny_whisper(root / "whisper"),
        "backbone": str(root / "backbone"),
        "hf": save_tiny_backbone(root / "backbone"),
    }


def speechlm(assets, **options):
    audio = AudioEncoderArgs.from_folder(assets["whisper"], **{"stack": 2, **options})
    return build_speechlm(assets["backbone"], audio_encoder=audio.to_dict()).eval()


def waves(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [0.3 * torch.randn(n, generator=g) for n in lengths]


def sample(model, text_ids, n_samples, at):
    """One sample's frames [T, N] (text, a continuous segment at ``at``) and its audio index."""
    frames_audio = int(model.args.audio.output_frames(n_samples))
    layout = model.args.layout
    t = len(text_ids) + frames_audio
    ids = torch.tensor(text_ids[:at] + [0] * frames_audio + text_ids[at:])
    inp = text_only_inputs(layout, ids[None])[0]
    inp[at : at + frames_audio] = torch.tensor(layout.pad_frame())
    index = torch.full((t,), -1)
    index[at : at + frames_audio] = torch.arange(frames_audio)
    return inp, index


def test_log_mel_equals_whisper_feature_extractor():
    from transformers import WhisperFeatureExtractor

    from torchtitan_speechlm.model.audio.hf_encoder import LogMel

    ext = WhisperFeatureExtractor(feature_size=80, chunk_length=WINDOW // SR)
    fe = {k: int(getattr(ext, k)) for k in ("sampling_rate", "n_fft", "hop_length", "feature_size")}
    mel = LogMel({**fe, "n_samples": ext.n_samples})
    for w in waves(WINDOW, 12345, 400):
        ours = mel(w[None])[0]
        theirs = ext(w.numpy(), sampling_rate=SR, return_tensors="np").input_features[0]
        padded = np.pad(w.numpy(), (0, WINDOW - len(w)))
        numpy_path = ext._np_extract_fbank_features(padded[None], "cpu")[0]
        assert ours.shape == theirs.shape == (80, WINDOW // 160)
        torch.testing.assert_close(ours, torch.from_numpy(theirs), atol=1e-5, rtol=0)
        torch.testing.assert_close(ours, torch.from_numpy(numpy_path).float(), atol=2e-4, rtol=0)


def test_logits_equal_an_independent_assembly(assets):
    """transformers' feature extractor + Whisper encoder, the adaptor in plain PyTorch and
    transformers' decoder on inputs_embeds give our logits (fp32, 1e-5)."""
    from transformers import AutoModelForCausalLM, WhisperFeatureExtractor, WhisperModel

    model = speechlm(assets)
    (wave,) = waves(9000)
    text = [5, 17, 3, 40, 41, 42]
    inp, index = sample(model, text, len(wave), at=2)
    ours = model.logits(
        inp[None],
        audio_wave=wave[None],
        audio_lengths=torch.tensor([len(wave)]),
        audio_index=index[None],
    )[0][0]

    ext = WhisperFeatureExtractor(feature_size=80, chunk_length=WINDOW // SR)
    feats = ext(wave.numpy(), sampling_rate=SR, return_tensors="pt").input_features
    enc = WhisperModel.from_pretrained(assets["whisper"]).encoder.eval()
    with torch.no_grad():
        states = enc(feats).last_hidden_state[0]  # [100, 32]
    real = math.ceil(math.ceil(len(wave) / 160) / 2)  # encoder frames of real audio
    states[real:] = 0
    stacked = states.reshape(-1, 64)  # stack 2
    p = {k.removeprefix("audio_encoder.adaptor."): v for k, v in model.state_dict().items()}
    adapted = F.linear(F.gelu(F.linear(stacked, p["proj_in.weight"], p["proj_in.bias"])),
                       p["proj_out.weight"], p["proj_out.bias"])  # fmt: skip
    n = int(model.args.audio.output_frames(len(wave)))
    lm = AutoModelForCausalLM.from_pretrained(assets["backbone"], dtype=torch.float32).eval()
    ids = torch.tensor(text)
    emb = lm.get_input_embeddings()(ids)
    embeds = torch.cat([emb[:2], adapted[:n], emb[2:]])[None]
    with torch.no_grad():
        theirs = lm(inputs_embeds=embeds).logits[0]
    layout = model.args.layout
    text_logits = ours[:, layout.text_offset : layout.text_offset + layout.text_size]
    torch.testing.assert_close(text_logits, theirs, atol=1e-5, rtol=0)


def test_padded_audio_changes_nothing(assets):
    """An item padded (with noise) in a batch next to a longer one gives its logits alone."""
    model = speechlm(assets)
    a, b = waves(7000, 20000, seed=1)
    text = [7, 8, 9, 10]
    inp_a, idx_a = sample(model, text, len(a), at=1)
    inp_b, idx_b = sample(model, text, len(b), at=1)
    alone = model.logits(
        inp_a[None], audio_wave=a[None], audio_lengths=torch.tensor([7000]), audio_index=idx_a[None]
    )
    t = max(len(inp_a), len(inp_b))
    pad = torch.tensor(model.args.layout.pad_frame())
    rows = torch.stack([torch.cat([x, pad.expand(t - len(x), -1)]) for x in (inp_a, inp_b)])
    n_a = int(model.args.audio.output_frames(7000))
    index = torch.full((2, t), -1)
    index[0, : len(idx_a)] = idx_a
    index[1, : len(idx_b)] = torch.where(idx_b >= 0, idx_b + n_a, -1)
    batch_wave = torch.stack([torch.cat([a, torch.randn(20000 - 7000)]), b])
    both = model.logits(
        rows, audio_wave=batch_wave, audio_lengths=torch.tensor([7000, 20000]), audio_index=index
    )
    for k in range(len(alone)):
        torch.testing.assert_close(both[k][0, : len(inp_a)], alone[k][0], atol=1e-5, rtol=0)


def test_packed_row_with_continuous_segments_equals_each_sample_alone(assets):
    model = speechlm(assets)
    w1, w2 = waves(5000, 11000, seed=2)
    s1 = sample(model, [4, 5, 6, 7, 8], len(w1), at=2)
    s2 = sample(model, [9, 10, 11], len(w2), at=1)
    n1 = int(model.args.audio.output_frames(len(w1)))
    inp = torch.cat([s1[0], s2[0]])[None]
    index = torch.cat([s1[1], torch.where(s2[1] >= 0, s2[1] + n1, -1)])[None]
    pos = torch.cat([torch.arange(len(s1[0])), torch.arange(len(s2[0]))])[None]
    lengths = torch.tensor([len(w1), len(w2)])
    wave = torch.stack([F.pad(w1, (0, len(w2) - len(w1))), w2])
    packed = model.logits(
        inp, position_ids=pos, audio_wave=wave, audio_lengths=lengths, audio_index=index
    )
    at = 0
    for (x, idx), w in ((s1, w1), (s2, w2)):
        alone = model.logits(
            x[None], audio_wave=w[None], audio_lengths=torch.tensor([len(w)]), audio_index=idx[None]
        )
        for k in range(len(alone)):
            torch.testing.assert_close(
                packed[k][0, at : at + len(x)], alone[k][0], atol=1e-5, rtol=0
            )
        at += len(x)


@pytest.mark.parametrize("freeze_encoder", [True, False])
def test_freeze_options_and_token_only_batches(assets, freeze_encoder):
    """Frozen parts get no gradient, trained ones do; a micro-batch without audio still runs
    the tower in training (every FSDP rank gathers and reduces it) and changes no logits."""
    model = speechlm(assets, freeze_encoder=freeze_encoder, freeze_adaptor=False).train()
    layout = model.args.layout
    (w,) = waves(6000)
    inp, idx = sample(model, [3, 4, 5, 6], len(w), at=1)
    tgt = torch.roll(inp, -1, 0)[None]
    weights = torch.ones(tgt.shape)
    weights[0, : idx.ge(0).nonzero().max() + 1] = 0  # no loss up to the continuous segment's end
    out = model(
        inp[None], tgt, weights, audio_wave=w[None], audio_lengths=torch.tensor([6000]),
        audio_index=idx[None],
    )  # fmt: skip
    out.loss_sum.backward()
    enc = dict(model.audio_encoder.encoder.named_parameters())
    trained = [n for n, p in enc.items() if p.grad is not None and p.grad.abs().sum() > 0]
    assert bool(trained) != freeze_encoder
    assert "embed_positions.weight" not in trained  # Whisper's sinusoids stay fixed
    assert all(p.grad.abs().sum() > 0 for p in model.audio_encoder.adaptor.parameters())
    model.zero_grad()
    text = text_only_inputs(layout, torch.tensor([[3, 4, 5, 6]]))
    no_audio = model(text, text, torch.ones(text.shape))
    no_audio.loss_sum.backward()
    assert all(p.grad is not None for p in model.audio_encoder.adaptor.parameters())
    plain = build_speechlm(assets["backbone"])
    torch.testing.assert_close(model.logits(text)[0], plain.logits(text)[0], atol=1e-6, rtol=0)


def test_bad_input_is_named(assets, tmp_path):
    with pytest.raises(AudioEncoderError, match="has no audio\\s+encoder|no audio encoder"):
        AudioEncoderArgs.from_folder(assets["backbone"])
    with pytest.raises(AudioEncoderError, match="no config.json"):
        AudioEncoderArgs.from_folder(str(tmp_path / "nowhere"))
    from transformers import WhisperFeatureExtractor

    bad = save_tiny_whisper(tmp_path / "mels")
    WhisperFeatureExtractor(feature_size=128, chunk_length=2).save_pretrained(bad)
    with pytest.raises(AudioEncoderError, match="128 mel bins, the encoder reads 80"):
        AudioEncoderArgs.from_folder(bad)
    WhisperFeatureExtractor(feature_size=80, chunk_length=30).save_pretrained(bad)
    with pytest.raises(AudioEncoderError, match="3000 mel frames.*the encoder reads 200"):
        AudioEncoderArgs.from_folder(bad)
    model = speechlm(assets)
    inp, idx = sample(model, [3, 4], WINDOW, at=1)
    with pytest.raises(ValueError, match="more than the audio encoder's window of 32000 \\(2 s\\)"):
        model.logits(
            inp[None], audio_wave=torch.zeros(1, WINDOW + 1),
            audio_lengths=torch.tensor([WINDOW + 1]), audio_index=idx[None],
        )  # fmt: skip
    from safetensors.torch import load_file, save_file

    partial = save_tiny_whisper(tmp_path / "partial")
    state = load_file(f"{partial}/model.safetensors")
    del state["encoder.layer_norm.weight"]
    save_file(state, f"{partial}/model.safetensors", metadata={"format": "pt"})
    audio = AudioEncoderArgs.from_folder(partial).to_dict()
    with pytest.raises(AudioEncoderError, match="weights lack.*layer_norm.weight"):
        build_speechlm(assets["backbone"], audio_encoder=audio)
    plain = build_speechlm(assets["backbone"])
    with pytest.raises(ValueError, match="no audio\\s+encoder"):
        plain.logits(inp[None], audio_wave=torch.zeros(1, 100), audio_lengths=torch.tensor([100]))


def test_weights_come_from_the_folder_and_qwen2_audio_plugs_in(assets, tmp_path):
    """Our tower's encoder states equal transformers' for a Whisper folder and for the audio
    tower of a tiny Qwen2-Audio folder (same interface, another family)."""
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        WhisperFeatureExtractor,
        WhisperModel,
    )

    from torchtitan_speechlm.model.audio.tower import AudioTower

    (w,) = waves(WINDOW)
    ext = WhisperFeatureExtractor(feature_size=80, chunk_length=WINDOW // SR)
    feats = ext(w.numpy(), sampling_rate=SR, return_tensors="pt").input_features
    audio = {k: v for k, v in whisper_config().to_dict().items() if k != "model_type"}
    audio = {**audio, "model_type": "qwen2_audio_encoder"}
    text = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(1)
    qwen = Qwen2AudioForConditionalGeneration(
        Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=63)
    )
    qwen.save_pretrained(str(tmp_path / "qwen2_audio"))
    cases = [
        (assets["whisper"], WhisperModel.from_pretrained(assets["whisper"]).encoder),
        (str(tmp_path / "qwen2_audio"), qwen.model.audio_tower),
    ]
    for path, reference in cases:
        args = AudioEncoderArgs.from_folder(path)
        assert json.loads(json.dumps(args.to_dict())) == args.to_dict()  # stored in records
        tower = AudioTower(args, dim=32)
        state = tower.initial_state(0.02, 0, load=True)
        tower.load_state_dict(state)
        with torch.no_grad():
            ours = args.family.run(tower.encoder, tower.features(w[None]), torch.tensor([100]))
            theirs = reference.eval()(feats).last_hidden_state
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
        assert ours.shape[1] == int(args.family.encoder_frames(args.config, torch.tensor(WINDOW)))


def test_config_section_builds_the_tower_and_bad_folders_fail_at_validation(assets, tmp_path):
    """[audio_encoder] reaches the model args through the resolve step; a folder without an
    audio encoder, or with a feature extractor that does not fit it, is a ConfigError from the
    start-up checks (before any rank starts)."""
    from torchtitan.config import ConfigManager

    from torchtitan_speechlm.config import ConfigError
    from torchtitan_speechlm.model.model import build_model
    from torchtitan_speechlm.trainer.run import prepare_run

    run = make_tiny_run_assets(tmp_path / "run", n_items=6)
    toml = write_tiny_config(tmp_path / "tiny.toml", run, tmp_path / "dump")

    def job(*extra):
        args = ["--job.config_file", toml, *extra]
        return ConfigManager().parse_args(args)

    good = job("--audio_encoder.path", assets["whisper"], "--audio_encoder.stack", "5",
               "--audio_encoder.no-freeze-encoder")  # fmt: skip
    args = prepare_run(good)[1]
    assert args.audio.stack == 5 and not args.audio.freeze_encoder
    model = build_model(args)
    assert all(p.requires_grad for n, p in model.audio_encoder.encoder.named_parameters()
               if "embed_positions" not in n)  # fmt: skip
    assert not build_model(type(args)(**{**vars(args), "audio_encoder": {}})).audio_encoder
    with pytest.raises(ConfigError, match="has no audio\\s+encoder"):
        prepare_run(job("--audio_encoder.path", run["backbone"]))
    with pytest.raises(ConfigError, match="audio_encoder.stack = 0"):
        prepare_run(job("--audio_encoder.path", assets["whisper"], "--audio_encoder.stack", "0"))


def test_waveform_data_packs_continuous_segments_and_resumes_exactly(assets, tmp_path):
    """A prepared dataset with waveforms (prepare/waveforms.py) feeds `asr_wave` mixed with
    `tts` through the real loader: continuous segments are placeholder frames without loss
    whose audio_index rows match the adaptor's frames, the waveforms are the items', the model
    trains on the batch, and a loader restored from its state continues with the same batches.
    Missing encoder or waveforms are ConfigErrors first."""
    from torchtitan.config import ConfigManager

    from torchtitan_speechlm.config import ConfigError
    from torchtitan_speechlm.data.reader import PreparedDataset
    from torchtitan_speechlm.model.model import build_model
    from torchtitan_speechlm.prepare.waveforms import add_waveforms, read_manifest, to_int16
    from torchtitan_speechlm.trainer.builders import RunBuilders
    from torchtitan_speechlm.trainer.run import prepare_run, start_run
    from torchtitan_speechlm.utils.audio import load_audio

    run = make_tiny_run_assets(tmp_path / "run", n_items=12)
    toml = write_tiny_config(tmp_path / "tiny.toml", run, tmp_path / "dump")
    mix = ["--speechlm_data.train", "asr_wave:tiny:0.5,tts:tiny:0.5"]

    def job(*extra):
        return ConfigManager().parse_args(["--job.config_file", toml, *mix, *extra])

    with pytest.raises(ConfigError, match="asr_wave:tiny takes continuous audio.*no audio encoder"):
        prepare_run(job())
    with_encoder = ("--audio_encoder.path", assets["whisper"], "--audio_encoder.stack", "2")
    with pytest.raises(ConfigError, match="holds no waveforms"):
        prepare_run(job(*with_encoder))
    manifest = str(tmp_path / "run" / "manifest.jsonl")
    meta = add_waveforms(run["prepared"], manifest)
    meta_path = os.path.join(run["prepared"], "metadata.json")
    for change, error in (
        ({"sample_rate": 8000}, "at 8000 Hz, the audio encoder .* reads 16000 Hz"),
        ({"max_samples": WINDOW + 1}, "longer than the audio encoder's window of 2 s"),
    ):
        with open(meta_path, "w") as f:
            json.dump({**meta, "waveform": {**meta["waveform"], **change}}, f)
        with pytest.raises(ConfigError, match=error):
            prepare_run(job(*with_encoder))
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    data = PreparedDataset(run["prepared"], verify="full")
    paths = read_manifest(manifest)
    for i in (0, 5):
        want = to_int16(load_audio(paths[data.ids[i]], SR))
        np.testing.assert_array_equal(data[i].wave, want)
        assert data.wave_samples[i] == len(want)

    good = job(*with_encoder)
    args = prepare_run(good)[1]
    frames_of = args.audio.frames_of
    pad = torch.tensor(args.layout.pad_frame())
    waves = [data[i].wave for i in range(len(data))]

    def batches(loader, n):
        it = iter(loader)
        return [next(it)[0] for _ in range(n)]

    loader = RunBuilders(start_run(good)).dataloader(1, 0, None, good)
    first = batches(loader, 3)
    seen = 0
    for b in first:
        index, lengths = b["audio_index"], b["audio_lengths"]
        cont = index >= 0
        assert int(cont.sum()) == sum(frames_of(int(n)) for n in lengths)
        assert (b["input"][cont] == pad).all() and (b["loss_weights"][cont] == 0).all()
        # the targets that are placeholder frames carry no loss either
        predicts = torch.zeros_like(cont)
        predicts[:, :-1] = cont[:, 1:]
        assert (b["loss_weights"][predicts] == 0).all()
        for w, n in zip(b["audio_wave"], lengths, strict=True):
            assert any(np.array_equal(w[:n].numpy(), x) for x in waves)  # an item's waveform
            assert not w[n:].any()
        seen += len(lengths)
    assert seen > 0
    model = build_model(args).train()
    out = model(first[0]["input"], **{k: v for k, v in first[0].items() if k != "input"})
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum)
    assert all(p.grad is not None for p in model.audio_encoder.adaptor.parameters())

    # eval's ASR reads the stored waveforms; generate reads the wav: the same transcripts
    from torchtitan_speechlm.evaluation.text_scores import evaluate_asr
    from torchtitan_speechlm.generation import tasks
    from torchtitan_speechlm.generation.decode import DecodeConfig
    from torchtitan_speechlm.generation.loading import Loaded

    loaded = Loaded(model.eval(), {}, run["tokenizer"], run["codec"], "test")
    cfg = DecodeConfig(max_text_tokens=3)
    scored = evaluate_asr(loaded, [data[0], data[1]], cfg)
    heard = [tasks.transcribe(loaded, paths[data.ids[i]], cfg) for i in (0, 1)]
    assert [e["hyp"] for e in scored["examples"]] == heard and "wer" in scored

    loader = RunBuilders(start_run(good)).dataloader(1, 0, None, good)
    batches(loader, 1)
    state = loader.state_dict()
    resumed = RunBuilders(start_run(good)).dataloader(1, 0, None, good)
    resumed.load_state_dict(state)
    for a, b in zip(first[1:], batches(resumed, 2), strict=True):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_espnet_conti_feats_map_onto_the_audio_encoder(assets):
    """ESPnet's conti_feats ({io: [(row, start, length)...], (waves, lengths)}) become our
    continuous inputs, and the converted batch gives the logits of the same sample built here;
    a segment length our encoder would not make is named."""
    from tests.espnet_side.job import espnet_intervals
    from torchtitan_speechlm.python_api import EspnetData
    from torchtitan_speechlm.python_api.espnet_batch import EspnetBatchError

    model = speechlm(assets)
    layout = model.args.layout
    intervals = espnet_intervals(layout.text_size, layout.num_streams, layout.codebook_size)
    no_batches = type("Factory", (), {"build_iter": lambda self, *a, **k: []})()
    data = EspnetData(no_batches, intervals)
    data.continuous_frames = model.args.audio.frames_of
    (w,) = waves(6000)
    n = int(model.args.audio.output_frames(6000))
    text = [3, 4, 5]
    espnet_ids = [1, 5, 8] + [0] * n + [256 + x for x in text]  # bos user audio [conti] text
    seqs = np.zeros((1, len(espnet_ids), layout.num_streams), dtype=np.int64)
    seqs[0, :, 0] = espnet_ids
    masks = np.zeros(seqs.shape, dtype=np.float32)
    conti = {"audio_in": [[(0, 3, n)], (w[None].numpy(), np.array([6000]))]}
    batch, _ = data.convert({"seqs": seqs, "loss_masks": masks, "conti_feats": conti}, layout)
    ours = model.logits(batch.pop("input"), **{k: batch[k] for k in batch if k.startswith("audio")})
    inp, idx = sample(model, [0, 0, 0] + text, 6000, at=3)  # the same frames built here
    inp[:3, 0] = torch.tensor([layout.special(s) for s in ("<|bos|>", "<|user|>", "<|audio|>")])
    inp = inp[:-1]
    alone = model.logits(
        inp[None],
        audio_wave=w[None],
        audio_lengths=torch.tensor([6000]),
        audio_index=idx[None, :-1],
    )
    for k in range(len(alone)):
        torch.testing.assert_close(ours[k], alone[k], atol=1e-6, rtol=0)
    conti["audio_in"][0] = [(0, 3, n + 1)]
    with pytest.raises(EspnetBatchError, match=f"has {n + 1} frames.*makes {n}"):
        data.convert({"seqs": seqs, "loss_masks": masks, "conti_feats": conti}, layout)


@pytest.mark.parametrize("use_cache", [True, False])
def test_asr_generation_encodes_the_prompts_audio(assets, use_cache):
    """Greedy ASR on continuous prompts (two lengths, so left padding shifts one): the first
    token is the argmax of the model's own logits of each prompt alone, and the KV-cache and
    full-recompute paths give the same tokens."""
    from torchtitan_speechlm.data.format import to_int16
    from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
    from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder

    model = speechlm(assets)
    layout = model.args.layout
    builder = TemplateBuilder(layout, "delay", LossWeights(1.0, 1.0, (1 / 3,) * 3),
                              continuous_frames=model.args.audio.frames_of)  # fmt: skip
    pairs = [builder.continuous_prefix(to_int16(w), "assistant", "text") for w in waves(9000, 3000)]
    prompts, audio = [p for p, _ in pairs], [a for _, a in pairs]
    assert len(prompts[0]) != len(prompts[1])
    cfg = DecodeConfig(max_text_tokens=3, use_cache=use_cache)
    tokens = Decoder(model, cfg).text(prompts, audio)
    other = Decoder(model, DecodeConfig(max_text_tokens=3, use_cache=not use_cache))
    assert other.text(prompts, audio) == tokens
    allowed = list(range(layout.text_offset, layout.text_offset + layout.text_size))
    allowed += [layout.special("<|eos|>"), layout.special("<|eot|>")]
    for prompt, ((first, wave),), got in zip(prompts, audio, tokens, strict=True):
        n = int(model.args.audio.frames_of(len(wave)))
        index = torch.full((1, len(prompt)), -1)
        index[0, first : first + n] = torch.arange(n)
        logits = model.logits(
            torch.as_tensor(prompt)[None],
            audio_wave=torch.from_numpy(wave)[None],
            audio_lengths=torch.tensor([len(wave)]),
            audio_index=index,
        )[0][0, -1]
        best = allowed[int(logits[allowed].argmax())]
        assert (got[0] + layout.text_offset if got else layout.special("<|eos|>")) == best or (
            not got and best == layout.special("<|eot|>")
        )


def test_lora_keeps_the_towers_freeze_options(assets):
    """LoRA freezes the model, then the tower's own options apply again: the adaptor trains,
    a frozen encoder stays frozen, Whisper's fixed positions stay fixed."""
    pytest.importorskip("peft")
    from torchtitan_speechlm.model.lora import LoraSettings, apply_lora

    for freeze_encoder in (True, False):
        model = speechlm(assets, freeze_encoder=freeze_encoder)
        settings = LoraSettings(rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj"],
                                train_audio_rows=False, train_head=False)  # fmt: skip
        apply_lora(model, settings)
        tower = dict(model.audio_encoder.named_parameters())
        assert all(p.requires_grad for n, p in tower.items() if n.startswith("adaptor."))
        encoder = {n: p.requires_grad for n, p in tower.items() if n.startswith("encoder.")}
        assert not encoder["encoder.embed_positions.weight"]
        assert any(encoder.values()) != freeze_encoder
        assert not any(p.requires_grad for n, p in model.backbone.named_parameters()
                       if "lora_" not in n)  # fmt: skip


def test_prepare_writes_the_waveforms_in_the_same_command(tmp_path, capsys):
    """``torchtitan prepare --manifest M --waveforms 16000`` gives the dataset the separate
    step gives it (same int16 samples, index and metadata); other sources are refused with
    the way to do it."""
    from torchtitan_speechlm.commands.prepare import main as prepare_main
    from torchtitan_speechlm.data.format import AUDIO_WAVE, WAVE_INDEX
    from torchtitan_speechlm.prepare.waveforms import add_waveforms

    run = make_tiny_run_assets(tmp_path / "run", n_items=6)
    manifest = str(tmp_path / "run" / "manifest.jsonl")
    out = str(tmp_path / "one_command")
    common = ["--codec", run["codec"], "--tokenizer", run["tokenizer"], "--no-progress"]
    assert (
        prepare_main(["--manifest", manifest, *common, "--out-dir", out, "--waveforms", "16000"])
        == 0
    )
    assert "waveforms of 6 items at 16000 Hz" in capsys.readouterr().out
    two_steps = add_waveforms(run["prepared"], manifest, 16000)["waveform"]
    with open(os.path.join(out, "metadata.json")) as f:
        one = json.load(f)["waveform"]
    assert one == two_steps  # rate, dtype, longest item, every file's size and sha256
    shard = sorted(os.listdir(os.path.join(out, "shards")))[0]
    a = np.load(os.path.join(out, "shards", shard, AUDIO_WAVE))
    b = np.load(os.path.join(run["prepared"], "shards", shard, AUDIO_WAVE))
    assert a.dtype == np.int16 and len(a) > 0
    np.testing.assert_array_equal(a, b)
    index = [
        open(os.path.join(d, "shards", shard, WAVE_INDEX)).read() for d in (out, run["prepared"])
    ]
    assert index[0] == index[1] and index[0].count("\n") == 6
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    rc = prepare_main(["--kaldi", str(kaldi), *common, "--out-dir", str(tmp_path / "k"),
                       "--waveforms", "16000"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1 and "--waveforms reads the audio again from a JSONL manifest" in err
    assert "python -m torchtitan_speechlm.prepare.waveforms" in err


def test_spoken_qa_dialogues_read_their_audio_turn_through_the_encoder(assets, tmp_path):
    """Task ``dialogue_wave``: a dialogue's one audio turn is its stored waveform, laid out as
    placeholder frames where ``dialogue`` puts codes, without loss; the other turns and their
    losses are those of ``dialogue``; the index-only length is the built length; the loader
    feeds it mixed with a token task. ``eval``'s answer for each dialogue (from the stored
    waveform) equals ``generate --task answer`` on the wav file, and the scores are jiwer's.
    Dialogues with other than one (user) audio turn are refused, naming the item."""
    from torchtitan.config import ConfigManager

    from torchtitan_speechlm.data.reader import PreparedDataset
    from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
    from torchtitan_speechlm.evaluation.results_table import format_table
    from torchtitan_speechlm.evaluation.text_scores import score_answers
    from torchtitan_speechlm.generation import tasks
    from torchtitan_speechlm.generation.decode import DecodeConfig
    from torchtitan_speechlm.generation.loading import Loaded
    from torchtitan_speechlm.judges import normalise_text
    from torchtitan_speechlm.model.model import build_model
    from torchtitan_speechlm.prepare.waveforms import WaveformError, add_waveforms, to_int16
    from torchtitan_speechlm.trainer.builders import RunBuilders
    from torchtitan_speechlm.trainer.run import prepare_run, start_run
    from torchtitan_speechlm.utils.audio import load_audio

    run = make_tiny_run_assets(tmp_path / "run", n_items=8)
    manifest, qa_dir = spoken_qa_dataset(tmp_path, run)
    qa = PreparedDataset(qa_dir, verify="full")
    toml = write_tiny_config(tmp_path / "tiny.toml", run, tmp_path / "dump")
    job = ConfigManager().parse_args([
        "--job.config_file", toml, "--speechlm_data.datasets", f"tiny={run['prepared']},qa={qa_dir}",
        "--speechlm_data.train", "dialogue_wave:qa:0.5,tts:tiny:0.5",
        "--speechlm_data.valid", "dialogue_wave:qa",
        "--audio_encoder.path", assets["whisper"], "--audio_encoder.stack", "2",
    ])  # fmt: skip
    args = prepare_run(job)[1]
    layout, frames_of = args.layout, args.audio.frames_of
    weights = LossWeights(1.0, 1.0, (1 / 3,) * layout.num_streams)
    builder = TemplateBuilder(layout, "delay", weights, continuous_frames=frames_of)
    sp, off = layout.special, layout.text_offset
    for i in range(len(qa)):
        item = qa[i]
        (audio, question, answer) = item.turns
        ex = builder.build("dialogue_wave", item)
        codec_ex = builder.build("dialogue", item)
        n = int(frames_of(len(item.wave)))
        # the layout written out: <bos> <|user|><|audio|> placeholders <|eot|> <|user|><|text|>
        # question <|eot|> <|assistant|><|text|> answer <|eos|>
        want = [sp("<|bos|>"), sp("<|user|>"), sp("<|audio|>")] + [layout.pad] * n
        want += [sp("<|eot|>"), sp("<|user|>"), sp("<|text|>"), *(off + question.tokens)]
        want += [sp("<|eot|>"), sp("<|assistant|>"), sp("<|text|>"), *(off + answer.tokens)]
        want += [sp("<|eos|>")]
        np.testing.assert_array_equal(ex.frames[:, 0], want)
        assert len(ex.continuous) == 1 and ex.continuous[0][0] == 3
        np.testing.assert_array_equal(ex.continuous[0][1], item.wave)
        np.testing.assert_array_equal(item.wave, to_int16(load_audio(
            json.loads(open(manifest).readlines()[i])["turns"][0]["audio"], SR)))  # fmt: skip
        assert not ex.weights[: 3 + n + 1].any()  # the question carries no loss
        # the text turns' losses are those of the codec-token dialogue, shifted by the frames
        shift = len(codec_ex.frames) - len(ex.frames)
        np.testing.assert_array_equal(ex.weights[3 + n :], codec_ex.weights[3 + n + shift :])
        assert ex.weights[-len(answer.tokens) - 2 :, 0].all()  # <|text|> answer <|eos|>
        assert len(ex.frames) == builder.length(
            "dialogue_wave", qa.text_lengths[i], qa.wave_samples[i], n_audio_turns=1, n_turns=3
        )
        # the generation prompt is the training layout up to the answer's opening
        prompt, waves = builder.prompt(tasks.question_turns(item, True), "assistant", "text", True)
        np.testing.assert_array_equal(prompt, ex.frames[: len(prompt)])
        assert len(prompt) == len(ex.frames) - len(answer.tokens) - 1
        assert len(waves) == 1 and waves[0][0] == 3

    loader = RunBuilders(start_run(job)).dataloader(1, 0, None, job)
    it = iter(loader)
    dialogues = 0
    for _ in range(3):
        b = next(it)[0]
        cont = b["audio_index"] >= 0
        assert int(cont.sum()) == sum(frames_of(int(n)) for n in b["audio_lengths"])
        assert (b["loss_weights"][cont] == 0).all()
        dialogues += len(b["audio_lengths"])
    assert dialogues > 0

    model = build_model(args).eval()
    loaded = Loaded(model, {}, run["tokenizer"], run["codec"], "test")
    cfg = DecodeConfig(max_text_tokens=3)
    items = [qa[0], qa[1]]
    scored = score_answers(loaded, items, cfg)
    paths = [json.loads(line)["turns"][0]["audio"] for line in open(manifest)]
    heard = [tasks.answer(loaded, paths[i], ("Who?", "Whom?")[i], cfg) for i in (0, 1)]
    assert [r["transcript"] for r in scored["per_item"]] == heard
    import jiwer

    refs = [qa[i].turns[-1].text for i in (0, 1)]
    assert scored["task"] == "dialogue" and [r["text"] for r in scored["per_item"]] == refs
    want_wer = [jiwer.wer(normalise_text(r), normalise_text(h) or "<empty>")
                for r, h in zip(refs, heard, strict=True)]  # fmt: skip
    np.testing.assert_allclose([r["wer"] for r in scored["per_item"]], want_wer)
    assert scored["exact"] == np.mean([w == 0 for w in want_wer])
    assert "answers exactly right" in format_table({"dialogue:qa": scored})

    # bad dialogues: two audio turns have no one waveform; an assistant audio turn is no input
    bad = tmp_path / "bad.jsonl"
    two = [{"role": "user", "audio": paths[0]}, {"role": "user", "audio": paths[1]},
           {"role": "assistant", "text": "Hi."}]  # fmt: skip
    bad.write_text(json.dumps({"id": "two", "turns": two}) + "\n")
    from torchtitan_speechlm.prepare.pipeline import prepare_dataset

    prepare_dataset(str(bad), run["codec"], run["tokenizer"], str(tmp_path / "bad"), progress=False)
    with pytest.raises(WaveformError, match=r"\['two'\].*exactly one audio turn"):
        add_waveforms(str(tmp_path / "bad"), str(bad))
    spoken = qa[0]
    spoken.turns = [
        spoken.turns[1],
        type(spoken.turns[0])("assistant", "audio", spoken.turns[0].tokens),
    ]
    with pytest.raises(ValueError, match="'qa0'.*exactly one audio turn, a user or system turn.*"
                       "spoken by the assistant"):  # fmt: skip
        builder.build("dialogue_wave", spoken)
