"""The speaker-prompted TTS task (tts_prompt): the prompt draw (same speaker, never the item
itself, within the split, a pure function of the seed, resumable), the length budget from the
index, and the unprompted fallback of a speaker with one utterance, counted."""

import logging
import pickle

import numpy as np
import pytest

from tests.fake_stream import LAYOUT, FakePrepared, make
from torchtitan_speechlm.data.collation import batch_hash
from torchtitan_speechlm.data.mixing import Source
from torchtitan_speechlm.data.planner import Draw
from torchtitan_speechlm.data.speaker_prompts import SpeakerPromptError, SpeakerPrompts
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.data.template_pieces import Segment

PROMPT = 40  # codec frames a prompt is cut to


def prompted(n=60, speakers=7, **kw):
    return make(
        data=FakePrepared(n=n, speakers=speakers),
        tasks=("tts_prompt", "asr"),
        prompt_frames=PROMPT,
        **kw,
    )


def draws(ds, n_plans=12):
    out = []
    for plan, _ in zip(ds.plans(), range(n_plans), strict=False):
        out += [d for row in plan.unit.rows for d in row]
    return out


def test_a_prompt_is_another_utterance_of_the_same_speaker():
    ds = prompted()
    data = ds.sources[0].data
    seen = [d for d in draws(ds) if d.src == 0]
    assert seen and all(d.prompt >= 0 for d in seen)
    for d in seen:
        assert d.prompt != d.item
        assert data.item_speakers[d.prompt] == data.item_speakers[d.item]
    assert all(d.prompt == -1 for d in draws(ds) if d.src == 1)  # asr: no prompt


def test_prompts_are_drawn_within_the_split():
    data = FakePrepared(n=60, speakers=5)
    train = np.arange(0, 60, 2)  # the hold-out by id hash splits a speaker's items too
    prompts = SpeakerPrompts([Source("tts_prompt", "fake", 1.0, data, train)], seed=3)
    for item in train:
        for epoch in range(4):
            p = prompts.draw(0, int(item), epoch, 0)
            assert p in set(train.tolist()) and p != item
            assert data.item_speakers[p] == data.item_speakers[item]
        cands = prompts.candidates(0, int(item))
        assert set(cands.tolist()) == {int(i) for i in train if i != item and i % 5 == item % 5}


def test_the_draw_is_a_function_of_the_seed_and_varies_over_epochs():
    data = FakePrepared(n=60, speakers=4)
    src = [Source("tts_prompt", "fake", 1.0, data, np.arange(60))]
    a, b, c = SpeakerPrompts(src, 3), SpeakerPrompts(src, 3), SpeakerPrompts(src, 4)
    grid = [(i, e, s) for i in range(60) for e in range(3) for s in range(2)]
    assert [a.draw(0, *g) for g in grid] == [b.draw(0, *g) for g in grid]
    assert [a.draw(0, *g) for g in grid] != [c.draw(0, *g) for g in grid]
    assert len({a.draw(0, 5, e, 0) for e in range(20)}) > 1  # new prompts each epoch
    # the stream seeded alike draws the same samples and prompts
    assert [d.as_tuple() for d in draws(prompted())] == [d.as_tuple() for d in draws(prompted())]
    assert [d.prompt for d in draws(prompted())] != [d.prompt for d in draws(prompted(seed=4))]


@pytest.mark.parametrize("mode", ["pack", "bucket"])
def test_the_length_budget_counts_the_prompt_and_matches_the_built_example(mode):
    ds = prompted(mode=mode)
    s = ds.sources[0]
    for d in draws(ds):
        task = ds.sources[d.src].task
        prompt = s.data[d.prompt] if d.prompt >= 0 else None
        ex = ds.builder.build(task, s.data[d.item], d.cfg_drop, prompt)
        assert len(ex.frames) == d.length
    # the planned length of a prompted draw is the unprompted (tts) length plus the prompt's
    d = next(d for d in draws(ds) if d.src == 0)
    tts = ds.builder.length(
        "tts", int(s.data.text_lengths[d.item]), int(s.data.audio_lengths[d.item])
    )
    cut = min(PROMPT, int(s.data.audio_lengths[d.prompt]))
    assert d.length == tts + 3 + cut + LAYOUT.num_streams - 1
    # lengths(): with the longest prompt an item can draw (an upper bound of every draw)
    bound = dict(zip(s.indices.tolist(), ds.lengths(0).tolist(), strict=True))
    assert all(d.length <= bound[d.item] for d in draws(ds) if d.src == 0)


def test_the_prompt_turn_is_the_prompt_s_codes_cut_in_the_user_turn():
    builder = TemplateBuilder(
        LAYOUT, "delay", LossWeights(1.0, 1.0, (0.5, 0.25, 0.25)), max_prompt_frames=PROMPT
    )
    data = FakePrepared(n=8, speakers=2)
    item, prompt = data[0], data[2]
    segs = builder.segments("tts_prompt", item, prompt=prompt)
    assert [(g.role, g.modality) for g in segs] == [
        ("user", "audio"),
        ("user", "text"),
        ("assistant", "audio"),
    ]
    assert np.array_equal(segs[0].tokens, prompt.audio_codes[:PROMPT])
    ex = builder.build("tts_prompt", item, prompt=prompt)
    # the prompt carries no loss; generation's prefix is the example's frames up to the audio
    prefix = builder.prefix(segs[:2], "assistant", "audio")
    assert np.array_equal(ex.frames[: len(prefix)], prefix)
    assert ex.weights[: len(prefix) - 1].sum() == 0
    drop = builder.build("tts_prompt", item, cfg_drop=True, prompt=prompt)
    n_text = len(item.text_tokens)
    assert len(drop.frames) == len(ex.frames) - n_text + 1  # CFG drops the text, not the prompt
    assert np.array_equal(
        drop.frames[: len(prefix) - n_text - 4], prefix[: len(prefix) - n_text - 4]
    )
    with pytest.raises(ValueError, match="prompt_seconds"):
        TemplateBuilder(LAYOUT, "delay", LossWeights(1.0, 1.0, (0.5, 0.25, 0.25))).build(
            "tts_prompt", item, prompt=prompt
        )


def test_a_speaker_with_one_utterance_trains_unprompted_and_is_counted(caplog):
    data = FakePrepared(n=40, speakers=3)
    data.item_speakers = data.item_speakers.copy()
    data.item_speakers[7] = 3  # speaker 3 has one utterance
    with caplog.at_level(logging.WARNING):
        ds = make(data=data, tasks=("tts_prompt",), prompt_frames=PROMPT)
    assert ds.prompts.unprompted == {0: 1}
    assert "1 of 40 items have no other utterance of their speaker" in caplog.text
    assert ds.prompts.draw(0, 7, 0, 0) == -1
    alone = [d for d in draws(ds, 40) if d.item == 7]
    assert alone and all(d.prompt == -1 for d in alone)
    assert all(d.prompt >= 0 for d in draws(ds, 40) if d.item != 7)
    # its example is exactly tts's, and so is its length
    b = ds.builder
    ex, tts = b.build("tts_prompt", data[7]), b.build("tts", data[7])
    assert np.array_equal(ex.frames, tts.frames) and np.array_equal(ex.weights, tts.weights)
    assert alone[0].length == len(tts.frames)


def test_a_dataset_without_speakers_is_refused_with_the_fix():
    with pytest.raises(SpeakerPromptError, match="names no speakers"):
        make(data=FakePrepared(), tasks=("tts_prompt",), prompt_frames=PROMPT)


def test_a_carried_prompted_draw_survives_a_saved_state():
    d = Draw(0, 5, False, 99, 1, prompt=12)
    assert Draw(*d.as_tuple()) == d and Draw(*d.aged().as_tuple()).prompt == 12
    assert Draw(0, 5, False, 99).as_tuple() == (0, 5, False, 99, 0)  # unprompted: as before
    ds = prompted(window=16)
    it = iter(ds)
    full = [batch_hash(next(it)[0]) for _ in range(10)]
    ds2 = prompted(window=16)
    it2 = iter(ds2)
    for _ in range(4):
        next(it2)
    state = pickle.loads(pickle.dumps(ds2.state_dict()))
    resumed = prompted(window=16)
    resumed.load_state_dict(state)
    it3 = iter(resumed)
    assert [batch_hash(next(it3)[0]) for _ in range(6)] == full[4:]


def test_generation_prefix_with_a_prompt_is_the_training_layout():
    builder = TemplateBuilder(
        LAYOUT, "delay", LossWeights(1.0, 1.0, (0.5, 0.25, 0.25)), max_prompt_frames=PROMPT
    )
    data = FakePrepared(n=4, speakers=2)
    long = np.zeros((PROMPT + 30, LAYOUT.num_streams), dtype=np.int64)
    assert len(builder.cut_prompt(long)) == PROMPT
    segs = [
        Segment("user", "audio", builder.cut_prompt(data[1].audio_codes)),
        Segment("user", "text", data[3].text_tokens),
    ]
    ex = builder.build("tts_prompt", data[3], prompt=data[1])
    prefix = builder.prefix(segs, "assistant", "audio")
    assert np.array_equal(ex.frames[: len(prefix)], prefix)
