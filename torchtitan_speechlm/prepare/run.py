"""Running the shards of ``torchtitan prepare`` (in process or in worker processes) with a
progress line, and fitting a codec (k-means, mel, WORLD) on a sample of the input audio.

Worker processes each load their own codec (on ``--device``), so they scale to several GPUs'
worth of work or to several CPU cores; they are started by a forkserver (CPU, Linux) or spawned,
never forked from this process (see ``worker_context``). Shard results only travel back as small dicts;
progress travels over a queue.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from array import array
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

import numpy as np

from torchtitan_speechlm.codecs import CodecError
from torchtitan_speechlm.codecs.fitting import FitSettings, Fitter
from torchtitan_speechlm.data.keyed_order import keyed_order, round_keys
from torchtitan_speechlm.prepare.parts import worker_devices
from torchtitan_speechlm.prepare.sources.hf import HFAudioReader
from torchtitan_speechlm.prepare.spill import CHUNK
from torchtitan_speechlm.prepare.worker import (
    ShardTask,
    WorkerConfig,
    init_worker,
    load_ref,
    run_shard,
    use_in_process,
)
from torchtitan_speechlm.utils.audio import BadAudioError
from torchtitan_speechlm.utils.progress import Progress


class ItemProgress:
    """A throttled 'items done / total, audio s/s, ETA' line on stderr, and between lines the
    heartbeat of utils/progress.py (workers starting, a long shard: never silent for long)."""

    def __init__(self, total: int, enabled: bool, every_s: float = 2.0):
        self.total, self.every_s = total, every_s
        self.line = Progress("prepare", enabled)
        self.line.status = f"encoding: 0/{total} items (starting)"
        self.start = self.last = time.monotonic()
        self.done, self.seconds = 0, 0.0

    def add(self, items: int, seconds: float) -> None:
        self.done += items
        self.seconds += seconds
        self.line.status = f"encoding: {self.done}/{self.total} items"
        now = time.monotonic()
        if now - self.last < self.every_s and self.done < self.total:
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        eta = (self.total - self.done) * elapsed / max(self.done, 1)
        self.line.say(f"{self.done}/{self.total} items, {self.seconds / elapsed:.1f} audio s/s, "
                      f"elapsed {elapsed:.0f}s, ETA {eta:.0f}s")  # fmt: skip


def run_shards(tasks: Iterable[ShardTask], out_dir: str, cfg: WorkerConfig, workers: int,
               codec, tok, progress: bool, total: int | None = None,
               count: int | None = None) -> float:  # fmt: skip
    """Prepare every task's shard; return the seconds of audio encoded. ``tasks`` may be a
    generator (each shard's items taken when its task is handed out: at most 2 x workers are
    in flight); ``total`` items in ``count`` tasks (default: counted from a list)."""
    if total is None or count is None:
        tasks = list(tasks)
        total, count = sum(len(t.items) for t in tasks), len(tasks)
    bar = ItemProgress(total, progress)
    if not count:
        return 0.0
    with bar.line:
        return _run_shards(tasks, out_dir, cfg, workers, codec, tok, bar, count)


def _run_shards(tasks, out_dir: str, cfg: WorkerConfig, workers: int, codec, tok,
                bar: ItemProgress, count: int) -> float:  # fmt: skip
    if workers == 1:
        use_in_process(cfg, codec, tok, bar.add)
        for t in tasks:
            run_shard(t, out_dir)
        return bar.seconds
    ctx = worker_context(cfg.device)
    queue = ctx.Queue()
    n = min(workers, count)
    threads = None if "OMP_NUM_THREADS" in os.environ else max(1, (os.cpu_count() or 1) // n)
    devices = worker_devices(cfg.device, n)
    device_queue = None
    if len(set(devices)) > 1:  # several GPUs: each worker takes one (init_worker)
        device_queue = ctx.Queue()
        for d in devices:
            device_queue.put(d)
    initargs = (cfg, queue, threads, device_queue, os.getpid())  # the workers' owner: this process
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=init_worker, initargs=initargs) as pool:
        tasks = iter(tasks)
        pending = {pool.submit(run_shard, t, out_dir) for t in itertools.islice(tasks, 2 * n)}
        try:
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                while not queue.empty():
                    bar.add(*queue.get())
                for f in done:
                    f.result()  # re-raises a worker's error (e.g. strict mode)
                pending |= {pool.submit(run_shard, t, out_dir)
                            for t in itertools.islice(tasks, len(done))}  # fmt: skip
        except BaseException:
            for f in pending:
                f.cancel()
            raise
    while not queue.empty():
        bar.add(*queue.get())
    return bar.seconds


def worker_context(device: str):
    """A start method that is safe after this process used torch: never ``fork``.

    A forked child inherits torch's intra-op thread pool in a broken state once the parent has
    run a parallel op (fitting the k-means codec, a user's script, a notebook), and then sleeps
    for ever on a futex at its first parallel op. ``forkserver`` forks workers from a clean
    server process that has imported, but never run, torch (fast starts); ``spawn`` where there
    is no forkserver, and with CUDA."""
    import multiprocessing as mp

    if device.startswith("cuda") or sys.platform != "linux":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torchtitan_speechlm.prepare.worker"])
    return ctx


PERMUTED = 1 << 20  # up to this many audio references: numpy's permutation of them (8 MB)
_KEY_SALT = 0x6B6D  # the keyed order's salt ("km"): not the data loaders' orders


def _refs(it) -> list:
    if it.turns is not None:
        return [t.audio for t in it.turns if t.audio is not None]
    return [it.ref] if it.ref is not None else []


class AudioRefs:
    """The input's audio references by number (items in order, a dialogue's audio turns in
    turn order), in O(items / BLOCK) memory: one pass counts them per block of items (a spill
    chunk), and reference ``r`` is found by reading its block only."""

    BLOCK = CHUNK

    def __init__(self, items):
        self.items, ends, count = items, array("Q"), 0
        for k, it in enumerate(items):
            count += len(_refs(it))
            if (k + 1) % self.BLOCK == 0 or k + 1 == len(items):
                ends.append(count)  # the references before the end of each block
        self.ends = np.array(ends, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, r: int):
        b = int(np.searchsorted(self.ends, r, side="right"))
        k = r - (int(self.ends[b - 1]) if b else 0)
        for it in self.items[b * self.BLOCK : (b + 1) * self.BLOCK]:
            refs = _refs(it)
            if k < len(refs):
                return refs[k]
            k -= len(refs)
        raise IndexError(f"audio reference {r} of {len(self)}")


def fit_order(n: int, seed: int, block: int = 256) -> Iterator[int]:
    """The order (``seed``) in which a k-means fit reads the ``n`` audio references until it
    has enough seconds: numpy's permutation up to ``PERMUTED`` references (the choice of
    every earlier release, so their fits are refitted the same), above that a keyed
    permutation evaluated ``block`` positions at a time (data/keyed_order.py: no array of
    ``n``; another choice of audio than a permutation would make)."""
    if n <= PERMUTED:
        yield from (int(j) for j in np.random.default_rng(seed).permutation(n))
        return
    keys = round_keys(seed, 0, 0, _KEY_SALT)
    for a in range(0, n, block):
        yield from (int(j) for j in keyed_order(np.arange(a, min(a + block, n)), n, keys))


def fit_or_reuse_codec(fitter: Fitter, out: str, items, settings: FitSettings,
                       seconds: float, overwrite: bool, progress: bool,
                       hf_reader=None) -> str:  # fmt: skip
    """Return a codec folder of ``fitter``'s kind (codecs/fitting.py): ``out`` as is if it
    already holds one fitted with these settings (so reruns are cheap and stable), else fit one
    on ``seconds`` of randomly chosen (``settings.seed``, ``fit_order``) input audio, read a
    reference at a time. Less audio than ``seconds`` is refused with the fix, and so is a
    folder holding another fit (unless ``overwrite``); nothing is written then."""
    flag = f"--fit-{fitter.kind}-codec"
    size = fitter.size(settings)
    cfg_file = os.path.join(out, "config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            have = json.load(f)
        want = {"model_type": fitter.model_type, "sample_rate": fitter.sample_rate,
                **fitter.want(settings, size)}  # fmt: skip
        if all(have.get(k) == v for k, v in want.items()):
            return out
        if not overwrite:
            differ = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
            raise CodecError(
                f"{out} already holds a codec fitted with other settings ("
                + ", ".join(f"{k} {a} there, {b} asked" for k, (a, b) in differ.items())
                + f"); pass --overwrite to refit it, or choose another {flag} folder"
            )
    with Progress("prepare", progress) as said:
        said.say(f"reading {seconds:g} s of audio to fit the {fitter.label} codec {out} on")
        wavs, total = _fit_audio(fitter, items, settings, seconds, hf_reader, said)
        _check_fit_audio(wavs, total, seconds, flag)
        said.say(f"fitting the {fitter.label} codec on {total:.0f}s of audio")
        t0 = time.monotonic()
        fitter.fit(wavs, out, settings, size)
        said.say(f"fitted {fitter.label} codec {out} on {total:.0f}s of audio "
                 f"({time.monotonic() - t0:.1f}s)")  # fmt: skip
    return out


def _fit_audio(fitter: Fitter, items, settings: FitSettings, seconds: float, hf_reader,
               said: Progress) -> tuple[list, float]:  # fmt: skip
    """Randomly chosen readable input audio (``fit_order``) until ``seconds`` are read."""
    sr = fitter.sample_rate
    reader = HFAudioReader(*hf_reader) if hf_reader else None
    refs = AudioRefs(items)  # (a list of every reference would be O(items))
    wavs, total = [], 0.0
    for j in fit_order(len(refs), settings.seed):
        try:
            w = load_ref(refs[j], sr, reader)
        except BadAudioError:
            continue  # reported later, when the item itself is prepared
        wavs.append(w)
        total += len(w) / sr
        said.status = f"reading audio to fit the codec on: {total:.0f} of {seconds:g} s"
        if total >= seconds:
            break
    return wavs, total


def _check_fit_audio(wavs: list, total: float, seconds: float, flag: str) -> None:
    if not wavs:
        raise CodecError(f"cannot fit a codec ({flag}): no readable audio in the input")
    if total < seconds:
        raise CodecError(
            f"{flag}: --kmeans-seconds {seconds:g} asks for {seconds:g} s of audio to fit the "
            f"codec on, the input has {total:.0f} s; pass --kmeans-seconds {int(total)} to fit "
            "on all of it (a codec serves the voices it was fitted on), or give more audio"
        )
