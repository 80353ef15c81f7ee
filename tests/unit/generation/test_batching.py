"""Batched decoding is one-at-a-time decoding: rows of different lengths that end at different
steps, every interleave pattern, with guidance, for audio and text; sampled rows with their own
seeds draw what they draw alone; a finished row leaves the batch."""

import numpy as np
import pytest
import torch

from tests.helpers import build_speechlm, save_tiny_backbone
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.data.template_pieces import Segment
from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder
from torchtitan_speechlm.generation.incremental import IncrementalForward
from torchtitan_speechlm.generation.sampling import Sampling

LENGTHS = (2, 11, 5, 15, 7)  # text tokens per prompt: unsorted, far apart


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    path = tmp_path_factory.mktemp("bb") / "bb"
    save_tiny_backbone(path, vocab_size=70, hidden_size=48, intermediate_size=96)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "llama"
    save_tiny_backbone(path, family="llama", vocab_size=70, hidden_size=48, intermediate_size=96)
    return path


def setup(backbone, pattern, streams=3, family="hf"):
    model = build_speechlm(
        backbone, num_streams=streams, codebook_size=8, pattern=pattern, init_seed=11,
        backbone=family,
    ).eval()  # fmt: skip
    with torch.no_grad():  # a trained-looking head: the end is chosen at varied steps
        model.head.stream_emb.weight.normal_(0, 0.7, generator=torch.Generator().manual_seed(1))
    lay = model.args.layout
    builder = TemplateBuilder(lay, pattern, LossWeights(1.0, 1.0, (1 / streams,) * streams))
    rng = np.random.default_rng(0)
    prompts = [
        builder.prefix([Segment("user", "text", rng.integers(3, 60, n))], "assistant", "audio")
        for n in LENGTHS
    ]
    drop = np.array([lay.special("<|cfg_drop|>") - lay.text_offset])
    uncond = [builder.prefix([Segment("user", "text", drop)], "assistant", "audio")] * len(LENGTHS)
    return model, builder, prompts, uncond


@pytest.mark.parametrize(
    "pattern,streams,cfg_scale",
    [("delay", 3, 1.0), ("parallel", 2, 1.0), ("parallel", 2, 1.5), ("flatten", 3, 1.5)],
)
def test_a_batch_of_audio_rows_decodes_like_each_row_alone(backbone, pattern, streams, cfg_scale):
    model, _, prompts, uncond = setup(backbone, pattern, streams)
    cfg = dict(max_frames=30, min_frames=2, cfg_scale=cfg_scale)
    guided = uncond if cfg_scale != 1.0 else None
    dec = Decoder(model, DecodeConfig(**cfg))
    together = dec.audio(prompts, guided)
    alone, ended = [], []
    for i, p in enumerate(prompts):
        one = Decoder(model, DecodeConfig(**cfg))
        alone.append(one.audio([p], None if guided is None else guided[i : i + 1])[0])
        ended += one.ended
    assert [c.tolist() for c in together] == [c.tolist() for c in alone]
    assert dec.ended == ended
    assert len({len(c) for c in together}) > 1, "rows ending together prove little"


@pytest.mark.parametrize("family", ["hf", "native", "qwen3"])
def test_finished_rows_leave_the_batch_on_every_backbone(backbone, llama_dir, family, monkeypatch):
    """The rows fed to the model shrink as rows end (their cache rows dropped), and the tokens
    stay those of each row alone: on transformers' cache and on the static one."""
    path = llama_dir if family == "native" else backbone  # (a Qwen3 config: hf and qwen3)
    model, _, prompts, _ = setup(path, "delay", 3, family)
    fed = []
    real = IncrementalForward.advance

    def counting(self, frames):
        fed.append(len(frames))
        return real(self, frames)

    monkeypatch.setattr(IncrementalForward, "advance", counting)
    cfg = dict(max_frames=30, min_frames=2)
    together = Decoder(model, DecodeConfig(**cfg)).audio(prompts)
    lengths = sorted({len(c) for c in together})
    assert len(lengths) > 1, "rows ending together prove little"
    assert fed == sorted(fed, reverse=True) and fed[0] == len(prompts) and fed[-1] < len(prompts)
    monkeypatch.setattr(IncrementalForward, "advance", real)
    alone = [Decoder(model, DecodeConfig(**cfg)).audio([p])[0] for p in prompts]
    assert [c.tolist() for c in together] == [c.tolist() for c in alone]


def test_a_batch_of_text_rows_decodes_like_each_row_alone(backbone):
    model, builder, prompts, _ = setup(backbone, "delay")
    codes = Decoder(model, DecodeConfig(max_frames=14, min_frames=2)).audio(prompts)
    asr = [builder.prefix([Segment("user", "audio", c)], "assistant", "text") for c in codes]
    cfg = DecodeConfig(max_text_tokens=40)
    together = Decoder(model, cfg).text(asr)
    alone = [Decoder(model, DecodeConfig(max_text_tokens=40)).text([p])[0] for p in asr]
    assert together == alone
    assert len({len(t) for t in together}) > 1


def test_sampled_rows_draw_from_their_own_seed(backbone):
    """Row i with seed s_i draws the same beside any others as alone with seed s_i; two rows
    of one prompt with other seeds differ."""
    model, _, prompts, _ = setup(backbone, "delay")
    cfg = DecodeConfig(audio=Sampling(temperature=1.0, top_k=5), max_frames=12, min_frames=3)
    seeds = [7, 3, 7, 100, 5]
    together = Decoder(model, cfg).audio(prompts, seeds=seeds)
    for i in (0, 3):
        alone = Decoder(model, cfg).audio([prompts[i]], seeds=[seeds[i]])[0]
        assert together[i].tolist() == alone.tolist()
    reordered = Decoder(model, cfg).audio(prompts[::-1], seeds=seeds[::-1])
    assert [c.tolist() for c in reordered[::-1]] == [c.tolist() for c in together]
    twins = Decoder(model, cfg).audio([prompts[1]] * 2, seeds=[1, 2])
    assert twins[0].tolist() != twins[1].tolist()
    with pytest.raises(ValueError, match="2 seeds for 5 prompts"):
        Decoder(model, cfg).audio(prompts, seeds=[1, 2])


def test_streamed_frames_are_the_returned_codes_as_they_complete(backbone):
    """``on_frames`` hands each row its complete frames, growing, ending with all of them; with
    the delay pattern frame f is complete ``streams - 1`` steps after it starts."""
    model, _, prompts, _ = setup(backbone, "delay", streams=4)
    seen: dict[int, list[np.ndarray]] = {}
    dec = Decoder(model, DecodeConfig(max_frames=14, min_frames=2))
    codes = dec.audio(prompts, on_frames=lambda i, c: seen.setdefault(i, []).append(c.copy()))
    for i, c in enumerate(codes):
        calls = seen[i]
        assert [len(x) for x in calls] == sorted({len(x) for x in calls})  # strictly growing
        assert np.array_equal(calls[-1], c)
        assert all(np.array_equal(x, c[: len(x)]) for x in calls)
    first = [len(seen[i][0]) for i in seen]  # the first call: frame 0 done, at step 3
    assert first == [1] * len(codes)


@pytest.mark.parametrize(
    "family,pattern,streams,cfg_scale,temperature",
    [
        ("hf", "delay", 3, 1.0, 0.0),
        ("native", "delay", 3, 1.0, 0.0),
        ("qwen3", "parallel", 2, 1.5, 0.0),
        ("hf", "flatten", 3, 1.5, 1.0),
    ],
)
def test_rows_that_join_a_batch_in_progress_decode_like_each_row_alone(
    backbone, llama_dir, family, pattern, streams, cfg_scale, temperature
):
    """Continuous batching (a server's: serving/batcher.py): rows joining between steps, one
    with a prompt shorter than the batch's and one longer (the caches left-padded to each
    other), with and without guidance, greedy and sampled (a joiner's own seed), give each row's
    codes alone; ``on_done`` reports each row once, at the step it completes, with its codes."""
    from torchtitan_speechlm.generation.decode import Joining

    path = llama_dir if family == "native" else backbone
    model, _, prompts, uncond = setup(path, pattern, streams, family)
    guided = cfg_scale != 1.0
    cfg = DecodeConfig(
        audio=Sampling(temperature=temperature, top_k=5), max_frames=30, min_frames=2,
        cfg_scale=cfg_scale,
    )  # fmt: skip
    seeds = [4, 8, 15, 16, 23]
    arrivals = {1: [2], 3: [3, 4]}  # after step s, these prompts join (5 is 2 tokens, 15 is 15)
    steps, done, asked = [0], {}, []

    def join(live):
        asked.append(live)
        steps[0] += 1
        return [
            Joining(prompts[i], uncond[i] if guided else None, seeds[i])
            for i in arrivals.get(steps[0], [])
        ]

    def on_done(i, codes, ended):
        assert i not in done, f"row {i} reported twice"
        done[i] = (steps[0], codes.copy(), ended)

    dec = Decoder(model, cfg)
    first = [0, 1]  # 2 and 11 text tokens
    together = dec.audio(
        [prompts[i] for i in first], [uncond[i] for i in first] if guided else None,
        seeds=[seeds[i] for i in first], join=join, on_done=on_done,
    )  # fmt: skip
    assert len(together) == 5 and sorted(done) == [0, 1, 2, 3, 4]
    order = first + arrivals[1] + arrivals[3]  # the decoder's rows: started, then joined
    for row, i in enumerate(order):
        one = Decoder(model, cfg)
        alone = one.audio([prompts[i]], [uncond[i]] if guided else None, seeds=[seeds[i]])[0]
        assert together[row].tolist() == alone.tolist(), f"prompt {i} (row {row})"
        assert done[row][1].tolist() == alone.tolist() and done[row][2] == one.ended[0]
    assert dec.ended == [done[r][2] for r in range(5)]
    finished = sorted(done[r][0] for r in range(5))
    assert finished[0] < finished[-1], "rows reported at the batch's end only"
    assert asked[0] == 2 and max(asked) >= 3  # the live rows, joiners counted


def test_a_row_that_joins_no_batch_when_the_cache_cannot_take_it(backbone, monkeypatch):
    """A compiled step (fixed shapes) or a backbone that cannot join caches is never asked for
    joiners: what would join waits for the next batch."""
    model, _, prompts, _ = setup(backbone, "delay")
    monkeypatch.setattr(model.family, "can_join", lambda cache: False)
    asked = []
    Decoder(model, DecodeConfig(max_frames=6, min_frames=6)).audio(
        prompts[:2], join=lambda live: asked.append(live) or []
    )
    assert asked == []


@pytest.mark.parametrize("family", ["hf", "native"])
def test_a_continuous_batch_keeps_its_cache_as_long_as_its_oldest_row_not_its_age(
    backbone, llama_dir, family
):
    """Rows joining every other step for 80 steps, each 6 frames long: the rows that joined
    late are padded back to the first row's start, and that padding goes once the rows before
    them have left, so the cache (and each step's attention) stays about a prompt and a row
    long; every row is still its alone codes, and each row's state is let go when reported."""
    from torchtitan_speechlm.generation.decode import Joining

    path = llama_dir if family == "native" else backbone
    model, _, prompts, _ = setup(path, "delay", 3, family)
    cfg = DecodeConfig(max_frames=6, min_frames=6)
    steps, widths, order = [0], [], [0]
    dec = Decoder(model, cfg)

    def join(live):
        steps[0] += 1
        widths.append(dec.forward.mask.shape[1])
        if steps[0] > 80 or steps[0] % 2:
            return []
        order.append(steps[0] // 2 % len(prompts))
        return [Joining(prompts[order[-1]])]

    together = dec.audio([prompts[0]], join=join, on_done=lambda i, codes, ended: None)
    assert len(together) == 41 and steps[0] > 80
    alone = {i: Decoder(model, cfg).audio([prompts[i]])[0].tolist() for i in set(order)}
    assert [c.tolist() for c in together] == [alone[i] for i in order]
    longest = max(len(p) for p in prompts) + 3 * cfg.max_frames  # the first row's 24 + 2 steps
    assert max(widths) <= longest + 32, widths  # (a trim waits for 16 slots and half the width)
    assert widths[-1] < 2 * longest and max(widths) < 80, "the cache grew with the batch's age"
