"""ESPnet's data side as its users bring it (``espnet==202511`` from the registry: its
``DataIteratorFactory`` and dataset readers; its job template, preprocessor and ios rewritten
from ESPnet's sources in tests/espnet_side), and what ``EspnetData`` makes of it: the batch
format (a test that fails if tests/espnet_side drifts from the cited files' rules), our ids,
discrete audio tokenised in the step exactly as ESPnet's model places it, and the bad inputs.
In-process, a few seconds each."""

import json

import numpy as np
import pytest
import torch

from tests.espnet_side.assets import job_config, prepare_stats, specifiers

N, CODEBOOK = 4, 64  # the tiny codec: 4 streams of 64 codes, 320 samples per frame (50/s)


def job(assets, **kw):
    from tests.espnet_side.job import SpeechLMJobTemplate

    return SpeechLMJobTemplate(job_config(assets, **kw))


def factory(assets, tmp_path, config_kw=None, tasks=("text_to_audio", "audio_to_text"),
            batch_size=300, shuffle=True):  # fmt: skip
    """ESPnet's own DataIteratorFactory over the corpus, the job's preprocessor as collate_fn."""
    from espnet2.speechlm.dataloader.iterator import DataIteratorFactory

    config = job_config(assets, **(config_kw or {}))
    specs = specifiers(assets, tasks)
    stats = dict(assets, stats=str(tmp_path / "stats"))
    prepare_stats(stats, config, specs)
    j = job(assets, **(config_kw or {}))
    f = DataIteratorFactory(specs, "", stats_dir=stats["stats"], collate_fn=j.build_preprocessor()
                            .collate_fn, batch_size=batch_size, num_workers=0, shuffle=shuffle)  # fmt: skip
    return j, f


def layout_of(j):
    from torchtitan_speechlm.model.vocab import VocabLayout

    lo, hi = j.vocab_intervals["text"][0]
    return VocabLayout(text_size=hi - lo, num_streams=N, codebook_size=CODEBOOK)


def ours_by_rule(seqs: torch.Tensor, intervals: dict, layout) -> torch.Tensor:
    """ESPnet ids -> ours, element by element, by the rules written out once more: 0 is each
    stream's pad, ids 1-8 the same specials, text moves to our text offset, an audio stream's
    interval is its pad then its codes."""
    (text_lo, text_hi), streams = intervals["text"][0], intervals["discrete_audio"]
    out = torch.empty_like(seqs)
    for idx in np.ndindex(*seqs.shape):
        v, k = int(seqs[idx]), idx[-1]
        if v == 0:
            out[idx] = layout.pad if k == 0 else layout.stream_pad(k)
        elif v < 9:
            out[idx] = v
        elif text_lo <= v < text_hi:
            out[idx] = layout.text_offset + v - text_lo
        else:
            (s,) = [j for j, (a, b) in enumerate(streams) if a <= v < b]
            a = streams[s][0]
            out[idx] = layout.stream_pad(s) if v == a else layout.code(s, v - a - 1)
    return out


def test_espnets_batches_have_the_cited_files_format(espnet_assets, tmp_path):
    """One TTS and one ASR sample through ESPnet's factory: the batch equals one built here by
    hand from the rules of speechlm_job.py / audio.py / text.py (bos; per turn role, modality,
    content, eos; zeros where the audio goes, delay-sized; loss on the assistant turn, stream
    weights on audio, BOS 0; the waveform and its segment in conti_feats)."""
    from espnet2.speechlm.dataloader.dataset import SingleDataset

    j, f = factory(espnet_assets, tmp_path)
    ds = SingleDataset(espnet_assets["data_json"])
    uid = ds.sample_ids[5]
    item = ds[uid]
    wav, sr = item["audio1"]
    assert wav.shape[0] == 1 and sr == 16000  # the wheel's lhotse reader: [channels, samples]
    batch = j.build_preprocessor().collate_fn(
        [(("text_to_audio", "tiny", uid), item), (("audio_to_text", "tiny", uid), item)]
    )
    assert sorted(batch) == ["conti_feats", "key", "loss_masks", "seqs"]

    text = [256 + t for t in j.multimodal_io["text"].tokenizer.encode(item["text1"])]
    frames = wav.shape[-1] // 320 + N - 1  # frames plus the delay interleave's N - 1
    z, one = [0] * (N - 1), [1.0] + [0.0] * (N - 1)

    def special(i):
        return [i, *z]

    tts = [special(1), special(5), special(7), *[[t, *z] for t in text], special(2),
           special(6), special(8), *[[0] * N] * frames, special(2)]  # fmt: skip
    tts_mask = [[0.0] * N] * (4 + len(text)) + [one, one] + [[1.0] * N] * frames + [one]
    asr = [special(1), special(5), special(8), *[[0] * N] * frames, special(2), special(6),
           special(7), *[[t, *z] for t in text], special(2)]  # fmt: skip
    asr_mask = [[0.0] * N] * (4 + frames) + [one, one] + [one] * len(text) + [one]
    t = max(len(tts), len(asr))
    seqs, masks = np.zeros((2, t, N), np.int64), np.zeros((2, t, N), np.float32)
    for row, (s, m) in enumerate([(tts, tts_mask), (asr, asr_mask)]):
        seqs[row, : len(s)], masks[row, : len(m)] = s, m
    assert torch.equal(batch["seqs"], torch.from_numpy(seqs))
    assert torch.equal(batch["loss_masks"].float(), torch.from_numpy(masks))
    (segments, (waves, lengths)) = batch["conti_feats"]["discrete_audio"]
    assert segments == [(0, 4 + len(text) + 2, frames), (1, 3, frames)]
    assert waves.shape == (2, wav.shape[-1], 1) and lengths.tolist() == [wav.shape[-1]] * 2
    torch.testing.assert_close(waves[0, :, 0], torch.from_numpy(wav[0]).float())

    built = next(iter(f.build_iter(0, 1)))  # the wheel's factory hands the same kind of batch
    assert sorted(built) == sorted(batch) and built["seqs"].shape[-1] == N


@pytest.mark.parametrize("io_order", [("text", "discrete_audio"), ("discrete_audio", "text")])
def test_the_step_places_encode_batchs_tokens_where_espnets_model_does(
    espnet_assets, tmp_path, io_order
):
    """Batches of varied rows (bucketed TTS and ASR) converted, then tokenised in the step:
    the input and targets equal ESPnet's own placement (``codes[:length]`` written at each
    segment, as parallel.py's ``_embed`` does, with the io's offset) mapped to our ids by
    rule, in either order of the job's ios (another vocabulary layout); the data statistics
    count the placed codes."""
    from torchtitan_speechlm.components.step_codec import StepCodec
    from torchtitan_speechlm.data.collation import data_stats_keys
    from torchtitan_speechlm.python_api import EspnetData

    j, f = factory(espnet_assets, tmp_path, {"io_order": io_order})
    intervals = j.vocab_intervals
    assert (list(intervals)[1] == "text") == (io_order[0] == "text")
    data = EspnetData(f, intervals, multimodal_io=j.multimodal_io)
    layout = layout_of(j)
    keys = data_stats_keys(N)
    step = StepCodec(data.step_tokenizer(layout, "delay"), layout, keys)
    io = j.multimodal_io["discrete_audio"]
    rows_seen = set()
    for batch in f.build_iter(0, 4):
        ours, labels = data.convert(batch, layout)
        assert ours["step_audio"].shape[0] == len(batch["conti_feats"]["discrete_audio"][0])
        step(ours)
        assert not any(k.startswith("step_audio") for k in ours)
        segments, (wave, lengths) = batch["conti_feats"]["discrete_audio"]
        codes = io.encode_batch(wave, lengths) + intervals["discrete_audio"][0][0]
        seqs = batch["seqs"].clone()
        for code, (b, start, length) in zip(codes, segments, strict=True):
            seqs[b, start : start + length] = code[:length]
        expect = ours_by_rule(seqs, intervals, layout)
        assert torch.equal(ours["input"], expect[:, :-1])
        assert torch.equal(ours["targets"], expect[:, 1:])
        rows_seen.add(len(batch["seqs"]))
        stats = dict(zip(keys, ours["data_stats"][0].tolist(), strict=True))
        audio = expect[:, :-1] - layout.stream_offset(0)
        is_code = (audio >= 0) & (audio % (CODEBOOK + 1) != 0)
        assert stats["audio_frames"] == pytest.approx(float(is_code.sum()) / N)
        assert stats["task_tts"] + stats["task_asr"] == len(batch["key"])
    assert max(rows_seen) > 1  # rows of several lengths shared a batch


def test_a_codec_of_ours_tokenises_in_espnets_intervals(espnet_assets, tmp_path):
    """``speechlm_data.step_codec`` = the io's own codec folder: each segment's ids equal that
    codec's ``encode`` of the clip (cut to the frame shift), offset into our stream blocks and
    delay-interleaved, computed here; for the batch's longest clip they equal ESPnet's io too
    (shorter clips differ only where ESPnet's batched encode put codes of the zero padding)."""
    from torchtitan_speechlm.codecs import load_codec
    from torchtitan_speechlm.python_api import EspnetData
    from torchtitan_speechlm.python_api.espnet_io import CodecTokenizer

    j, f = factory(espnet_assets, tmp_path, tasks=("text_to_audio",))
    layout = layout_of(j)
    data = EspnetData(f, j.vocab_intervals, multimodal_io=j.multimodal_io)
    ours = CodecTokenizer(espnet_assets["codec"], layout, delay=True)
    mine = data.step_tokenizer(layout, "delay")
    codec = load_codec(espnet_assets["codec"])
    batch = next(b for b in f.build_iter(0, 8) if len(b["seqs"]) > 1)
    segments, (wave, lengths) = batch["conti_feats"]["discrete_audio"]
    frames = torch.tensor([s[2] for s in segments])
    got, theirs = ours.tokenize(wave, lengths, frames), mine.tokenize(wave, lengths, frames)
    for i, n in enumerate(lengths.tolist()):
        f_i = n // 320
        codes = codec.encode([wave[i, : f_i * 320, 0].numpy()])[0][:f_i]
        want = np.full((f_i + N - 1, N), 0)
        for k in range(N):
            want[:, k] = layout.stream_pad(k)
            want[k : k + f_i, k] = [layout.code(k, int(c)) for c in codes[:, k]]
        assert torch.equal(got[i, : f_i + N - 1], torch.from_numpy(want))
    longest = int(lengths.argmax())
    n = int(frames[longest])
    assert torch.equal(got[longest, :n], theirs[longest, :n])


def test_a_resume_skips_the_trained_batches_without_collating_them(espnet_assets, tmp_path):
    """Inside a chunk, the loader starts at its saved offset: ESPnet's collate_fn runs for the
    batches trained from here on only, and they are the same batches as without the skip."""
    from torchtitan_speechlm.python_api import EspnetData
    from torchtitan_speechlm.python_api.espnet_data import EspnetTrainLoader

    j, f = factory(espnet_assets, tmp_path)
    layout = layout_of(j)
    data = EspnetData(f, j.vocab_intervals, multimodal_io=j.multimodal_io)
    full = EspnetTrainLoader(data, layout, chunk=6, dp_rank=0, dp=1)
    it = iter(full)
    first = [next(it)[0]["input"] for _ in range(6)]
    calls = []
    collate = f.collate_fn
    f.collate_fn = lambda items: calls.append(len(items)) or collate(items)
    resumed = EspnetTrainLoader(data, layout, chunk=6, dp_rank=0, dp=1)
    resumed.load_state_dict(full.state_dict() | {"dp_rank_0": __import__("pickle").dumps(
        {"chunk_start": 0, "offset": 4})})  # fmt: skip
    it = iter(resumed)
    rest = [next(it)[0]["input"] for _ in range(2)]
    assert len(calls) == 2  # batches 4 and 5 only
    assert all(torch.equal(a, b) for a, b in zip(first[4:], rest, strict=True))


def test_mixed_batches_keep_every_item_within_the_frames_and_mix_the_tasks(espnet_assets, tmp_path):
    """``mix_espnet_batches``: the factory's own items, each once, in batches of at most the
    frames asked (their lengths from ESPnet's stats), no longer cut from a length-sorted list
    (where a task's items sit apart from the other's); the same batches from the same seed
    (every rank), and ESPnet's ``build_iter`` serves them."""
    import collections

    from torchtitan_speechlm import mix_espnet_batches
    from torchtitan_speechlm.python_api.espnet_mixing import read_lengths

    _, f = factory(espnet_assets, tmp_path, batch_size=300)
    stats = str(tmp_path / "stats")
    before = [list(map(tuple, b)) for b in f.batched_examples]
    items = [e for b in before for e in b]
    lengths = read_lengths(stats, items)
    with open(next(p for p in (tmp_path / "stats").iterdir())) as fh:  # ESPnet's own lines
        key, length = next(iter(json.loads(fh.readline()).items()))
    assert length in {lengths[e] for e in items if e[2] == key}

    def spread(batches):  # ESPnet's are cut from a length-sorted list: items of one length
        return sum(max(lengths[e] for e in b) - min(lengths[e] for e in b) for b in batches)

    n = mix_espnet_batches(f, stats, frames=300, seed=3)
    after = f.batched_examples
    assert n == len(after) and collections.Counter(e for b in after for e in b) == (
        collections.Counter(items)
    )
    assert all(sum(lengths[e] for e in b) <= 300 or len(b) == 1 for b in after)
    assert spread(after) > 2 * spread(before)  # no longer one length per batch
    _, g = factory(espnet_assets, tmp_path / "again", batch_size=300)
    mix_espnet_batches(g, stats, frames=300, seed=3)
    assert g.batched_examples == after
    batch = next(iter(f.build_iter(global_step=0, length=1)))
    assert sorted(map(tuple, batch["key"])) in [sorted(b) for b in after]
    with pytest.raises(FileNotFoundError, match="stats_dir the factory was built with"):
        mix_espnet_batches(g, str(tmp_path / "nowhere"), frames=300)


def test_espnets_task_names_are_counted_and_its_specials_are_ours(espnet_assets, tmp_path):
    from torchtitan_speechlm.data.collation import data_stats_keys
    from torchtitan_speechlm.python_api import EspnetData
    from torchtitan_speechlm.python_api.espnet_batch import EspnetBatchError

    j, f = factory(espnet_assets, tmp_path, tasks=("text_to_audio", "audio_to_text", "text_only"))
    layout = layout_of(j)
    data = EspnetData(f, j.vocab_intervals, multimodal_io=j.multimodal_io)
    counts = dict.fromkeys(("tts", "asr", "text"), 0.0)
    espnet = dict.fromkeys(("text_to_audio", "audio_to_text", "text_only"), 0)
    for batch in f.build_iter(0, 12):
        stats = dict(
            zip(data_stats_keys(N), data.convert(batch, layout)[0]["data_stats"][0], strict=True)
        )
        for task in counts:
            counts[task] += float(stats[f"task_{task}"])
        for task, _, _ in batch["key"]:
            espnet[task] += 1
    assert counts == {"tts": espnet["text_to_audio"], "asr": espnet["audio_to_text"],
                      "text": espnet["text_only"]} and espnet["text_only"] > 0  # fmt: skip
    batch = next(iter(f.build_iter(0, 1)))
    batch["seqs"][0, 1, 0] = 10  # <|video|>: ESPnet's, not ours
    with pytest.raises(EspnetBatchError, match=r"^ESPnet token id 10 \(a special token"):
        data.convert(batch, layout)


def test_an_espnet_dialogue_with_a_prompt_turn_converts_as_its_tokens(espnet_assets, tmp_path):
    """ESPnet has no speaker-prompt input (docs/python-api.md, *Speaker prompts*); the one way a
    prompt reaches its batches is a dialogue whose user turn holds another utterance's audio.
    Those are tokens like any other: they arrive as our codes in the user turn, without loss,
    laid out by ESPnet's chat template (``<|eos|>`` where the role changes, not our
    ``<|eot|>``), and nothing marks them as a prompt."""
    from torchtitan_speechlm.python_api import EspnetData

    j, f = factory(espnet_assets, tmp_path)
    layout = layout_of(j)
    data = EspnetData(f, j.vocab_intervals, multimodal_io=j.multimodal_io)
    (c0, _), (c1, _), (c2, _), (c3, _) = j.vocab_intervals["discrete_audio"]
    bos, eos, eot, user, assistant, text, audio = 1, 2, 3, 5, 6, 7, 8
    seqs = [[bos, 0, 0, 0], [user, 0, 0, 0], [audio, 0, 0, 0], [c0 + 5, c1 + 10, c2 + 2, c3 + 1],
            [eot, 0, 0, 0], [user, 0, 0, 0], [text, 0, 0, 0], [256 + 7, 0, 0, 0],
            [eos, 0, 0, 0], [assistant, 0, 0, 0], [audio, 0, 0, 0],
            [c0 + 3, c1 + 4, c2 + 6, c3], [eos, 0, 0, 0]]  # fmt: skip
    masks = np.zeros((1, len(seqs), N), dtype=np.float32)
    masks[0, 9:, 0], masks[0, 11] = 1.0, 1.0  # the assistant turn only
    inputs, _ = data.convert({"seqs": np.array([seqs]), "loss_masks": masks}, layout)
    ids = inputs["input"][0]
    assert [layout.specials[int(i)] for i in ids[[0, 1, 2, 4, 8], 0]] == [
        "<|bos|>", "<|user|>", "<|audio|>", "<|eot|>", "<|eos|>"]  # fmt: skip
    assert ids[3].tolist() == [layout.code(0, 4), layout.code(1, 9), layout.code(2, 1),
                               layout.code(3, 0)]  # fmt: skip
    assert ids[11].tolist() == [layout.code(0, 2), layout.code(1, 3), layout.code(2, 5),
                                layout.stream_pad(3)]  # ESPnet's stream pad is ours  # fmt: skip
    assert float(inputs["loss_weights"][0, :8].sum()) == 0.0  # up to the text's <|eos|>


# ---- bad input: one line naming the field and the fix ------------------------------------------
def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_a_batch_whose_io_has_no_codec(espnet_assets, tmp_path):
    from torchtitan_speechlm.python_api import EspnetData
    from torchtitan_speechlm.python_api.espnet_batch import EspnetBatchError

    j, f = factory(espnet_assets, tmp_path)
    data = EspnetData(f, j.vocab_intervals)  # no ios, no step codec
    with pytest.raises(EspnetBatchError) as e:
        data.convert(next(iter(f.build_iter(0, 1))), layout_of(j))
    text = one_line(e)
    assert "discrete io 'discrete_audio'" in text and "multimodal_io=job.multimodal_io" in text
    assert '"step_codec"' in text


def test_a_codec_of_another_shape_or_rate(espnet_assets, tmp_path):
    from types import SimpleNamespace

    from torchtitan_speechlm.codecs.kmeans import fit_kmeans_codec
    from torchtitan_speechlm.config import ConfigError
    from torchtitan_speechlm.python_api import EspnetData

    j, f = factory(espnet_assets, tmp_path)
    rng = np.random.default_rng(0)
    wavs = [rng.standard_normal(16000).astype(np.float32) for _ in range(4)]
    data = EspnetData(f, j.vocab_intervals, multimodal_io=j.multimodal_io)

    def run(step_codec, pattern="delay"):
        cfg = SimpleNamespace(speechlm=SimpleNamespace(pattern=pattern),
                              speechlm_data=SimpleNamespace(step_codec=step_codec),
                              audio_encoder=SimpleNamespace(path=""))  # fmt: skip
        with pytest.raises(ConfigError) as e:
            data.resolve(cfg)
        return one_line(e)

    small = fit_kmeans_codec(wavs, str(tmp_path / "k32"), num_codebooks=4, codebook_size=32,
                             iters=2)  # fmt: skip
    text = run(small)
    assert "4 streams of 32 codes" in text and "'discrete_audio' 4 streams of 64" in text
    slow = fit_kmeans_codec(wavs, str(tmp_path / "k25"), num_codebooks=4, codebook_size=64,
                            iters=2, frame_rate=25.0)  # fmt: skip
    text = run(slow)
    assert "25 frames/s" in text and "50" in text and "step_codec" in text
    text = run("", pattern="parallel")
    assert "speechlm.pattern = 'parallel'" in text and "set speechlm.pattern = 'delay'" in text


def test_mel_features_where_waveforms_are_expected(espnet_assets, tmp_path):
    """ESPnet's ContinuousAudioIO (ASR's user audio by default) hands 128-bin mel features."""
    from torchtitan_speechlm.python_api import EspnetData
    from torchtitan_speechlm.python_api.espnet_batch import EspnetBatchError

    kw = {"continuous": True, "audio_input": "continuous_audio"}
    j, f = factory(espnet_assets, tmp_path, kw, tasks=("audio_to_text",))
    batch = next(iter(f.build_iter(0, 1)))
    (_, (feats, _)) = batch["conti_feats"]["continuous_audio"]
    assert feats.shape[-1] == 128
    data = EspnetData(f, j.vocab_intervals, multimodal_io=j.multimodal_io)
    data.continuous_frames = lambda n: n  # even with an audio encoder
    with pytest.raises(EspnetBatchError) as e:
        data.convert(batch, layout_of(j))
    text = one_line(e)
    assert "128-dim feature frames" in text and "audio_input: discrete_audio" in text


def test_an_espnet_checkpoint_of_another_vocabulary(espnet_assets, tmp_path):
    from tests.espnet_side.model import save_espnet_checkpoint, train_some_steps
    from torchtitan_speechlm.config import ConfigError
    from torchtitan_speechlm.python_api.espnet_checkpoint import EspnetCheckpoint
    from torchtitan_speechlm.python_api.espnet_vocab import EspnetVocab, int_intervals

    # the same job keeping 3 of the codec's 4 codebooks: fewer ids
    model = job(espnet_assets, audio_kwargs={"codec_max_token_per_frame": 3}).build_model()
    path = save_espnet_checkpoint(model, *train_some_steps(model, 1), 1, str(tmp_path))
    ours = job(espnet_assets)
    vocab = EspnetVocab(int_intervals(ours.vocab_intervals), None, "text")
    with pytest.raises(ConfigError) as e:
        EspnetCheckpoint(path).check(vocab, model.config.to_dict(), tied=False)
    text = one_line(e)
    assert "vocabulary of 710 ids" in text and "have 775" in text
    assert "bin/export_checkpoint.py" in text


def test_batches_and_factories_that_cannot_be_read(espnet_assets, tmp_path):
    from torchtitan_speechlm.config import ConfigError
    from torchtitan_speechlm.python_api import EspnetData
    from torchtitan_speechlm.python_api.data import resolve_data
    from torchtitan_speechlm.python_api.espnet_batch import EspnetBatchError

    j, f = factory(espnet_assets, tmp_path)
    layout = layout_of(j)
    data = EspnetData(f, j.vocab_intervals, multimodal_io=j.multimodal_io)
    batch = next(iter(f.build_iter(0, 1)))
    with pytest.raises(EspnetBatchError, match=r"`speaker`.*tts_prompt:NAME"):
        data.convert(dict(batch, speaker=["spk1"]), layout)
    with pytest.raises(EspnetBatchError, match="`seqs`"):
        data.convert({"input_ids": batch["seqs"]}, layout)
    flat = {k: v for k, v in batch.items() if k != "conti_feats"}
    flat["discrete_audio_feats"] = batch["conti_feats"]["discrete_audio"][1][0]
    with pytest.raises(EspnetBatchError, match="without `discrete_audio_indices`"):
        data.convert(flat, layout)
    segments, (_, lengths) = batch["conti_feats"]["discrete_audio"]
    flat.update(discrete_audio_indices=segments, discrete_audio_lengths=lengths)
    a, b = data.convert(flat, layout)[0], data.convert(batch, layout)[0]  # the same, flattened
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError) as e:
        resolve_data(f, {}, {})
    assert "pass ESPnet's model object as `model`" in one_line(e)


def test_generation_prompts_an_espnet_trained_model_as_espnets_template_did(
    espnet_assets, tmp_path
):
    """With ``chat_template = "espnet"`` (what TitanTrainer records for ESPnet's data) our
    TTS and ASR generation prompts are exactly the prefixes of ESPnet's training rows (its
    user turn ends with <|eos|>); our own template differs there, with <|eot|>."""
    from espnet2.speechlm.dataloader.dataset import SingleDataset

    from torchtitan_speechlm.components.step_codec import StepCodec
    from torchtitan_speechlm.data.collation import data_stats_keys
    from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
    from torchtitan_speechlm.data.template_pieces import Segment
    from torchtitan_speechlm.model.patterns import get_pattern
    from torchtitan_speechlm.python_api import EspnetData

    j, f = factory(espnet_assets, tmp_path)
    layout = layout_of(j)
    data = EspnetData(f, j.vocab_intervals, multimodal_io=j.multimodal_io)
    ds = SingleDataset(espnet_assets["data_json"])
    uid = ds.sample_ids[3]
    batch = j.build_preprocessor().collate_fn(
        [(("text_to_audio", "tiny", uid), ds[uid]), (("audio_to_text", "tiny", uid), ds[uid])]
    )
    ours, _ = data.convert(batch, layout)
    StepCodec(data.step_tokenizer(layout, "delay"), layout, data_stats_keys(N))(ours)
    text = np.array(j.multimodal_io["text"].tokenizer.encode(ds[uid]["text1"]))
    (_, start, frames) = batch["conti_feats"]["discrete_audio"][0][1]  # the ASR row's audio
    codes = get_pattern("delay").deinterleave(ours["input"][1, start : start + frames].numpy())
    codes = codes - np.array([layout.code(k, 0) for k in range(N)])
    weights = LossWeights(1.0, 1.0, (1 / N,) * N)
    for template, same in (("espnet", True), ("ours", False)):
        builder = TemplateBuilder(layout, "delay", weights, chat_template=template)
        tts = builder.prefix([Segment("user", "text", text)], "assistant", "audio")
        asr = builder.prefix([Segment("user", "audio", codes)], "assistant", "text")
        for row, prompt in ((0, tts), (1, asr)):
            got = ours["input"][row, : len(prompt)].numpy()
            assert np.array_equal(got, prompt) == same, (template, row)
            if not same:  # the one difference: the user turn's end
                (where,) = np.nonzero((got != prompt).any(-1))[0]
                assert layout.specials[int(prompt[where, 0])] == "<|eot|>"
                assert layout.specials[int(got[where, 0])] == "<|eos|>"
