"""A planned micro-batch -> the tensors the model trains on, its statistics and its hashes.

Each row of a unit holds one sample (bucket) or several (pack), placed end to end, each with
its own position ids (attention stays within a sample: model/documents.py); the rest of the
row is padding, a "document" of its own without loss. Every micro-batch carries a
``data_stats`` vector (``data_stats_keys``) that the loss step sums into the DATA statistics,
and runs with continuous audio input also carry the waveforms (model/audio/tower.py). A
preference stream's micro-batches carry its pairs and count them in ``labels`` (data/pairs.py).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from torchtitan_speechlm.data.examples import Examples
from torchtitan_speechlm.data.pairs import PREF_KEYS, PairExample, PairRows
from torchtitan_speechlm.data.planner import Draw, Unit
from torchtitan_speechlm.data.tasks import TASKS, TemplateBuilder
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.utils.upstream import IGNORE_INDEX

CONTINUOUS_KEYS = ("audio_wave", "audio_lengths", "audio_index")
BASE_STATS = (
    "examples",
    "rows",
    "frames",
    "pad_frames",
    "loss_frames",
    "audio_frames",
    "skipped_too_long",
    "skipped_bad",
    "cfg_dropped",
    "pref_identical",
)


def data_stats_keys(num_streams: int) -> tuple[str, ...]:
    """Names of the ``data_stats`` vector every micro-batch carries (see DATA statistics docs)."""
    return (
        BASE_STATS
        + tuple(f"task_{t}" for t in TASKS.names())
        + tuple(f"tokens_stream{k}" for k in range(num_streams))
    )


def batch_bytes(unit: Unit, num_streams: int) -> int:
    """Bytes of the micro-batch ``collate`` builds from ``unit`` (for the loader's bundles):
    input and targets int64, weights float32 per frame and stream, positions and labels."""
    return len(unit.rows) * unit.t * (20 * num_streams + 16)


def continuous_batch(segments: list[tuple[int, int, int, np.ndarray]], b: int, t: int) -> dict:
    """The model's continuous inputs (model/audio/tower.py) of ``(row, first frame, frames,
    int16 waveform)`` segments: waveforms zero-padded to the longest, their lengths, and each
    frame's row in the concatenation of the segments' adaptor frames (-1 elsewhere)."""
    longest = max((len(s[3]) for s in segments), default=0)
    wave = np.zeros((len(segments), longest), dtype=np.int16)
    index = np.full((b, t), -1, dtype=np.int64)
    done = 0
    for i, (r, first, n, w) in enumerate(segments):
        wave[i, : len(w)] = w
        index[r, first : first + n] = done + np.arange(n)
        done += n
    return {
        "audio_wave": torch.from_numpy(wave),
        "audio_lengths": torch.tensor([len(s[3]) for s in segments], dtype=torch.int64),
        "audio_index": torch.from_numpy(index),
    }


def example_hash(ex) -> str:
    """Content hash of one sample (its frames and loss weights; a pair's, of both documents)."""
    h = hashlib.blake2b(digest_size=12)
    for doc in ex.documents:
        h.update(doc.frames.tobytes())
        h.update(doc.weights.tobytes())
    return h.hexdigest()


def batch_hash(batch: dict) -> str:
    """Content hash of a micro-batch (inputs, targets, weights, positions)."""
    h = hashlib.blake2b(digest_size=12)
    for key in ("input", "targets", "loss_weights", "position_ids", *CONTINUOUS_KEYS, *PREF_KEYS):
        if key in batch:  # the continuous / preference keys only in runs with such tasks
            h.update(batch[key].numpy().tobytes())
    return h.hexdigest()


class Collator:
    """Builds units into ``(inputs, labels)`` micro-batches; ``continuous``: the batches carry
    ``audio_wave`` / ``audio_lengths`` / ``audio_index`` (a continuous-input task is mixed);
    ``preference``: the batches carry their pairs (``pref_*``, data/pairs.py) and ``labels``
    count the pairs, with reference log-probs from ``reference`` ({source: [items, 2]})."""

    def __init__(
        self,
        layout: VocabLayout,
        builder: TemplateBuilder,
        examples: Examples,
        continuous: bool,
        preference: bool = False,
    ):
        self.layout, self.builder, self.examples = layout, builder, examples
        self.continuous, self.preference = continuous, preference
        self.reference: dict[int, np.ndarray] | None = None
        self.stats_keys = data_stats_keys(layout.num_streams)
        self._pad_frame = np.array(layout.pad_frame(), dtype=np.int64)

    def collate(
        self, unit: Unit, skipped_too_long: int = 0, sample_hashes: list[str] | None = None
    ) -> tuple[dict, torch.Tensor]:
        """Frames, targets, weights and positions of a unit's rows; with ``sample_hashes``, a
        content hash of every sample placed is appended to it."""
        b, t, n = len(unit.rows), unit.t, self.layout.num_streams
        inp = np.broadcast_to(self._pad_frame, (b, t, n)).copy()
        tgt = inp.copy()
        w = np.zeros((b, t, n), dtype=np.float32)
        pos = np.zeros((b, t), dtype=np.int64)
        stats = dict.fromkeys(self.stats_keys, 0.0)
        stats["rows"], stats["skipped_too_long"] = b, skipped_too_long
        continuous = []  # (row, first frame, frames, waveform) of each continuous segment
        pairs = PairRows(b, t) if self.preference else None
        for r, row in enumerate(unit.rows):
            placed = (stats, continuous, pairs, sample_hashes)
            at = self._fill_row(r, row, (inp, tgt, w, pos), placed)
            stats["frames"] += at
            pos[r, at:] = np.arange(t - at)  # padding is its own "document"
        loss_frames = (w > 0).any(-1)
        self._frame_stats(stats, inp, loss_frames)
        batch = {
            "input": torch.from_numpy(inp),
            "targets": torch.from_numpy(tgt),
            "loss_weights": torch.from_numpy(w),
            "position_ids": torch.from_numpy(pos),
            "data_stats": torch.tensor([[stats[k] for k in self.stats_keys]], dtype=torch.float32),
        }
        if self.continuous:
            batch.update(continuous_batch(continuous, b, t))
        if pairs is not None:
            batch.update(pairs.tensors(self.reference))
            return batch, pairs.labels()
        return batch, torch.from_numpy(np.where(loss_frames, 0, IGNORE_INDEX))

    def _fill_row(
        self, r: int, row: list[Draw], arrays: tuple[np.ndarray, ...], placed: tuple
    ) -> int:
        """Place row ``r``'s samples end to end (a pair's two documents one after the other);
        returns the frames they fill. ``placed``: (stats, continuous segments, the preference
        pairs or None, sample hashes or None), added to."""
        inp, tgt, w, pos = arrays
        stats, continuous, pairs, sample_hashes = placed
        at = 0
        for d in row:
            ex = self.examples.example(d)
            if ex is None:
                stats["skipped_bad"] += 1
                continue
            if isinstance(ex, PairExample) and ex.identical:  # nothing to prefer: not trained
                stats["pref_identical"] += 1
                continue
            if sample_hashes is not None:
                sample_hashes.append(example_hash(ex))
            spans = []  # (first frame, frames) of each document
            for doc in ex.documents:
                length = len(doc.frames) - 1
                for first, wave in doc.continuous:
                    frames = int(self.builder.continuous_frames(len(wave)))
                    continuous.append((r, at + first, frames, wave))
                inp[r, at : at + length] = doc.frames[:-1]
                tgt[r, at : at + length] = doc.frames[1:]
                w[r, at : at + length] = doc.weights[1:]
                pos[r, at : at + length] = np.arange(length)
                spans.append((at, length))
                at += length
            if pairs is not None:
                pairs.add(r, spans, ex.chosen.weights[1:], (d.src, d.item))
            stats["examples"] += 1
            stats["cfg_dropped"] += d.cfg_drop
            stats[f"task_{self.examples.task(d)}"] += 1
        return at

    def _frame_stats(self, stats: dict, inp: np.ndarray, loss_frames: np.ndarray) -> None:
        """Padding, loss-carrying, per-stream token and audio frame counts of a batch."""
        b, t, n = inp.shape
        stats["pad_frames"] = b * t - stats["frames"]
        stats["loss_frames"] = float(loss_frames.sum())
        for k in range(n):
            pads = (self._pad_frame[k], self.layout.stream_pad(k))
            stats[f"tokens_stream{k}"] = float((~np.isin(inp[..., k], pads)).sum())
        # an audio frame is N codes, wherever the pattern put them
        base, block = self.layout.stream_offset(0), self.layout.codebook_size + 1
        rel = inp - base
        codes = (rel >= 0) & (inp < self.layout.size) & (rel % block != 0)
        stats["audio_frames"] = float(codes.sum()) / n
