"""The typed stream position against the checkpoint's dict form: a state written by the stream
before the split (data/stream.py at a5c9df1) loads, continues with the same batches, and comes
back as the same dict and the same pickled bytes; the ranks' positions merge."""

import copy
import itertools
import pickle

import numpy as np
import pytest

from tests.fake_stream import FakePrepared, make
from torchtitan_speechlm.data.collation import batch_hash
from torchtitan_speechlm.data.position import StreamPosition, merge_positions


def rng_state(state: int, inc: int) -> dict:
    return {
        "bit_generator": "PCG64",
        "state": {"state": state, "inc": inc},
        "has_uint32": 0,
        "uinteger": 0,
    }


# SpeechLMDataset.state_dict() of checkpoint_era_stream() after 40 micro-batches as the
# pre-split stream.py pickled it into checkpoints, that dict (its repr, reformatted), and the
# hashes of the next 4 batches that stream built
SAVED_PICKLE = bytes.fromhex(
    "80049545020000000000007d94288c08706f736974696f6e947d94288c057374657073944b148c0a6d696372"
    "6f5f646f6e65944b008c0c616363756d756c6174696f6e944b028c0b737465705f706965636573944b028c06"
    "736861726473947d94284b007d94288c0677696e646f77947d94288c0565706f6368945d94284b014b01658c"
    "03706f73945d94284b084b04658c03726e67947d94288c0d6269745f67656e657261746f72948c0550434736"
    "34948c057374617465947d942868148a10355a03d061e9ee21a58d14e394a8c82a8c03696e63948a10d38270"
    "31eb87e3e1c8c6f2ed1ae6ee65758c0a6861735f75696e743332944b008c0875696e7465676572944b00758c"
    "0763617272696564945d9428284b004b0e894b794b017494284b014b0f894b794b017494284b004b06894b4b"
    "4b01749465680a4b07758c08636f6e73756d6564944b02754b017d9428680a7d9428680c5d94284b014b0165"
    "680e5d94284b064b096568107d942868128c0550434736349468147d942868148a11f3b3b55aae98a8aca189"
    "7f3f0199b2c50068168a10c9854cac1caef6c5dbc58d2f5606b7597568174b0068184b007568195d9428284b"
    "014b04894b804b017494284b004b05894b764b017494284b014b18894b684b01749465680a4b0975681e4b01"
    "7575758c06706965636573947d94288c046d6f6465948c047061636b948c077365715f6c656e944d0001758c"
    "07736f7572636573945d94288c087474733a66616b65948c086173723a66616b6594658c05766f636162948c"
    "106432653139366330313662623664313394752e"
)
SAVED = {
    "position": {
        "steps": 20,
        "micro_done": 0,
        "accumulation": 2,
        "step_pieces": 2,
        "shards": {
            0: {
                "window": {
                    "epoch": [1, 1],
                    "pos": [8, 4],
                    "rng": rng_state(
                        56869454435532842425088811000429500981,
                        135492461314390303504140003916785943251,
                    ),
                    "carried": [
                        (0, 14, False, 121, 1),
                        (1, 15, False, 121, 1),
                        (0, 6, False, 75, 1),
                    ],
                    "window": 7,
                },
                "consumed": 2,
            },
            1: {
                "window": {
                    "epoch": [1, 1],
                    "pos": [6, 9],
                    "rng": rng_state(
                        262785247317996886644178728833525330931,
                        119251610472766172643683224635598210505,
                    ),
                    "carried": [
                        (1, 4, False, 128, 1),
                        (0, 5, False, 118, 1),
                        (1, 24, False, 104, 1),
                    ],
                    "window": 9,
                },
                "consumed": 1,
            },
        },
    },
    "pieces": {"mode": "pack", "seq_len": 256},
    "sources": ["tts:fake", "asr:fake"],
    "vocab": "d2e196c016bb6d13",
}
NEXT_HASHES = [
    "970aab44cbf4aff7da621464",
    "2e85e3e328c83749b48a3c7b",
    "f33b067a893249c5a3ef8751",
    "5e9bd624f2b0403bb13ab230",
]


def checkpoint_era_stream():
    """Two shards (1 row x accumulation 2), 30 items: epochs, carried samples, windows > 0."""
    return make(rows=1, accum=2, window=6, data=FakePrepared(n=30, seed=2))


def hashes(ds, n: int) -> list[str]:
    return [batch_hash(ds.fetch(p)[0][0]) for p in itertools.islice(ds.plans(), n)]


def test_the_position_round_trips_to_the_same_dict_types_and_bytes():
    assert pickle.loads(SAVED_PICKLE) == SAVED
    position = pickle.loads(SAVED_PICKLE)["position"]
    back = StreamPosition.from_dict(copy.deepcopy(position)).to_dict()
    assert back == position and pickle.dumps(back) == pickle.dumps(position)
    window = back["shards"][1]["window"]
    assert list(window) == ["epoch", "pos", "rng", "carried", "window"]
    assert type(window["epoch"]) is list and type(window["carried"][0]) is tuple
    assert list(back) == ["steps", "micro_done", "accumulation", "step_pieces", "shards"]


def test_the_stream_writes_the_checkpoint_era_state_plus_each_windows_settings():
    """The saved state is the checkpoint-era one, each shard's window also naming the size and
    token budget it was cut with (``build``: a resume with other settings rebuilds it as cut)."""
    ds = checkpoint_era_stream()
    assert len(list(itertools.islice(ds.plans(), 40))) == 40
    want = copy.deepcopy(SAVED)
    for cursor in want["position"]["shards"].values():
        cursor["window"]["build"] = {"window": 6, "max_tokens": 256}
    assert ds.state_dict() == want


def test_a_checkpoint_era_state_loads_and_continues_with_the_same_batches():
    ds = checkpoint_era_stream()
    ds.load_state_dict(pickle.loads(SAVED_PICKLE))
    assert ds.state_dict() == SAVED
    assert hashes(ds, 4) == NEXT_HASHES
    assert hashes(checkpoint_era_stream(), 44)[40:] == NEXT_HASHES  # the uninterrupted stream


@pytest.mark.parametrize("mode", ["pack", "bucket"])
def test_a_resume_with_another_window_finishes_the_interrupted_window_as_it_was_cut(mode):
    """Saved inside a window (window 8), resumed with window 20 and another token budget: the
    rest of that window comes exactly as the uninterrupted stream gives it; the windows after
    it are cut with the new settings (so the stream then differs)."""
    old = dict(rows=1, accum=2, window=8, mode=mode, data=FakePrepared(n=40, seed=3))
    new = dict(old, window=20, max_tokens=512 if mode == "bucket" else 0)
    if mode == "bucket":
        old["max_tokens"] = 300
    first = make(**old)
    plans = list(itertools.islice(first.plans(), 3))  # inside shard 0's first window
    state = first.state_dict()
    cursor = state["position"]["shards"][0]
    assert cursor["consumed"] > 0 and cursor["window"]["build"]["window"] == 8
    uninterrupted = hashes(make(**old), 60)
    resumed = make(**new)
    resumed.load_state_dict(state)
    rest = hashes(resumed, 57)
    left = sum(
        1
        for _ in itertools.takewhile(
            lambda ab: ab[0] == ab[1], zip(rest, uninterrupted[3:], strict=True)
        )
    )
    assert left >= 1 and len(plans) == 3  # the interrupted window's remaining micro-batches
    assert rest != uninterrupted[3:]  # later windows: the new size


def test_the_ranks_positions_merge_into_every_shard():
    ranks = [make(world=2, rank=r, rows=2, data=FakePrepared(n=50)) for r in (0, 1)]
    for ds in ranks:
        list(itertools.islice(ds.plans(), 3))
    parts = [ds.state_dict()["position"] for ds in ranks]
    merged = merge_positions(parts)
    assert list(merged["shards"]) == [0, 1, 2, 3]
    assert merged == dict(parts[0], shards={**parts[0]["shards"], **parts[1]["shards"]})
    assert merge_positions([parts[0], parts[0]]) == parts[0]  # TP/PP peers: same shards twice
    behind = dict(parts[1], steps=parts[1]["steps"] - 1)
    with pytest.raises(
        RuntimeError, match=r"disagree on the stream's step: \[\(2, 0\), \(3, 0\)\]"
    ):
        merge_positions([parts[0], behind])


def test_the_first_window_of_a_shard_is_seeded_by_the_shard():
    a, b = make(world=2, rank=0, rows=1), make(world=2, rank=1, rows=1)
    rng = {r: d.state_dict()["position"]["shards"][r]["window"]["rng"] for r, d in ((0, a), (1, b))}
    expected = np.random.default_rng([3, 7919, 1]).bit_generator.state
    assert rng[1] == expected and rng[0] != rng[1]
