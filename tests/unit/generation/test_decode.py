"""Decoding: cached == uncached token for token (greedy), for every pattern, batched with
different prompt lengths; masks never let a wrong modality or stream be sampled; guidance."""

import numpy as np
import pytest
import torch

from tests.helpers import build_speechlm, save_tiny_backbone
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.data.template_pieces import Segment
from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder, index_map
from torchtitan_speechlm.generation.sampling import Sampling, pick
from torchtitan_speechlm.model.patterns import get_pattern


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    path = tmp_path_factory.mktemp("bb") / "bb"
    save_tiny_backbone(path, vocab_size=60, hidden_size=48, intermediate_size=96)
    return path


def setup(backbone, pattern):
    model = build_speechlm(
        backbone, num_streams=3, codebook_size=16, pattern=pattern, init_seed=3
    ).eval()
    with torch.no_grad():  # a trained-looking head: make the speech rows matter
        model.head.stream_emb.weight.normal_(0, 0.5)
    lay = model.args.layout
    builder = TemplateBuilder(lay, pattern, LossWeights(1.0, 1.0, (1 / 3, 1 / 3, 1 / 3)))
    prompts = [
        builder.prefix([Segment("user", "text", np.arange(3, 3 + n))], "assistant", "audio")
        for n in (4, 9)
    ]
    return model, builder, prompts


@pytest.mark.parametrize("pattern", ["delay", "parallel", "flatten"])
def test_cached_decoding_equals_full_recompute(backbone, pattern):
    model, builder, prompts = setup(backbone, pattern)
    cfg = dict(max_frames=10, min_frames=2)
    cached = Decoder(model, DecodeConfig(**cfg)).audio(prompts)
    full = Decoder(model, DecodeConfig(use_cache=False, **cfg)).audio(prompts)
    assert [c.tolist() for c in cached] == [f.tolist() for f in full]
    assert all(len(c) >= 2 and c.min() >= 0 and c.max() < 16 for c in cached)
    asr_prompts = [
        builder.prefix([Segment("user", "audio", c)], "assistant", "text") for c in cached
    ]
    text = Decoder(model, DecodeConfig(max_text_tokens=8)).text(asr_prompts)
    text_full = Decoder(model, DecodeConfig(max_text_tokens=8, use_cache=False)).text(asr_prompts)
    assert text == text_full and all(0 <= t < 60 for row in text for t in row)


def test_a_batch_decodes_like_each_row_alone(backbone):
    model, _, prompts = setup(backbone, "delay")
    cfg = DecodeConfig(max_frames=10, min_frames=2)
    together = Decoder(model, cfg).audio(prompts)
    alone = [
        Decoder(model, DecodeConfig(max_frames=10, min_frames=2)).audio([p])[0] for p in prompts
    ]
    assert [c.tolist() for c in together] == [c.tolist() for c in alone]


@pytest.mark.parametrize("pattern", ["delay", "parallel", "flatten"])
def test_generated_frames_follow_the_pattern(backbone, pattern):
    """The frames fed back are exactly the pattern's layout of the returned codes."""
    model, builder, prompts = setup(backbone, pattern)
    dec = Decoder(model, DecodeConfig(max_frames=7, min_frames=7))  # no early end: 7 frames
    codes = dec.audio(prompts[:1])[0]
    assert codes.shape == (7, 3)
    fed = dec.seqs[0][len(prompts[0]) :].numpy()  # (the last frame is never fed back)
    want = builder.pieces.audio(codes, False)[0]
    assert len(fed) == len(want) - 1 and np.array_equal(fed, want[: len(fed)])


def test_masks_never_admit_another_modality_or_stream():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        scores = torch.randn(3, 40, generator=g) * 5
        allowed = torch.rand(40, generator=g) < 0.2
        allowed[int(torch.randint(0, 40, (1,), generator=g))] = True
        s = Sampling(
            temperature=float(trial % 3), top_k=int(trial % 5), top_p=0.5 + (trial % 2) / 2
        )
        got = pick(scores, allowed, s, g)
        assert allowed[got].all()
    with pytest.raises(ValueError, match="nothing is allowed"):
        pick(torch.zeros(1, 4), torch.zeros(4, dtype=torch.bool), Sampling())


def test_sampled_audio_stays_in_each_streams_codebook(backbone):
    model, _, prompts = setup(backbone, "delay")
    cfg = DecodeConfig(audio=Sampling(temperature=1.5), max_frames=12, min_frames=4, seed=5)
    dec = Decoder(model, cfg)
    codes = dec.audio(prompts)
    lay = model.args.layout
    for c, seq, p in zip(codes, dec.seqs, prompts, strict=True):
        assert c.max() < 16
        fed = seq[len(p) :]
        for k in range(3):  # every token of stream k is its pad or a code of codebook k
            col = fed[:, k]
            ok = (col == lay.stream_pad(k)) | ((col >= lay.code(k, 0)) & (col < lay.code(k, 16)))
            if k == 0:
                ok |= torch.isin(col, torch.tensor([lay.special("<|eos|>")]))
            assert ok.all(), (k, col)


def test_index_map_matches_the_patterns():
    for name, frames in (("delay", 6), ("parallel", 4), ("flatten", 12)):
        m = index_map(get_pattern(name), 4, 3)
        assert m.shape == (frames, 3) and sorted(m[m >= 0].tolist()) == list(range(12))


def test_stop_ends_a_row_between_steps_and_the_others_run_on(backbone):
    """``stop(i)`` (a server's cancelled request): row 1 ends at the step it is asked to, its
    codes the leading frames of its undisturbed decode, and leaves the batch; row 0 is the
    same as without the stop; the text decoder stops a row the same way."""
    model, builder, prompts = setup(backbone, "delay")
    cfg = DecodeConfig(max_frames=10, min_frames=10)  # no early end: 10 frames each
    full = Decoder(model, cfg).audio(prompts)
    asked = []

    def stop(i: int) -> bool:
        asked.append(i)
        return i == 1 and asked.count(1) >= 4

    dec = Decoder(model, cfg, stop)
    cut = dec.audio(prompts)
    assert cut[0].tolist() == full[0].tolist() and len(full[1]) == 10
    assert 0 < len(cut[1]) < 10 and cut[1].tolist() == full[1][: len(cut[1])].tolist()
    assert asked.count(1) == 4 and asked.count(0) > 4  # row 1 was not asked again: it left
    assert dec.ended == [False, False]
    asr = [builder.prefix([Segment("user", "audio", c)], "assistant", "text") for c in full]
    whole = Decoder(model, DecodeConfig(max_text_tokens=8)).text(asr)
    ended = Decoder(model, DecodeConfig(max_text_tokens=8), lambda i: i == 0).text(asr)
    assert ended[1] == whole[1] and len(ended[0]) <= 1 and ended[0] == whole[0][: len(ended[0])]
