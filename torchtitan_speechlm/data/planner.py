"""A window of drawn samples -> the pieces of the stream, from sample lengths alone.

Pure functions: no dataset, reader or random state of the stream is needed to call them, so
the packing and bucketing rules can be tested (and reasoned about) on a hand-made list of
lengths. A ``Draw`` is a sample's identity and its length in frames (the sample occupies
``length - 1`` input positions); a piece is a packed row (``list[Draw]``, pack) or a ``Unit``
(bucket: one sample per row, padded to ``t`` frames).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# a well-filled packed row: at least this share of seq_len holds samples
ROW_FILL = 0.97
# a bucket micro-batch under this share of its token budget is carried to the next window
BUCKET_FILL = 0.75
# bucket rows are padded to a multiple of this many frames
FRAME_MULTIPLE = 8


@dataclass
class Draw:
    src: int
    item: int
    cfg_drop: bool
    length: int  # frames of the example (the sample uses length - 1 input positions)
    age: int = 0  # windows this draw has been carried over (bounded: see carry_underfilled)
    prompt: int = -1  # a prompted task's speaker prompt (an item of the source); -1: none

    def aged(self) -> Draw:
        """The same sample, carried into one more window."""
        return Draw(self.src, self.item, self.cfg_drop, self.length, self.age + 1, self.prompt)

    def as_tuple(self) -> tuple:
        """The form a carried draw has in a saved window state (a draw with a speaker prompt
        has it sixth; one without keeps the five values saved states always had)."""
        if self.prompt >= 0:
            return (self.src, self.item, self.cfg_drop, self.length, self.age, self.prompt)
        return (self.src, self.item, self.cfg_drop, self.length, self.age)


@dataclass
class Unit:
    """One rank's micro-batch: rows of draws, padded to ``t`` frames."""

    rows: list[list[Draw]]
    t: int = 0


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def best_subset(sizes: list[int], cap: int) -> list[int]:
    """Indices (ascending) of a subset of ``sizes`` with the largest sum <= cap."""
    if cap <= 0 or not sizes:
        return []
    mask, full = (1 << (cap + 1)) - 1, 1 << cap
    reach = [1]  # reach[i]: bit s set if some subset of sizes[:i] sums to s
    for w in sizes:
        if reach[-1] & full:  # cap reached exactly: later items would never be chosen
            break
        reach.append((reach[-1] | (reach[-1] << w)) & mask if w <= cap else reach[-1])
    best = reach[-1].bit_length() - 1
    chosen = []
    for i in range(len(reach) - 1, 0, -1):
        if not (reach[i - 1] >> best) & 1:
            chosen.append(i - 1)
            best -= sizes[i - 1]
    return sorted(chosen)


def split_too_long(draws: list[Draw], seq_len: int) -> tuple[list[Draw], list[Draw]]:
    """``(fitting, too long)``: a sample longer than ``seq_len`` input positions fits nowhere."""
    return [d for d in draws if d.length - 1 <= seq_len], [
        d for d in draws if d.length - 1 > seq_len
    ]


def pack(draws: list[Draw], seq_len: int, order: Sequence[int]) -> list[list[Draw]]:
    """Rows filled by exact subset-sum: each row takes the longest remaining sample, then the
    subset of the others that fills the rest best (bitset DP, O(items) big-int ops). The
    candidates are offered in ``order`` (a permutation of ``draws``; the stream's is seeded
    and random, so rows mix tasks and lengths instead of grouping similar samples). Padding
    ends up in the last rows, which the stream carries into the next window."""
    pool = [draws[i] for i in order]
    need = [d.length - 1 for d in pool]  # input positions of each, in step with pool
    rows: list[list[Draw]] = []
    while pool:
        first = need.index(max(need))  # the longest; the first of equals
        head = pool.pop(first)
        need.pop(first)
        chosen = best_subset(need, seq_len - head.length + 1)
        rows.append([head] + [pool[i] for i in chosen])
        for i in reversed(chosen):
            pool.pop(i)
            need.pop(i)
    return rows


def bucket(draws: list[Draw], seq_len: int, max_tokens: int) -> list[Unit]:
    """Length-sorted micro-batches of one sample per row: as many rows as fit ``max_tokens``
    at the padded length, each padded to its longest (a multiple of 8, at most ``seq_len``)."""
    units: list[Unit] = []
    rows: list[list[Draw]] = []
    for d in sorted(draws, key=lambda d: d.length):
        t = round_up(d.length - 1, FRAME_MULTIPLE)
        if rows and (len(rows) + 1) * min(t, seq_len) > max_tokens:
            units.append(Unit(rows, t=round_up(rows[-1][0].length - 1, FRAME_MULTIPLE)))
            rows = []
        rows.append([d])
    if rows:
        units.append(Unit(rows, t=round_up(rows[-1][0].length - 1, FRAME_MULTIPLE)))
    for u in units:
        u.t = min(u.t, seq_len)
    return units


def carry_underfilled(
    rows: list[list[Draw]], seq_len: int, window: int
) -> tuple[list[list[Draw]], list[Draw]]:
    """Keep the well-filled rows; carry the others' samples to the next window (at most half a
    window, so nothing can be carried for ever)."""

    def ok(row: list[Draw]) -> bool:  # well filled, or holding a sample carried twice
        return sum(d.length - 1 for d in row) >= ROW_FILL * seq_len or any(d.age >= 2 for d in row)

    good, poor = [r for r in rows if ok(r)], [r for r in rows if not ok(r)]
    carried = [d for row in poor for d in row]
    if len(carried) > window // 2:
        return rows, []  # cannot pack better: emit everything
    return good, [d.aged() for d in carried]


def carry_underfilled_bucket(units: list[Unit], max_tokens: int) -> tuple[list[Unit], list[Draw]]:
    """Carry the last (longest-sample) micro-batch's samples to the next window when it fills
    less than ``BUCKET_FILL`` of the budget."""
    last = units[-1] if units else None
    if last and len(last.rows) * last.t < BUCKET_FILL * max_tokens:
        return units[:-1], [d.aged() for row in last.rows for d in row]
    return units, []


def window_pieces(
    draws: list[Draw],
    *,
    mode: str,
    seq_len: int,
    max_tokens: int,
    window: int,
    final: bool,
    pack_order: Sequence[int] | None = None,
) -> tuple[list, list[Draw]]:
    """``(pieces, carried)`` of a window's fitting samples: packed rows (``mode = "pack"``, the
    candidates offered in ``pack_order``, default their order) or bucket units. Unless the
    window is ``final`` (its shard is exhausted, or the pass is finite), the samples of
    under-filled pieces are carried into the next window instead of emitted."""
    if mode == "pack":
        rows = pack(draws, seq_len, range(len(draws)) if pack_order is None else pack_order)
        return (rows, []) if final else carry_underfilled(rows, seq_len, window)
    units = bucket(draws, seq_len, max_tokens)
    return (units, []) if final else carry_underfilled_bucket(units, max_tokens)
