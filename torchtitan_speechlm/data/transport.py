"""Micro-batches from loader workers to the trainer through reusable shared-memory slots.

torch's DataLoader moves every tensor a worker returns through a fresh shared-memory file: the
worker creates and fills it, passes its descriptor over a socket, the main process maps it, and
both unmap it later. For a micro-batch of a few hundred KB that costs ~1 ms on a 2-core CPU,
more than building the batch (benchmarks/bench_loader.py). Here each worker owns a small ring of
shared buffers and a shared ``busy`` flag per buffer; a buffer and the flags travel to the main
process once, after which a message is only the slot number and a pickled header. The main
process copies the bytes out (the trainer owns ordinary tensors), clears the flag, and the
worker reuses the buffer. A worker never has more micro-batches in flight than the loader's
``prefetch_factor``, so ``prefetch_factor + 2`` slots never wait.

With ``persistent_workers`` torch drops the messages in flight when an iterator is restarted,
which could lose a buffer's first (and only) delivery, so those workers ship each micro-batch in
a buffer of its own (one file per micro-batch, as torch does). Without workers nothing is
copied: the batch is handed over as it is.
"""

from __future__ import annotations

import math
import os
import pickle
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import get_worker_info

LABELS_KEY = "_speechlm_labels"
SLOT_WAIT_S = 600.0  # a slot still busy after this long means the main process stopped reading


Item = tuple[tuple[dict, torch.Tensor], dict]  # ((inputs, labels), meta)


@dataclass
class Local:
    """Micro-batches built in the main process (no loader workers): passed as they are."""

    items: list


@dataclass
class Shipped:
    """Micro-batches in a worker's shared slot. ``buffer`` and ``busy`` are set only on the
    first use of a slot (or of a grown one) and of the ring: torch passes them by descriptor."""

    ring: str
    slot: int
    nbytes: int
    header: bytes  # pickled [(meta, array layout)] per micro-batch
    buffer: torch.Tensor | None = None
    busy: torch.Tensor | None = None


class _Ring:
    """A worker's slots (lives in the worker process)."""

    def __init__(self, slots: int):
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.busy = torch.zeros(slots, dtype=torch.int32).share_memory_()
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.next, self.announced = 0, False

    def claim(self, nbytes: int) -> tuple[int, torch.Tensor, bool]:
        """The next slot, once the main process has released it; grown to ``nbytes``."""
        slot = self.next
        deadline = time.monotonic() + SLOT_WAIT_S
        while int(self.busy[slot]):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"loader worker {os.getpid()}: the main process has not released shared "
                    f"batch slot {slot} in {SLOT_WAIT_S:.0f} s (it stopped reading batches)"
                )
            time.sleep(1e-4)
        self.next = (slot + 1) % len(self.buffers)
        buf, fresh = self.buffers[slot], False
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes + nbytes // 4, dtype=torch.uint8).share_memory_()
            self.buffers[slot], fresh = buf, True
        self.busy[slot] = 1
        return slot, buf, fresh


class Outbox:
    """The worker side: ``ship`` turns built micro-batches into the one message to return."""

    def __init__(self, slots: int, reuse: bool = True):
        self.slots, self.reuse = slots, reuse
        self._ring: _Ring | None = None  # created in the worker that uses it (never in main)

    def ship(self, items: list[Item]) -> Local | Shipped:
        if get_worker_info() is None:
            return Local(items)
        arrays = [{**batch[0], LABELS_KEY: batch[1]} for batch, _ in items]
        specs, nbytes = _layout(arrays)
        header = pickle.dumps([(meta, spec) for (_, meta), spec in zip(items, specs, strict=True)])
        if not self.reuse:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            _fill(buf, specs, arrays)
            return Shipped("", -1, nbytes, header, buffer=buf)
        if self._ring is None:
            self._ring = _Ring(self.slots)
        ring = self._ring
        slot, buf, fresh = ring.claim(nbytes)
        _fill(buf, specs, arrays)
        busy = None if ring.announced else ring.busy
        ring.announced = True
        return Shipped(ring.id, slot, nbytes, header, buf if fresh else None, busy)


class Inbox:
    """The main-process side: ``receive`` turns a message back into its micro-batches
    ``((inputs, labels), meta)`` holding tensors of their own, and releases the worker's slot."""

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.busy: dict[str, torch.Tensor] = {}

    def clear(self) -> None:
        """Forget the rings of workers that are gone (a new iterator starts new workers)."""
        self.buffers.clear()
        self.busy.clear()

    def receive(self, msg: Local | Shipped) -> list[Item]:
        if isinstance(msg, Local):
            if not self.pin_memory:
                return msg.items
            return [
                ((_pinned(inputs), labels.pin_memory()), meta)
                for (inputs, labels), meta in msg.items
            ]
        if msg.slot < 0:  # a buffer of its own
            data = msg.buffer
        else:
            if msg.busy is not None:
                self.busy[msg.ring] = msg.busy
            if msg.buffer is not None:
                self.buffers[(msg.ring, msg.slot)] = msg.buffer
            # numpy's single-threaded copy: torch's clone of a few hundred KB splits the copy
            # over its intra-op threads, which wait for cores the loader workers hold (~1 ms)
            data = torch.from_numpy(self.buffers[(msg.ring, msg.slot)][: msg.nbytes].numpy().copy())
            self.busy[msg.ring][msg.slot] = 0
        if self.pin_memory:
            data = data.pin_memory()
        raw = data.numpy()
        items = []
        for meta, spec in pickle.loads(msg.header):
            arrays = {}
            for key, dtype, shape, start in spec:
                arrays[key] = _view(data, raw, dtype, shape, start)
            labels = arrays.pop(LABELS_KEY)
            items.append(((arrays, labels), meta))
        return items


def _pinned(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.pin_memory() for key, value in inputs.items()}


_NUMPY = {d: np.dtype(d) for d in ("int64", "int32", "float32", "float64", "float16", "bool")}


def _view(data: torch.Tensor, raw: np.ndarray, dtype: str, shape: tuple, start: int):
    """The array at byte ``start`` of ``data`` (numpy's views: torch's cost ~3x per array)."""
    n = math.prod(shape)
    if dtype in _NUMPY:
        dt = _NUMPY[dtype]
        return torch.from_numpy(raw[start : start + n * dt.itemsize].view(dt).reshape(shape))
    dt = getattr(torch, dtype)  # e.g. bfloat16, which numpy lacks
    return data[start : start + n * dt.itemsize].view(dt).view(shape)


def _layout(arrays: list[dict[str, torch.Tensor]]) -> tuple[list[list], int]:
    """Per micro-batch, (key, dtype, shape, byte offset) of each array in one buffer, 8-byte
    aligned."""
    specs, offset = [], 0
    for group in arrays:
        spec = []
        for key, t in group.items():
            spec.append((key, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
            offset += -(-t.numel() * t.element_size() // 8) * 8
        specs.append(spec)
    return specs, offset


def _fill(buf: torch.Tensor, specs: list[list], arrays: list[dict[str, torch.Tensor]]) -> None:
    raw = buf.numpy()
    for spec, group in zip(specs, arrays, strict=True):
        for (_, dtype, _, start), t in zip(spec, group.values(), strict=True):
            n = t.numel() * t.element_size()
            if dtype in _NUMPY:
                raw[start : start + n] = t.contiguous().numpy().reshape(-1).view(np.uint8)
            else:
                buf[start : start + n] = t.contiguous().view(-1).view(torch.uint8)
