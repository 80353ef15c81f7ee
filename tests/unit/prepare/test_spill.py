"""Planning in bounded memory (issue 38): a JSONL manifest is read into ``SpilledItems``
(prepare/spill.py: pickled chunks on disk), so the source, the plan and the tokenizer check's
sample cost bytes per item, not objects. Checked against the in-memory list the reader returns
(the same items, the same plan) and against its memory (tracemalloc, the same corpus)."""

from __future__ import annotations

import json
import pickle
import tracemalloc
from types import SimpleNamespace

import pytest

from torchtitan_speechlm.data.tokenizer_check import input_samples
from torchtitan_speechlm.prepare.items import ManifestError
from torchtitan_speechlm.prepare.plan import build_plan
from torchtitan_speechlm.prepare.sources import read_source
from torchtitan_speechlm.prepare.sources.jsonl import read_jsonl_manifest
from torchtitan_speechlm.prepare.spill import CHUNK, SpilledItems

CODEC = SimpleNamespace(name="k", path="p", class_name="c", sample_rate=16000, frame_rate=25,
                        num_streams=4, total_streams=4, codebook_size=256, config_hash="0")  # fmt: skip


def manifest(path, n: int, dup_at: int | None = None) -> str:
    with open(path, "w") as f:
        for i in range(n):
            uid = "u3" if i == dup_at else f"u{i}"
            row = {"id": uid, "audio": f"wavs/{uid}.wav", "text": f"sentence number {i}"}
            if i % 3 == 0:
                row["speaker"] = f"s{i % 7}"
            if i % 11 == 0:
                row = {"id": uid, "text": f"text only {i}"}
            f.write(json.dumps(row) + "\n")
    return str(path)


def test_spilled_items_are_the_list_reader_s_items(tmp_path):
    path = manifest(tmp_path / "m.jsonl", 3 * CHUNK + 17)
    listed = read_jsonl_manifest(path)
    spilled = read_source("manifest", path).items
    assert isinstance(spilled, SpilledItems) and len(spilled) == len(listed)
    assert list(spilled) == listed
    assert [spilled[i] for i in (0, CHUNK - 1, CHUNK, -1)] == [
        listed[i] for i in (0, CHUNK - 1, CHUNK, -1)
    ]
    assert spilled[CHUNK - 5 : 2 * CHUNK + 3] == listed[CHUNK - 5 : 2 * CHUNK + 3]
    plan = build_plan(spilled, {"type": "manifest"}, CODEC, {"hash": "0"}, 100, False)
    assert plan == build_plan(listed, {"type": "manifest"}, CODEC, {"hash": "0"}, 100, False)
    assert input_samples(spilled) == input_samples(listed)
    with pytest.raises(IndexError):
        spilled[len(listed)]
    with pytest.raises(TypeError, match="stays in the process"):
        pickle.dumps(spilled)


def test_a_duplicate_id_is_named_with_both_lines_as_before(tmp_path):
    path = manifest(tmp_path / "d.jsonl", 2500, dup_at=2100)
    with pytest.raises(ManifestError) as e:
        read_source("manifest", path)
    assert str(e.value) == f"{path}:2101: duplicate id 'u3' (first on line 4)"


def test_reading_and_planning_cost_bytes_per_item_not_objects(tmp_path):
    """The peak of reading, planning and sampling, per item added (10k -> 40k lines: the
    per-shard and per-chunk constants cancel)."""

    def peak(n: int, read) -> int:
        path = manifest(tmp_path / f"m{n}.jsonl", n)
        tracemalloc.start()
        items = read(path)
        build_plan(items, {"type": "manifest"}, CODEC, {"hash": "0"}, 1000, False)
        input_samples(items)
        size = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return size

    def slope(read, small: int, large: int) -> float:
        return (peak(large, read) - peak(small, read)) / (large - small)

    in_memory = slope(read_jsonl_manifest, 5_000, 20_000)  # (objects: slow to trace)
    spilled = slope(lambda path: read_source("manifest", path).items, 10_000, 40_000)
    print(f"bytes per item: in memory {in_memory:.0f}, spilled {spilled:.1f}")
    assert in_memory > 300  # bytes per item held as objects
    # an 8-byte hash of each id (the array grows by doubling; a sorted copy for the duplicate
    # check): O(items) still, ~30x less than the items themselves
    assert spilled < 25, (spilled, in_memory)
