"""A source's items on disk, so that planning holds O(shards) in memory, not O(items).

``torchtitan prepare`` reads a source, checks its texts, plans its shards (a hash of each
shard's inputs) and hands each shard's items to an encoder. Held as a list, the items cost ~600
bytes each in every part (180 GB at 3x10^8). ``SpilledItems`` writes them as pickled chunks of
``CHUNK`` items to a temporary file while the source is read, and keeps only each chunk's
offset: iteration reads the file once in order, indexing and slicing read the chunks they need
(the last one read is kept). Anything that walks the items (the plan, the strict precheck, the
tokenizer check's two passes) or takes a shard's slice works unchanged.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Iterator, Sequence

from torchtitan_speechlm.data.format import gc_paused

CHUNK = 1024


class SpilledItems(Sequence):
    """Items appended once (``append``, then ``seal``), then read as a sequence."""

    def __init__(self, folder: str | None = None):
        fd, self.path = tempfile.mkstemp(prefix="speechlm-items-", suffix=".pkl", dir=folder)
        self._file = os.fdopen(fd, "w+b")
        os.unlink(self.path)  # the open file is all there is: it goes with the process
        self._offsets: list[int] = []
        self._buffer: list = []
        self._n = 0
        self._cached: tuple[int, list] = (-1, [])

    def append(self, item) -> None:
        self._buffer.append(item)
        self._n += 1
        if len(self._buffer) == CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self._buffer:
            self._file.seek(0, os.SEEK_END)
            self._offsets.append(self._file.tell())
            pickle.dump(self._buffer, self._file, protocol=pickle.HIGHEST_PROTOCOL)
            self._buffer = []

    def seal(self) -> SpilledItems:
        """The last chunk written; returns self (reading may start)."""
        self._flush()
        self._file.flush()
        return self

    def _chunk(self, c: int) -> list:
        if self._cached[0] != c:
            self._file.seek(self._offsets[c])
            with gc_paused():  # 1,024 objects: collections would walk every object (4x slower)
                self._cached = (c, pickle.load(self._file))
        return self._cached[1]

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator:
        for c in range(len(self._offsets)):
            yield from self._chunk(c)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step != 1:
                return [self[k] for k in range(start, stop, step)]
            out: list = []  # a chunk at a time
            for c in range(start // CHUNK, -(-stop // CHUNK) if stop > start else 0):
                first = c * CHUNK
                out += self._chunk(c)[max(start - first, 0) : stop - first]
            return out
        k = int(i)
        if not -self._n <= k < self._n:
            raise IndexError(f"item {k} of {self._n}")
        k %= self._n
        return self._chunk(k // CHUNK)[k % CHUNK]

    def __getstate__(self):  # never sent to a worker process: shards' slices are
        raise TypeError("SpilledItems stays in the process that read the source")
