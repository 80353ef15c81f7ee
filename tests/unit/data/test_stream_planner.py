"""The planner's pure functions on hand-made lengths: packed rows against brute force, bucket
units against their budget, and the carry-over of under-filled pieces."""

from itertools import combinations

import numpy as np

from torchtitan_speechlm.data.planner import (
    Draw,
    Unit,
    bucket,
    carry_underfilled,
    carry_underfilled_bucket,
    pack,
    window_pieces,
)


def draws_of(needs: list[int], ages: list[int] | None = None) -> list[Draw]:
    """Draws occupying ``needs`` input positions (``length`` = need + 1), item = index."""
    ages = ages or [0] * len(needs)
    return [Draw(0, i, False, n + 1, a) for i, (n, a) in enumerate(zip(needs, ages, strict=True))]


def needs(rows) -> list[list[int]]:
    return [[d.length - 1 for d in row] for row in rows]


def best_fill(sizes: list[int], cap: int) -> int:
    """The largest sum <= cap of any subset, by enumerating them all."""
    return max(
        (sum(c) for r in range(len(sizes) + 1) for c in combinations(sizes, r) if sum(c) <= cap),
        default=0,
    )


def test_pack_a_hand_made_window():
    # 6 heads the first row and 4 fills it exactly; 5 + 3 + 2 fill the second
    assert needs(pack(draws_of([6, 5, 4, 3, 2]), 10, range(5))) == [[6, 4], [5, 3, 2]]
    # among equals, the offer order decides: the first offered heads, the next fills
    items = [[d.item for d in row] for row in pack(draws_of([2, 2, 2]), 4, [2, 0, 1])]
    assert items == [[2, 0], [1]]
    items = [[d.item for d in row] for row in pack(draws_of([2, 2, 2]), 4, [0, 1, 2])]
    assert items == [[0, 1], [2]]


def test_every_packed_row_is_the_longest_sample_plus_the_best_fill_of_the_rest():
    """The rule, checked row by row against brute force on random windows: each row starts
    with the longest remaining sample (the first offered of equals) and fills the rest of
    seq_len as well as any subset of the remaining samples could; every sample is placed
    exactly once."""
    rng = np.random.default_rng(1)
    for _ in range(150):
        seq_len = int(rng.integers(8, 80))
        window = draws_of([int(x) for x in rng.integers(1, seq_len + 1, rng.integers(0, 10))])
        order = rng.permutation(len(window))
        pool = [window[i] for i in order]
        for row in pack(window, seq_len, order):
            longest = max(d.length for d in pool)
            assert row[0] is next(d for d in pool if d.length == longest)
            rest = [d for d in pool if d is not row[0]]
            assert all(any(d is r for r in rest) for d in row[1:])
            cap = seq_len - (longest - 1)
            assert sum(d.length - 1 for d in row[1:]) == best_fill(
                [d.length - 1 for d in rest], cap
            )
            pool = [d for d in pool if not any(d is r for r in row)]
        assert pool == []


def test_bucket_a_hand_made_window():
    units = bucket(draws_of([40, 7, 64, 15, 9, 30, 8]), seq_len=64, max_tokens=96)
    assert [(needs(u.rows), u.t) for u in units] == [
        ([[7], [8], [9], [15]], 16),  # a fifth row (30 -> t 32) would take 5 x 32 > 96
        ([[30], [40]], 40),
        ([[64]], 64),
    ]


def test_bucket_units_are_sorted_within_budget_and_full():
    rng = np.random.default_rng(2)
    for _ in range(100):
        seq_len = int(rng.integers(8, 300))
        max_tokens = seq_len * int(rng.integers(1, 6))
        window = draws_of([int(x) for x in rng.integers(1, seq_len + 1, rng.integers(0, 30))])
        units = bucket(window, seq_len, max_tokens)
        flat = [row[0] for u in units for row in u.rows]
        assert all(len(row) == 1 for u in units for row in u.rows)
        assert sorted(d.item for d in flat) == list(range(len(window)))
        assert [d.length for d in flat] == sorted(d.length for d in window)
        for u, nxt in zip(units, units[1:] + [None], strict=False):
            longest = u.rows[-1][0].length - 1
            assert longest <= u.t <= seq_len and (u.t % 8 == 0 or u.t == seq_len)
            assert u.t < longest + 8 and len(u.rows) * u.t <= max_tokens
            if nxt is not None:  # the next sample did not fit this unit's budget
                t_next = min(-(-(nxt.rows[0][0].length - 1) // 8) * 8, seq_len)
                assert (len(u.rows) + 1) * t_next > max_tokens


def test_underfilled_rows_are_carried_with_their_age():
    full, poor, old = draws_of([97, 50, 30], ages=[0, 0, 2])
    rows, carried = carry_underfilled([[full], [poor], [old]], seq_len=100, window=8)
    assert rows == [[full], [old]]  # a sample carried twice is emitted however poor its row
    assert [(d.item, d.age) for d in carried] == [(1, 1)]
    # more than half a window to carry: everything is emitted as it is
    rows, carried = carry_underfilled([[full], [poor], [old]], seq_len=100, window=1)
    assert rows == [[full], [poor], [old]] and carried == []


def test_an_underfilled_last_bucket_unit_is_carried():
    a, b, c = draws_of([10, 20, 30])
    thin = [Unit([[a]], t=16), Unit([[b], [c]], t=32)]  # 64 frames of a 96 budget: < 75%
    units, carried = carry_underfilled_bucket(thin, max_tokens=96)
    assert units == thin[:1] and [(d.item, d.age) for d in carried] == [(1, 1), (2, 1)]
    units, carried = carry_underfilled_bucket(thin, max_tokens=80)  # 64 of 80: kept
    assert units == thin and carried == []


def test_a_final_window_carries_nothing():
    window = draws_of([50, 40, 3])
    for mode in ("pack", "bucket"):
        kw = dict(mode=mode, seq_len=100, max_tokens=400, window=8)
        _, carried = window_pieces(window, final=False, **kw)
        pieces, none = window_pieces(window, final=True, **kw)
        assert carried and none == []
        rows = pieces if mode == "pack" else [r for u in pieces for r in u.rows]
        assert sorted(d.item for row in rows for d in row) == [0, 1, 2]
