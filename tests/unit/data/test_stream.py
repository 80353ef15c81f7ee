"""The data stream: packing, document boundaries, rank invariance, exact resume, bad samples."""

import pickle

import numpy as np
import pytest
import torch

from tests.fake_stream import CODEBOOK, LAYOUT, N_STREAMS, TEXT, FakePrepared, Item, make
from torchtitan_speechlm.components.dataloader import SpeechLMDataLoader
from torchtitan_speechlm.data.collation import batch_hash
from torchtitan_speechlm.data.mixing import Source
from torchtitan_speechlm.data.position import merge_positions
from torchtitan_speechlm.data.stream import SpeechLMDataset
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.model.vocab import VocabLayout


def take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def stat(ds, batch, key):
    return batch[0]["data_stats"][0, ds.stats_keys.index(key)].item()


@pytest.mark.parametrize("mode", ["pack", "bucket"])
def test_samples_never_cross_row_boundaries(mode):
    ds = make(mode=mode)
    bos = LAYOUT.special("<|bos|>")
    for batch, labels in take(ds, 6):
        inp, tgt, pos, w = (batch[k] for k in ("input", "targets", "position_ids", "loss_weights"))
        assert inp.shape[1] <= 256 and inp.shape[-1] == N_STREAMS
        for r in range(inp.shape[0]):
            starts = (pos[r] == 0).nonzero().flatten().tolist() + [inp.shape[1]]
            for a, b in zip(starts, starts[1:], strict=False):
                if inp[r, a, 0] != bos:  # padding "document": no loss at all
                    assert w[r, a:b].sum() == 0
                    continue
                # within a sample the target is the next input frame: no cross-sample target
                assert torch.equal(tgt[r, a : b - 1], inp[r, a + 1 : b])
                assert torch.equal(pos[r, a:b], torch.arange(b - a))
        assert torch.equal(labels != -100, (w > 0).any(-1))


@pytest.mark.parametrize("mode", ["pack", "bucket"])
def test_a_finite_pass_yields_every_item_once(mode):
    data = FakePrepared(n=200)
    ds = make(mode=mode, infinite=False, data=data, seq_len=512, window=64)
    batches = list(iter(ds))
    assert sum(stat(ds, b, "examples") for b in batches) == 2 * len(data)
    bos = LAYOUT.special("<|bos|>")
    assert sum(int((b[0]["input"][..., 0] == bos).sum()) for b in batches) == 2 * len(data)


def test_pack_padding_is_below_bucket_padding():
    ratios = {}
    for mode in ("pack", "bucket"):
        ds = make(mode=mode, data=FakePrepared(n=200), seq_len=512, window=64)
        batches = take(ds, 30)
        pad = sum(stat(ds, b, "pad_frames") for b in batches)
        frames = sum(stat(ds, b, "frames") for b in batches)
        ratios[mode] = pad / (pad + frames)
    assert ratios["pack"] < 0.02 and ratios["pack"] < ratios["bucket"]


def test_one_rank_and_two_ranks_see_the_same_global_batches():
    one = take(make(world=1, rows=4), 8)
    two = [take(make(world=2, rank=r, rows=2), 8) for r in (0, 1)]
    for g in range(8):
        for key in ("input", "targets", "loss_weights", "position_ids"):
            joined = torch.cat([two[0][g][0][key], two[1][g][0][key]])
            assert torch.equal(one[g][0][key], joined), (g, key)


PROMPTED = {"tasks": ("tts_prompt", "asr"), "prompt_frames": 40}


@pytest.mark.parametrize("kw", [{}, PROMPTED], ids=["tts+asr", "tts_prompt+asr"])
def test_resume_yields_the_same_micro_batches(kw):
    def data():  # tts_prompt: speaker-prompted items, the prompts drawn by the stream
        return FakePrepared(speakers=7) if kw else None

    full = [batch_hash(b[0]) for b in take(make(data=data(), **kw), 12)]
    ds = make(data=data(), **kw)
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = ds.state_dict()
    resumed = make(data=data(), **kw)
    resumed.load_state_dict(state)
    assert [batch_hash(b[0]) for b in take(resumed, 7)] == full[5:]


def test_resume_with_loader_workers():
    def loader(ds):
        return SpeechLMDataLoader(ds, dp_rank=0, dp_world_size=1, batch_size=None, num_workers=2)

    full = [batch_hash(b[0]) for _, b in zip(range(10), loader(make()), strict=False)]
    dl = loader(make())
    it = iter(dl)
    for _ in range(4):
        next(it)
    state = dl.state_dict()
    dl2 = loader(make())
    dl2.load_state_dict(state)
    assert [batch_hash(b[0]) for _, b in zip(range(6), dl2, strict=False)] == full[4:]


def test_resume_on_another_data_parallel_degree_continues_the_stream():
    two = [make(world=2, rank=r, rows=2) for r in (0, 1)]
    its = [iter(d) for d in two]
    for _ in range(3):
        for it in its:
            next(it)
    expected = [torch.cat([next(its[0])[0]["input"], next(its[1])[0]["input"]]) for _ in range(4)]
    one = make(world=1, rows=4)
    ranks = [make(world=2, rank=r, rows=2) for r in (0, 1)]
    for d in ranks:
        it = iter(d)
        for _ in range(3):
            next(it)
    with pytest.raises(ValueError, match=r"lacks shards \[2, 3\]"):
        one.load_state_dict(ranks[0].state_dict())  # rank 0 alone knows shards 0 and 1
    positions = [d.state_dict()["position"] for d in ranks]
    one.load_state_dict(dict(ranks[0].state_dict(), position=merge_positions(positions)))
    got = [b[0]["input"] for b in take(one, 4)]
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_too_long_and_bad_samples_are_skipped_and_counted():
    data = FakePrepared(n=40, bad={3, 7})
    ds = make(data=data, infinite=False, seq_len=120, window=16)
    batches = list(iter(ds))
    too_long = sum(stat(ds, b, "skipped_too_long") for b in batches)
    bad = sum(stat(ds, b, "skipped_bad") for b in batches)
    examples = sum(stat(ds, b, "examples") for b in batches)
    lengths = [ds.lengths_table.length(0, i, False) for i in range(40)] + [
        ds.lengths_table.length(1, i, False) for i in range(40)
    ]
    n_long = sum(length - 1 > 120 for length in lengths)
    assert too_long == n_long > 0
    assert bad == sum(
        1 for s in (0, 1) for i in (3, 7) if ds.lengths_table.length(s, i, False) - 1 <= 120
    )
    assert examples + too_long + bad == 80


def test_cfg_dropout_is_deterministic_and_training_only():
    a = take(make(cfg=0.5), 6)
    b = take(make(cfg=0.5), 6)
    assert [batch_hash(x[0]) for x in a] == [batch_hash(x[0]) for x in b]
    dropped = sum(stat(make(cfg=0.5), x, "cfg_dropped") for x in a)
    assert dropped > 0
    drop_id = LAYOUT.special("<|cfg_drop|>")
    assert any((x[0]["input"][..., 0] == drop_id).any() for x in a)
    val = list(iter(make(cfg=0.5, infinite=False)))
    assert not any((x[0]["input"][..., 0] == drop_id).any() for x in val)


def test_loss_region_all_weights_user_turns_too():
    item = FakePrepared()[0]
    b_asst = TemplateBuilder(LAYOUT, "delay", LossWeights(1.0, 1.0, (0.5, 0.25, 0.25)))
    b_all = TemplateBuilder(LAYOUT, "delay", LossWeights(1.0, 1.0, (0.5, 0.25, 0.25)), "all")
    ex_a, ex_b = b_asst.build("tts", item), b_all.build("tts", item)
    assert np.array_equal(ex_a.frames, ex_b.frames)
    text_end = 3 + len(item.text_tokens)
    assert ex_a.weights[:text_end].sum() == 0 and ex_b.weights[1:text_end, 0].min() == 1.0
    # audio targets: stream weights; delay pads carry no loss, except stream 0's first pad
    # after codebook 0's last code (where generation ends codebook 0)
    pads = np.array([LAYOUT.stream_pad(k) for k in range(N_STREAMS)])
    padded = ex_a.frames == pads
    end = text_end + 3 + len(item.audio_codes)  # <eot><assistant><audio>, F codes of stream 0
    assert padded[end, 0] and ex_a.weights[end, 0] == 0.5  # stream 0's weight
    padded[end, 0] = False
    assert (ex_a.weights[padded] == 0).all()
    assert len(ex_a.frames) == b_asst.length("tts", len(item.text_tokens), len(item.audio_codes))


def test_packed_row_logits_equal_each_sample_run_alone(tmp_path):
    """Document masking: in a packed row, every sample sees only itself (CPU, sdpa)."""
    from tests.helpers import build_speechlm, save_tiny_backbone

    save_tiny_backbone(tmp_path / "bb", vocab_size=TEXT)
    model = build_speechlm(tmp_path / "bb", num_streams=N_STREAMS, codebook_size=CODEBOOK).eval()
    ds = make(rows=1, seq_len=256)
    batch, _ = next(iter(ds))
    inp, pos = batch["input"], batch["position_ids"]
    starts = (pos[0] == 0).nonzero().flatten().tolist()
    assert len(starts) >= 3, "need a row with several samples"
    with torch.no_grad():
        packed = model.logits(inp, position_ids=pos)
        for a, b in zip(starts, starts[1:] + [inp.shape[1]], strict=True):
            alone = model.logits(inp[:, a:b])
            for k in range(N_STREAMS):
                torch.testing.assert_close(packed[k][:, a:b], alone[k], atol=1e-5, rtol=1e-5)


def test_dialogue_template_loss_on_assistant_turns_and_length_from_index():
    from torchtitan_speechlm.data.format import Turn

    rng = np.random.default_rng(0)
    turns = [
        Turn("system", "text", rng.integers(0, TEXT, 4), ""),
        Turn("user", "audio", rng.integers(0, CODEBOOK, (7, N_STREAMS)), ""),
        Turn("assistant", "text", rng.integers(0, TEXT, 5), ""),
        Turn("user", "text", rng.integers(0, TEXT, 3), ""),
        Turn("assistant", "audio", rng.integers(0, CODEBOOK, (6, N_STREAMS)), ""),
    ]
    item = Item("d0", "", np.zeros(0, np.int64), np.zeros((0, N_STREAMS), np.int64), 1.0, turns)
    builder = TemplateBuilder(LAYOUT, "delay", LossWeights(1.0, 1.0, (0.5, 0.25, 0.25)))
    ex = builder.build("dialogue", item)
    sp = LAYOUT.special
    tags = [int(t) for t in ex.frames[:, 0] if t < LAYOUT.text_offset]
    assert tags[:1] == [sp("<|bos|>")] and tags[-1] == sp("<|eos|>")
    assert tags.count(sp("<|assistant|>")) == 2 and tags.count(sp("<|eot|>")) == 4
    # loss only inside the two assistant turns: from their modality tag through <eot>/<eos>
    carrying = np.nonzero(ex.weights.sum(1) > 0)[0]
    starts = [i for i, t in enumerate(ex.frames[:, 0]) if t == sp("<|assistant|>")]
    assert carrying.min() == starts[0] + 1 and carrying.max() == len(ex.frames) - 1
    user2 = [i for i, t in enumerate(ex.frames[:, 0]) if t == sp("<|user|>")][1]
    assert ex.weights[user2 : starts[1] + 1].sum() == 0
    n_text = sum(len(t.tokens) for t in turns if t.modality == "text")
    n_audio = sum(len(t.tokens) for t in turns if t.modality == "audio")
    assert len(ex.frames) == builder.length("dialogue", n_text, n_audio, n_audio_turns=2, n_turns=5)


def test_bucket_units_respect_the_token_budget():
    ds = make(mode="bucket", rows=4, seq_len=256)
    for batch, _ in take(ds, 10):
        b, t = batch["input"].shape[:2]
        assert b * t <= 4 * 256 and t % 8 == 0


def test_mixture_follows_the_weights_and_is_seeded():
    data = FakePrepared(n=100)
    builder = TemplateBuilder(LAYOUT, "delay", LossWeights(1.0, 1.0, (0.5, 0.25, 0.25)))
    sources = [
        Source("tts", "a", 3.0, data, np.arange(100)),
        Source("asr", "b", 1.0, data, np.arange(100)),
    ]
    ds = SpeechLMDataset(
        sources,
        builder,
        seq_len=512,
        local_batch_size=4,
        mode="pack",
        window=64,
        dp_rank=0,
        dp_world_size=1,
        seed=5,
        shuffle=True,
        infinite=True,
    )
    batches = take(ds, 40)
    tts = sum(stat(ds, b, "task_tts") for b in batches)
    asr = sum(stat(ds, b, "task_asr") for b in batches)
    assert 0.68 < tts / (tts + asr) < 0.82  # weight 3:1 -> 0.75
    again = SpeechLMDataset(
        sources,
        builder,
        seq_len=512,
        local_batch_size=4,
        mode="pack",
        window=64,
        dp_rank=0,
        dp_world_size=1,
        seed=5,
        shuffle=True,
        infinite=True,
    )
    assert [batch_hash(b[0]) for b in take(again, 40)] == [batch_hash(b[0]) for b in batches]


def test_resume_refuses_another_vocabulary_or_mixture(tmp_path):
    from torchtitan_speechlm.model.vocab import VocabMismatchError
    from torchtitan_speechlm.trainer.builders import record_vocab

    state = make().state_dict()
    other = make()
    other.layout = VocabLayout(text_size=TEXT + 1, num_streams=N_STREAMS, codebook_size=CODEBOOK)
    with pytest.raises(VocabMismatchError, match="vocabulary layout"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="data mixture"):
        make(tasks=("tts",)).load_state_dict(state)
    record_vocab(str(tmp_path), LAYOUT)
    record_vocab(str(tmp_path), LAYOUT)  # same layout: fine
    with pytest.raises(VocabMismatchError, match="text_size"):
        record_vocab(str(tmp_path), other.layout)


# ---- one stream for every layout ----------------------------------------------------------------
def layout_steps(world, accum, mode, n_steps, *, workers=0, max_tokens=0, state=None, data=None):
    """Run ``world`` ranks x ``accum`` micro-batches per step for ``n_steps`` steps (each rank
    through the real loader, with ``workers`` loader workers); return, per step, the sorted
    content hashes of every sample trained on, and every rank's final loader state."""
    data = data or FakePrepared(n=300, seed=11)
    per_rank, states = [], []
    for r in range(world):
        ds = make(
            world=world,
            rank=r,
            rows=2,
            accum=accum,
            mode=mode,
            seq_len=256,
            window=48,
            data=data,
            max_tokens=max_tokens,
        )
        dl = SpeechLMDataLoader(
            ds,
            dp_rank=r,
            dp_world_size=world,
            batch_size=None,
            num_workers=workers,
            sample_hashes=True,
        )
        if state is not None:
            dl.load_state_dict(state)
        it, mine = iter(dl), []
        for _ in range(n_steps * accum):
            batch = next(it)
            assert len(dl.last_samples) == stat(ds, batch, "examples")
            mine.append(dl.last_samples)
        per_rank.append(mine)
        states.append(dl.state_dict())
        del it
    steps = []
    for s in range(n_steps):
        step = [h for r in range(world) for m in range(accum) for h in per_rank[r][s * accum + m]]
        steps.append(sorted(step))
    return steps, states


@pytest.mark.parametrize("mode,max_tokens", [("pack", 0), ("bucket", 0), ("bucket", 1200)])
def test_every_layout_trains_on_the_same_samples_per_step(mode, max_tokens):
    """1 x 4, 2 x 2 and 4 x 1 (ranks x accumulation), same global batch: the same multiset of
    samples in every optimizer step, on a corpus of varied lengths, with loader workers."""
    ref, _ = layout_steps(1, 4, mode, 6, max_tokens=max_tokens)
    assert all(len(s) >= 4 for s in ref) and len({tuple(s) for s in ref}) == 6
    for world, accum, workers in ((2, 2, 0), (4, 1, 0), (2, 2, 2)):
        got, _ = layout_steps(world, accum, mode, 6, workers=workers, max_tokens=max_tokens)
        assert got == ref, (world, accum, workers)


@pytest.mark.parametrize("mode", ["pack", "bucket"])
@pytest.mark.parametrize("new_world", [1, 4])
def test_resume_on_another_dp_degree_continues_with_the_next_samples(mode, new_world):
    """Stop a 2-rank run after 3 steps, resume on 1 or 4 ranks (same global batch): the next
    steps hold exactly the samples the 2-rank run would have trained on."""
    full, _ = layout_steps(2, 2, mode, 6)
    _, states = layout_steps(2, 2, mode, 3)
    own = [set(pickle.loads(s["speechlm_stream"])["position"]["shards"]) for s in states]
    assert not own[0] & own[1]  # each rank builds (and knows) only its own shards
    resumed, _ = layout_steps(new_world, 4 // new_world, mode, 3, state=merged(states))
    assert resumed == full[3:]


def merged(states: list[dict]) -> dict:
    """What the loader saves in a multi-process run (its state_dict gathers every rank's)."""
    loaded = [pickle.loads(s["speechlm_stream"]) for s in states]
    one = dict(loaded[0], position=merge_positions([x["position"] for x in loaded]))
    return dict(states[0], speechlm_stream=pickle.dumps(one))


def test_resume_with_another_global_batch_is_refused_with_the_fix():
    ds = make(rows=4)
    it = iter(ds)
    next(it)
    with pytest.raises(ValueError, match="4 rows per optimizer step and this run 2"):
        make(rows=2).load_state_dict(ds.state_dict())


def test_lengths_that_do_not_fit_stop_before_the_first_step():
    from torchtitan_speechlm.data.lengths import DataLengthError

    data = FakePrepared(n=60)
    need = np.sort(make(data=data, seq_len=4096).lengths(0) - 1)  # tts samples
    with pytest.raises(DataLengthError, match=f"set training.seq_len >= {need[0]}"):
        make(data=data, seq_len=int(need[0]) - 1)
    median = int(need[len(need) // 2])  # about half the samples are longer

    def tts_only(limit):
        return SpeechLMDataset(
            [Source("tts", "fake", 1.0, data, np.arange(60))],
            make().builder,
            seq_len=median,
            local_batch_size=2,
            mode="pack",
            window=32,
            dp_rank=0,
            dp_world_size=1,
            seed=0,
            shuffle=True,
            infinite=True,
            max_too_long_fraction=limit,
        )

    with pytest.raises(DataLengthError, match="max_too_long_fraction"):
        tts_only(0.25)
    ok = tts_only(1.0)
    batches = take(ok, 3)
    assert sum(stat(ok, b, "skipped_too_long") for b in batches) > 0


def test_best_subset_fills_a_row_as_well_as_any_subset():
    """Against brute force over every subset: distinct indices with the largest sum <= cap."""
    from itertools import combinations

    from torchtitan_speechlm.data.planner import best_subset

    rng = np.random.default_rng(0)
    for _ in range(300):
        sizes = [int(x) for x in rng.integers(1, 60, rng.integers(0, 11))]
        cap = int(rng.integers(0, 200))
        chosen = best_subset(sizes, cap)
        best = max(
            (
                sum(c)
                for r in range(len(sizes) + 1)
                for c in combinations(sizes, r)
                if sum(c) <= cap
            ),
            default=0,
        )
        assert chosen == sorted(set(chosen))
        assert sum(sizes[i] for i in chosen) == best
