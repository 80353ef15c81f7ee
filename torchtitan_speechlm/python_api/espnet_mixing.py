"""Mixed batches for an ESPnet ``DataIteratorFactory``: every task in every batch.

ESPnet's ``batchfy`` (``bucket``) sorts all items by length before it cuts batches. An
utterance's TTS and ASR items have the same length, so they land in neighbouring batches, and
most batches hold one task at one length (85% on the demo's corpus). A short run then trains one
task per step: through ESPnet's own batches the demo's model reaches 2.3x the TTS WER and 20x
the ASR WER of the same items in mixed batches (docs/python-api.md, *Measured*).

``mix_espnet_batches`` re-makes ``factory.batched_examples`` from its own items in a seeded
random order, each batch cut at ``frames`` frames of data (the items' lengths summed: the data a
step sees is ESPnet's ``batch_size``; the rows are padded to the batch's longest item). The
lengths are the ones ESPnet's factory read: ``stats_dir/stats_{task}_{dataset}.jsonl``. Every
rank gets the same batches from the same seed, so ``build_iter``'s rank shards and a resume's
chunks stay ESPnet's.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any


def read_lengths(stats_dir: str, items: list[tuple[str, str, str]]) -> dict[tuple, int]:
    """The length of each ``(task, dataset, example_id)`` from ESPnet's length statistics."""
    files: dict[tuple[str, str], dict[str, int]] = {}
    lengths = {}
    for task, name, key in items:
        if (task, name) not in files:
            path = os.path.join(stats_dir, f"stats_{task}_{name}.jsonl")
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"mix_espnet_batches: {path} not found: pass the stats_dir the factory "
                    "was built with (ESPnet's bin/prepare_length_stats.py writes it)"
                )
            table: dict[str, int] = {}
            with open(path) as f:
                for line in f:
                    table.update(json.loads(line))
            files[(task, name)] = table
        try:
            lengths[(task, name, key)] = int(files[(task, name)][key])
        except KeyError:
            raise ValueError(
                f"mix_espnet_batches: example {key!r} of {task}:{name} has no length in "
                f"{os.path.join(stats_dir, f'stats_{task}_{name}.jsonl')}: rerun ESPnet's "
                "length statistics for this dataset"
            ) from None
    return lengths


def mix_espnet_batches(factory: Any, stats_dir: str, frames: int, seed: int = 0) -> int:
    """Replace ``factory.batched_examples`` by mixed batches of at most ``frames`` frames of
    data each (an item longer than that alone); return how many batches there are now."""
    if frames <= 0:
        raise ValueError(f"mix_espnet_batches: frames = {frames}; give ESPnet's batch_size")
    items = [tuple(e) for batch in factory.batched_examples for e in batch]
    lengths = read_lengths(stats_dir, items)
    random.Random(seed).shuffle(items)
    batches: list[list[tuple]] = []
    current: list[tuple] = []
    total = 0
    for item in items:
        if current and total + lengths[item] > frames:
            batches.append(current)
            current, total = [], 0
        current.append(item)
        total += lengths[item]
    if current:
        batches.append(current)
    factory.batched_examples = batches
    return len(batches)
