"""``speechlm_data.order = "keyed"`` (data/keyed_order.py): an epoch's order as a keyed bijection
evaluated where a shard reads it. Checked against its definition: every epoch of every source
visits each item exactly once over the shards; other keys give other orders; a shard's lazy
share is the bijection at its positions; the stream on the keyed order resumes exactly on 1 and 2
ranks; a resume with the other order is refused naming the key, both ways; and the walk's cost
does not grow with the source (no global array)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.fake_stream import FakePrepared, make
from torchtitan_speechlm.data.collation import batch_hash
from torchtitan_speechlm.data.keyed_order import KeyedShare, keyed_order, round_keys
from torchtitan_speechlm.data.mixing import AllItems, Mixture, Source
from torchtitan_speechlm.data.sampler import StreamResumeError


def take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 128, 1000, 4099, 65537])
def test_the_order_is_a_bijection_and_its_keys_matter(n):
    keys = round_keys(3, 0, 0, 104729)
    order = keyed_order(np.arange(n), n, keys)
    assert sorted(order.tolist()) == list(range(n))
    if n >= 128:  # another epoch, another source: another order (not a shifted copy)
        for other in (round_keys(3, 0, 1, 104729), round_keys(3, 1, 0, 104729)):
            again = keyed_order(np.arange(n), n, other)
            assert sorted(again.tolist()) == list(range(n))
            assert (again != order).mean() > 0.9
    if n >= 1000:  # shuffled, not sorted: a random order's correlation is ~ 1/sqrt(n)
        assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 4 / np.sqrt(n)


def test_shards_partition_every_epoch_and_shares_are_the_bijection_at_their_positions():
    held = np.array([i for i in range(3001) if i % 5], dtype=np.int32)  # not every item
    for items in (AllItems(3001), held):
        n, step = len(items), 16
        for epoch in (0, 1):
            keys = round_keys(7, 2, epoch, 104729)
            shares = [KeyedShare(items, j, step, keys) for j in range(step)]
            walked = [shares[j][k] for j in range(step) for k in range(len(shares[j]))]
            assert sorted(walked) == sorted(np.asarray(items).tolist())  # each item once
            j = 5
            want = np.asarray(items)[keyed_order(j + step * np.arange(len(shares[j])), n, keys)]
            assert shares[j].tolist() == want.tolist()
    with pytest.raises(IndexError):
        KeyedShare(AllItems(10), 0, 4, keys)[3]


def test_a_mixture_on_the_keyed_order_walks_each_epoch_of_each_source_once():
    data = FakePrepared(n=200)
    sources = [Source("tts", "a", 1.0, data, AllItems(200)), Source("asr", "a", 1.0, data,
               np.arange(0, 200, 2, dtype=np.int32))]  # fmt: skip
    mix = Mixture(sources, step_pieces=8, seed=1, shuffle=True, infinite=True, cfg_dropout=0.0,
                  length=lambda src, item, drop: 10, order="keyed")  # fmt: skip
    for src, items in ((0, range(200)), (1, range(0, 200, 2))):
        for epoch in (0, 3):
            got = [int(mix.perm(src, epoch, j)[k]) for j in range(8)
                   for k in range(len(mix.perm(src, epoch, j)))]  # fmt: skip
            assert sorted(got) == list(items)
    plain = Mixture(sources, step_pieces=8, seed=1, shuffle=True, infinite=True, cfg_dropout=0.0,
                    length=lambda src, item, drop: 10, order="permutation")  # fmt: skip
    assert mix.perm(0, 0, 0).tolist() != plain.perm(0, 0, 0).tolist()  # another order


@pytest.mark.parametrize("world", [1, 2])
def test_the_keyed_stream_resumes_exactly(world):
    def ranks():
        return [make(world=world, rank=r, rows=4 // world, order="keyed") for r in range(world)]

    full = [[batch_hash(b[0]) for b in take(d, 10)] for d in ranks()]
    first = ranks()
    for d in first:
        it = iter(d)
        for _ in range(4):
            next(it)
    for r, d in enumerate(ranks()):
        d.load_state_dict(first[r].state_dict())
        assert [batch_hash(b[0]) for b in take(d, 6)] == full[r][4:]
    plain = [batch_hash(b[0]) for b in take(make(), 3)]
    assert [batch_hash(b[0]) for b in take(make(order="keyed"), 3)] != plain


def test_a_resume_with_the_other_order_is_refused_naming_the_key():
    for saved, now in (("keyed", "permutation"), ("permutation", "keyed")):
        ds = make(order=saved)
        next(iter(ds))
        with pytest.raises(StreamResumeError, match="speechlm_data.order") as e:
            make(order=now).load_state_dict(ds.state_dict())
        assert f"cut with speechlm_data.order = {saved!r}" in str(e.value)
    state = make().state_dict()
    assert "order" not in state["pieces"]  # the default's positions are as before


def test_auto_starts_keyed_and_resumes_in_the_checkpoints_order(caplog):
    """``order = "auto"`` (the default since stream version 2): a new run is the keyed stream;
    a resume continues in the order its checkpoint was cut with, said in the log: a run
    started on numpy's permutation (its positions record no order) continues exactly as the
    uninterrupted permutation stream, a keyed one as the keyed stream."""
    keyed = [batch_hash(b[0]) for b in take(make(order="keyed"), 6)]
    assert [batch_hash(b[0]) for b in take(make(order="auto"), 6)] == keyed
    for saved in ("permutation", "keyed"):
        full = [batch_hash(b[0]) for b in take(make(order=saved), 6)]
        first = make(order=saved)
        it = iter(first)
        for _ in range(2):
            next(it)
        resumed = make(order="auto")
        with caplog.at_level("INFO"):
            resumed.load_state_dict(first.state_dict())
        assert [batch_hash(b[0]) for b in take(resumed, 4)] == full[2:]
        followed = f"cut with order {saved!r}; continuing in it" in caplog.text
        assert followed == (saved == "permutation")  # keyed: auto's own order, nothing to say
        assert resumed.state_dict()["pieces"] == first.state_dict()["pieces"]
        caplog.clear()


def test_a_share_costs_what_it_reads_not_the_source():
    """Reading the first 100 items of a shard: the same work at 10^5 and 10^8 items (the
    default order would shuffle 10^8 items first: seconds and 800 MB)."""
    times = {}
    for n in (10**5, 10**8):
        t0 = time.perf_counter()
        share = KeyedShare(AllItems(n), 3, 128, round_keys(0, 0, 0, 104729))
        got = [share[k] for k in range(100)]
        times[n] = time.perf_counter() - t0
        assert (
            len(set(got)) == 100
            and all(0 <= g < n for g in got)
            and len(share) == -(-(n - 3) // 128)
        )
    assert times[10**8] < 0.5  # a block of 4096 positions, whatever n


def test_one_rank_and_two_ranks_see_the_same_global_batches_on_the_keyed_order():
    import torch

    one = take(make(world=1, rows=4, order="keyed"), 6)
    two = [take(make(world=2, rank=r, rows=2, order="keyed"), 6) for r in (0, 1)]
    for g in range(6):
        for key in ("input", "targets", "loss_weights", "position_ids"):
            joined = torch.cat([two[0][g][0][key], two[1][g][0][key]])
            assert torch.equal(one[g][0][key], joined), (g, key)
