"""The stream's settings are refused where the stream is built, naming the key and the fix;
the shards of a step are split over ranks and micro-batches without overlap; the weighted draw
is ``Generator.choice`` without its per-call cost."""

import numpy as np
import pytest

from tests.fake_stream import FakePrepared, make
from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.mixing import AllItems, Mixture, Source, is_identity
from torchtitan_speechlm.data.shards import ShardLayout
from torchtitan_speechlm.data.stream import SpeechLMDataset


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(seq_len=7), r"^training\.seq_len \(frames per row\) must be >= 8$"),
        (dict(mode="bucket", max_tokens=100), "max_tokens = 100 is below training.seq_len = 256"),
        (dict(cfg=1.0), r"^speechlm_data\.cfg_dropout must be in \[0, 1\)$"),
        (dict(cfg=-0.1), r"^speechlm_data\.cfg_dropout must be in \[0, 1\)$"),
        (dict(window=0), r"^speechlm_data\.window must be >= 1$"),
        (dict(mode="rows"), r"speechlm_data\.batching must be one of \('pack', 'bucket'\)"),
    ],
)
def test_out_of_range_settings_are_refused_with_the_key(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make(**kwargs)


def test_a_max_tokens_budget_with_pack_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as e:
        make(mode="pack", max_tokens=2048)
    assert str(e.value) == (
        'speechlm_data.max_tokens = 2048 applies to batching = "bucket" only; with "pack" a '
        "micro-batch is training.local_batch_size rows of training.seq_len frames: set "
        "training.local_batch_size instead and remove max_tokens"
    )


@pytest.mark.parametrize("fraction", [-0.01, 1.5])
def test_the_too_long_fraction_is_a_fraction(fraction):
    ds = make()
    kw = dict(local_batch_size=2, mode="pack", window=8, dp_rank=0, dp_world_size=1, seed=0)
    with pytest.raises(ConfigError, match=r"max_too_long_fraction must be in \[0, 1\]"):
        SpeechLMDataset(
            ds.sources, ds.builder, seq_len=256, shuffle=True, infinite=True,
            max_too_long_fraction=fraction, **kw,
        )  # fmt: skip


def test_a_validation_stream_names_its_own_seq_len_key():
    ds = make()
    with pytest.raises(ConfigError, match="is below validation.seq_len = 512"):
        SpeechLMDataset(
            ds.sources, ds.builder, seq_len=512, local_batch_size=2, mode="bucket", window=8,
            dp_rank=0, dp_world_size=1, seed=0, shuffle=False, infinite=False, max_tokens=300,
            seq_len_key="validation.seq_len",
        )  # fmt: skip


@pytest.mark.parametrize("mode,rows", [("pack", 3), ("bucket", 3)])
@pytest.mark.parametrize("world,accum", [(1, 4), (2, 2), (4, 1), (3, 2)])
def test_every_shard_of_a_step_belongs_to_exactly_one_micro_batch(mode, rows, world, accum):
    layouts = [ShardLayout(mode, rows, r, world, accum) for r in range(world)]
    step = layouts[0].step_pieces
    assert step == (rows if mode == "pack" else 1) * world * accum
    owned = [j for lay in layouts for j in lay.own_shards()]
    assert sorted(owned) == list(range(step))  # each shard once, over all ranks
    for lay in layouts:
        for m in range(accum):  # micro-batch m of rank r is slice m * world + r of the step
            i = m * world + lay.dp_rank
            per = rows if mode == "pack" else 1
            assert lay.slice_shards(m) == list(range(i * per, (i + 1) * per))
            assert lay.slice_shards(m) == layouts[0].slice_shards(m, lay.dp_rank)


def test_the_weighted_draw_is_generator_choice():
    data = FakePrepared(n=40)
    weights = [0.5, 0.2, 0.25, 0.05]
    tasks = ("tts", "asr", "tts", "asr")
    sources = [Source(t, "s", w, data, np.arange(40)) for t, w in zip(tasks, weights, strict=True)]
    mix = Mixture(
        sources, step_pieces=4, seed=1, shuffle=True, infinite=True, cfg_dropout=0.0,
        length=lambda src, item, drop: 10, order="permutation",
    )  # fmt: skip
    epoch, pos = [0] * 4, [0] * 4
    rng, ref = np.random.default_rng(9), np.random.default_rng(9)
    drawn = [mix.draw(epoch, pos, rng, shard=2).src for _ in range(500)]
    p = np.array(weights) / sum(weights)
    assert drawn == [int(ref.choice(4, p=p)) for _ in range(500)]
    assert sum(pos) + 10 * sum(epoch) == 500  # each draw took the next item of its source


def test_a_finite_pass_takes_each_source_share_once_in_order():
    data = FakePrepared(n=10)
    sources = [Source(t, "s", 1.0, data, np.arange(10)) for t in ("tts", "asr")]
    mix = Mixture(
        sources, step_pieces=3, seed=0, shuffle=False, infinite=False, cfg_dropout=0.0,
        length=lambda src, item, drop: 10, order="permutation",
    )  # fmt: skip
    epoch, pos, rng = [0, 0], [0, 0], np.random.default_rng(0)
    got = []
    while (d := mix.draw(epoch, pos, rng, shard=1)) is not None:
        got.append((d.src, d.item))
    assert got == [(0, 1), (0, 4), (0, 7), (1, 1), (1, 4), (1, 7)]  # every 3rd item from 1


def test_all_items_and_warmed_orders_walk_as_the_plain_arrays():
    """A source of every item as ``AllItems`` (no array) and epoch orders computed ahead by
    ``warm`` (threads) give every shard the items the plain int arrays and lazy orders give,
    epoch after epoch; a source with a hold-out (a gather of its items) too."""
    data = FakePrepared(n=50)
    held = np.array([i for i in range(50) if i % 7])  # a hold-out: not every item

    def mixture(all_items: bool, own):
        idx = AllItems(50) if all_items else np.arange(50)
        sources = [Source("tts", "a", 0.6, data, idx), Source("asr", "a", 0.3, data, idx),
                   Source("asr", "b", 0.1, data, held)]  # fmt: skip
        return Mixture(sources, step_pieces=4, seed=3, shuffle=True, infinite=True,
                       cfg_dropout=0.0, length=lambda src, item, drop: 10, own_shards=own,
                       order="permutation")  # fmt: skip

    plain = mixture(False, None)
    for own in ([1, 3], None):
        new = mixture(True, own)
        new.warm({(0, 0), (1, 0), (2, 0), (0, 1)})
        for shard in own or range(4):
            for src in range(3):
                for epoch in range(3):
                    want = plain.perm(src, epoch, shard)
                    got = new.perm(src, epoch, shard)
                    assert got.tolist() == want.tolist(), (own, shard, src, epoch)
    assert is_identity(AllItems(5)) and is_identity(np.arange(5)) and not is_identity(held)
    assert AllItems(5)[1:4].tolist() == [1, 2, 3] and np.asarray(AllItems(5)).dtype == np.int32
