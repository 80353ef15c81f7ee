"""Benchmark `torchtitan prepare`: seconds of audio prepared per second of wall time.

Corpus: espeak-ng speech from ``demo_assets.synthesize_corpus`` (cached). Codecs: the tiny
random-init Encodec of the tests (``demo_assets.build_codec``) and a k-means codec fitted on
the corpus itself (its fit time and round-trip quality are reported too). Each codec is run
with 1 worker process (all cores' threads, then 1 thread) and 2 worker processes. Wall time
includes loading the codec, planning and starting workers. Prints a table and writes ``benchmarks/results/prepare.json``
(``--out``). Not a test: `python benchmarks/bench_prepare.py [--n 200] [--cache DIR]`. Smallest
setting (a smoke test of the script): ``--n 8 --held-out 2 --codecs kmeans --cache DIR
--out FILE``.

``--lhotse``: the same corpus three ways, the JSONL manifest of wav files (``--manifest``, our
own reader), lhotse cuts of those wavs (``--lhotse cuts.jsonl.gz``) and a Shar directory of the
cuts (``--lhotse-shar``, flac in tars), prepared with the tiny Encodec, interleaved
(``--repeats``), with 1 and 2 workers of 1 thread; reports each run's wall time and planning
time (reading the source: for Shar the tar headers too), the median throughputs and their
ratios; writes ``benchmarks/results/prepare_lhotse.json``.

``--parts N``: 1 part vs N concurrent ``torchtitan prepare --part i/N`` processes (1 torch
thread each, k-means codec, the corpus ``--copies`` times over), interleaved ``--repeats``;
reports the walls, each part's CPU time, the fixed cost of one process (a rerun of the finished
dataset), the speed-ups, and whether the joined dataset equals the one-part one byte for byte;
writes ``benchmarks/results/prepare_parts.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.tiny_codecs import build_codec  # noqa: E402  (the tests' tiny Encodec)
from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.codecs.kmeans import fit_kmeans_codec, log_mel_distance
from torchtitan_speechlm.demo import assets as demo_assets
from torchtitan_speechlm.prepare.pipeline import prepare_dataset
from torchtitan_speechlm.prepare.sources.jsonl import read_jsonl_manifest
from torchtitan_speechlm.utils.audio import load_audio

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "prepare.json")


def build_assets(cache: str, n: int) -> dict:
    sentences = demo_assets.load_sentences()
    paths = {k: os.path.join(cache, k) for k in ("tok", "encodec", "corpus", "kmeans")}
    if not os.path.isfile(os.path.join(paths["tok"], "tokenizer.json")):
        demo_assets.build_tokenizer(paths["tok"], sentences)
    if not os.path.isfile(os.path.join(paths["encodec"], "config.json")):
        build_codec(paths["encodec"], "encodec")
    paths["manifest"] = demo_assets.synthesize_corpus(paths["corpus"], sentences, n=n)
    return paths


def kmeans_fit(paths: dict, held_out: int = 10) -> dict:
    """Fit 4 x 256 on all but the last ``held_out`` utterances; report time and quality."""
    wavs = [load_audio(it.audio, 16000) for it in read_jsonl_manifest(paths["manifest"])]
    shutil.rmtree(paths["kmeans"], ignore_errors=True)
    t0 = time.perf_counter()
    fit_kmeans_codec(wavs[:-held_out], paths["kmeans"], num_codebooks=4, codebook_size=256)
    fit_s = time.perf_counter() - t0
    codec = load_codec(paths["kmeans"])
    rng = np.random.default_rng(0)
    rt, noise, usage = [], [], []
    for w in wavs[-held_out:]:
        codes = codec.encode([w])[0]
        rt.append(log_mel_distance(w, codec.decode(codes)))
        n = (rng.standard_normal(len(w)) * np.sqrt(np.mean(w**2))).astype(np.float32)
        noise.append(log_mel_distance(w, n))
    codes = np.concatenate(codec.encode(wavs[-held_out:]))
    usage = [len(np.unique(codes[:, k])) / 256 for k in range(4)]
    return {
        "fit_audio_minutes": round(sum(len(w) for w in wavs[:-held_out]) / 16000 / 60, 2),
        "fit_seconds": round(fit_s, 2),
        "heldout_roundtrip_logmel_db": round(float(np.mean(rt)), 2),
        "heldout_noise_logmel_db": round(float(np.mean(noise)), 2),
        "heldout_codebook_usage": [round(u, 3) for u in usage],
    }


def run(paths: dict, codec: str, workers: int, shard_size: int, threads: int,
        source: tuple[str, str] | None = None) -> dict:  # fmt: skip
    """One preparation (of the JSONL manifest, or of ``source``); ``threads`` = torch intra-op
    threads of the in-process worker (worker processes get cpu_count // workers each)."""
    out = tempfile.mkdtemp(prefix="bench_prepare_")
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        s = prepare_dataset(None if source else paths["manifest"], codec, paths["tok"],
                            os.path.join(out, "ds"), batch_size=8, progress=False,
                            workers=workers, shard_size=shard_size, source=source)  # fmt: skip
        wall = time.perf_counter() - t0
    finally:
        torch.set_num_threads(default_threads)
        shutil.rmtree(out, ignore_errors=True)
    threads = threads if workers == 1 else max(1, (os.cpu_count() or 1) // workers)
    return {"codec": os.path.basename(codec), "workers": workers, "threads_per_worker": threads,
            "items": s["num_items"],
            "audio_seconds": s["total_audio_seconds"], "wall_seconds": round(wall, 2),
            "audio_s_per_s": round(s["total_audio_seconds"] / wall, 1)}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="utterances (default 200, ~9 min)")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "speechlm_bench_prepare"))
    p.add_argument("--shard-size", type=int, default=25)
    p.add_argument("--held-out", type=int, default=10, help="k-means codec: utterances not fitted")
    p.add_argument("--codecs", default="encodec,kmeans", help="the codecs to prepare with")
    p.add_argument("--out", default=None, help="results file (default: results/prepare.json, "
                   "with --lhotse results/prepare_lhotse.json)")  # fmt: skip
    p.add_argument("--lhotse", action="store_true",
                   help="compare lhotse Shar with the same cuts as JSONL + wav files")  # fmt: skip
    p.add_argument("--repeats", type=int, default=2, help="--lhotse/--parts: runs of each")
    p.add_argument("--copies", type=int, default=1,
                   help="--parts: the corpus K times over (new ids, same wavs), so that encoding "
                   "outweighs each process' start (imports, planning, codec)")  # fmt: skip
    p.add_argument("--device", default="cpu",
                   help="--parts: the codec's device; cuda: part i on cuda:i (gpu_check.py)")  # fmt: skip
    p.add_argument("--parts", type=int, default=0, metavar="N",
                   help="scaling of `torchtitan prepare --part i/N`: 1 part (one process) vs N "
                   "parts (N concurrent processes), each of 1 torch thread, k-means codec; "
                   "checks the joined dataset equals the one-part one")  # fmt: skip
    return p


def lhotse_corpus(paths: dict) -> dict:
    """The corpus as a lhotse cut manifest (of the wav files) and as a Shar directory (flac)."""
    from lhotse import CutSet, Recording, SupervisionSegment

    root = os.path.join(os.path.dirname(paths["manifest"]), "lhotse")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.join(root, "shar"))
    cuts = []
    for it in read_jsonl_manifest(paths["manifest"]):
        rec = Recording.from_file(it.audio, recording_id=it.id)
        cut = rec.to_cut()
        cut.supervisions = [SupervisionSegment(it.id, it.id, 0.0, rec.duration, text=it.text)]
        cuts.append(cut)
    cuts = CutSet.from_cuts(cuts)
    cuts.to_file(os.path.join(root, "cuts.jsonl.gz"))
    cuts.to_shar(os.path.join(root, "shar"), fields={"recording": "flac"}, shard_size=100)
    return {
        "lhotse": os.path.join(root, "cuts.jsonl.gz"),
        "lhotse_shar": os.path.join(root, "shar"),
    }


def lhotse_main(args, paths: dict) -> dict:
    from torchtitan_speechlm.prepare.sources import read_source

    sources = {"manifest": paths["manifest"], **lhotse_corpus(paths)}
    rows = []
    for _ in range(args.repeats):
        for workers, threads in ((1, 1), (2, 1)):
            for name, path in sources.items():  # alternated: both see the same machine load
                t0 = time.perf_counter()
                read_source(name, path)
                plan_s = time.perf_counter() - t0
                r = run(paths, paths["encodec"], workers, args.shard_size, threads, (name, path))
                rows.append(dict(r, source=name, plan_seconds=round(plan_s, 3)))
    medians, ratios = {}, {}
    for workers in (1, 2):
        med = {n: float(np.median([r["audio_s_per_s"] for r in rows if r["source"] == n
                                   and r["workers"] == workers])) for n in sources}  # fmt: skip
        medians[f"workers_{workers}"] = med
        ratios[f"workers_{workers}"] = {
            "shar_over_lhotse_jsonl": round(med["lhotse_shar"] / med["lhotse"], 3),
            "lhotse_jsonl_over_manifest": round(med["lhotse"] / med["manifest"], 3),
        }
    print_table(rows, ("source", "workers", "items", "audio_seconds", "plan_seconds",
                       "wall_seconds", "audio_s_per_s"))  # fmt: skip
    print("median audio s/s:", json.dumps(medians))
    print("ratios of medians:", json.dumps(ratios))
    return {"runs": rows, "median_audio_s_per_s": medians, "ratios": ratios}


def _tree(out: str) -> dict:
    res = {}
    for d, dirs, files in os.walk(out):
        dirs[:] = [x for x in dirs if x != ".prepare"]
        for f in files:
            if f != "summary.json":
                with open(os.path.join(d, f), "rb") as fh:
                    res[os.path.relpath(os.path.join(d, f), out)] = fh.read()
    return res


def parts_run(paths: dict, n_parts: int, shard_size: int, device: str = "cpu") -> dict:
    """``n_parts`` concurrent ``torchtitan prepare --part i/N`` processes (1 thread each); with
    ``device="cuda"`` part i has ``LOCAL_RANK=i``, so its codec runs on ``cuda:i`` (what a
    torchrun launch gives it: prepare/parts.py, ``part_device``)."""
    import subprocess

    out = tempfile.mkdtemp(prefix="bench_parts_")
    exe = shutil.which("torchtitan", path=os.path.dirname(sys.executable))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [exe, "prepare", "--manifest", paths["manifest"], "--codec", paths["kmeans"],
           "--tokenizer", paths["tok"], "--out-dir", os.path.join(out, "ds"), "--shard-size",
           str(shard_size), "--no-progress", "--device", device]  # fmt: skip
    t0 = time.perf_counter()
    logs = [open(os.path.join(out, f"part{i}.log"), "w+") for i in range(n_parts)]
    procs = [subprocess.Popen([*cmd, "--part", f"{i}/{n_parts}"], env=dict(env, LOCAL_RANK=str(i)),
                              stdout=subprocess.DEVNULL, stderr=logs[i])
             for i in range(n_parts)]  # fmt: skip
    cpu = []
    for p, log in zip(procs, logs, strict=True):
        _, status, ru = os.wait4(p.pid, 0)  # the part's own CPU time (user + sys)
        p.returncode = os.waitstatus_to_exitcode(status)
        cpu.append(round(ru.ru_utime + ru.ru_stime, 2))
        log.seek(0)
        if p.returncode:
            raise RuntimeError(log.read()[-2000:])
        log.close()
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "ds", "summary.json")) as f:
        s = json.load(f)
    return {"parts": n_parts, "out": out, "items": s["num_items"],
            "audio_seconds": s["total_audio_seconds"], "wall_seconds": round(wall, 2),
            "audio_s_per_s": round(s["total_audio_seconds"] / wall, 2),
            "cpu_seconds_per_part": cpu, "cpu_seconds_max_part": max(cpu)}  # fmt: skip


def copied_manifest(paths: dict, copies: int) -> str:
    """The corpus manifest ``copies`` times over, each copy's ids suffixed (same wavs)."""
    if copies == 1:
        return paths["manifest"]
    out = paths["manifest"].replace(".jsonl", f"_x{copies}.jsonl")
    base = os.path.dirname(paths["manifest"])
    with open(paths["manifest"]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(out, "w") as f:
        for k in range(copies):
            for r in rows:
                f.write(json.dumps(dict(r, id=f"{r['id']}_{k}",
                                        audio=os.path.join(base, r["audio"]))) + "\n")  # fmt: skip
    return out


def parts_main(args, paths: dict) -> dict:
    """1 part vs ``args.parts`` parts, interleaved ``args.repeats`` times; the speed-up is the
    ratio of the median walls (ideal: N, if the machine has N free cores). Also the wall of a
    rerun of the finished dataset (nothing to encode: each process' fixed cost of starting,
    planning and loading the codec), and the speed-up of the walls less that cost."""
    paths = dict(paths, manifest=copied_manifest(paths, args.copies))
    rows, same = [], True
    for _ in range(args.repeats):
        one = parts_run(paths, 1, args.shard_size, args.device)
        many = parts_run(paths, args.parts, args.shard_size, args.device)
        same = same and _tree(os.path.join(one["out"], "ds")) == _tree(
            os.path.join(many["out"], "ds"))  # fmt: skip
        for r in (one, many):
            shutil.rmtree(r.pop("out"), ignore_errors=True)
            rows.append(r)
    med = {n: float(np.median([r["wall_seconds"] for r in rows if r["parts"] == n]))
           for n in (1, args.parts)}  # fmt: skip
    speedup = round(med[1] / med[args.parts], 3)
    fixed = fixed_cost(paths, args.shard_size, args.device)
    net = round((med[1] - fixed) / max(med[args.parts] - fixed, 1e-9), 3)
    # on a machine without N free cores, the walls say little: the longest part's CPU time is
    # what its wall would be on a core of its own
    cpu = {n: float(np.median([r["cpu_seconds_max_part"] for r in rows if r["parts"] == n]))
           for n in (1, args.parts)}  # fmt: skip
    cpu_speedup = round(cpu[1] / cpu[args.parts], 3)
    print_table(rows, ("parts", "items", "audio_seconds", "wall_seconds", "audio_s_per_s",
                       "cpu_seconds_max_part"))  # fmt: skip
    print(
        f"median CPU seconds of the longest part: {cpu}; speed-up by CPU time "
        f"{cpu_speedup}x ({cpu_speedup / args.parts:.0%} of ideal)"
    )
    print(f"median wall: {med}; speed-up of {args.parts} parts: {speedup}x "
          f"({speedup / args.parts:.0%} of ideal); fixed cost per process {fixed:.2f}s, "
          f"speed-up without it {net}x; joined == one part byte for byte: {same}; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")  # fmt: skip
    return {"runs": rows, "median_wall_seconds": med, "speedup": speedup,
            "efficiency": round(speedup / args.parts, 3), "fixed_seconds": fixed,
            "speedup_less_fixed": net, "median_cpu_seconds_longest_part": cpu,
            "speedup_by_cpu_time": cpu_speedup, "identical": same}  # fmt: skip


def fixed_cost(paths: dict, shard_size: int, device: str = "cpu") -> float:
    """Wall of one process rerunning a finished dataset (starts, plans, loads, encodes none)."""
    import subprocess

    out = tempfile.mkdtemp(prefix="bench_parts_fixed_")
    exe = shutil.which("torchtitan", path=os.path.dirname(sys.executable))
    cmd = [exe, "prepare", "--manifest", paths["manifest"], "--codec", paths["kmeans"],
           "--tokenizer", paths["tok"], "--out-dir", os.path.join(out, "ds"), "--shard-size",
           str(shard_size), "--no-progress", "--device", device]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_RANK="0")
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    walls = []
    for _ in range(2):
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        walls.append(time.perf_counter() - t0)
    shutil.rmtree(out, ignore_errors=True)
    return round(min(walls), 2)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    paths = build_assets(args.cache, args.n)
    if args.parts:
        if not os.path.isfile(os.path.join(paths["kmeans"], "config.json")):
            kmeans_fit(paths, args.held_out)
        results = parts_main(args, paths)
        corpus = {"utterances": args.n, "shard_size": args.shard_size, "batch_size": 8,
                  "codec": "k-means 4 x 256", "threads_per_part": 1,
                  "copies": args.copies, "device": args.device}  # fmt: skip
        write_results(args.out or RESULTS.replace("prepare.json", "prepare_parts.json"),
                      dict(machine=machine(), corpus=corpus, **results))  # fmt: skip
        return
    if args.lhotse:
        results = lhotse_main(args, paths)
        corpus = {"utterances": args.n, "shard_size": args.shard_size, "batch_size": 8,
                  "codec": "tiny encodec (tests)", "shar_audio": "flac"}  # fmt: skip
        write_results(args.out or RESULTS.replace("prepare.json", "prepare_lhotse.json"),
                      dict(machine=machine(), corpus=corpus, **results))  # fmt: skip
        return
    km = kmeans_fit(paths, args.held_out)
    ncpu = os.cpu_count() or 1
    configs = [(1, ncpu), (1, 1), (2, 1)] if ncpu > 1 else [(1, 1), (2, 1)]
    rows = [run(paths, paths[c], w, args.shard_size, t) for c in args.codecs.split(",")
            for w, t in configs]  # fmt: skip
    print_table(rows, ("codec", "workers", "threads_per_worker", "items", "audio_seconds",
                       "wall_seconds", "audio_s_per_s"))  # fmt: skip
    print("k-means codec:", json.dumps(km))
    result = {
        "machine": machine(),
        "corpus": {"utterances": args.n, "shard_size": args.shard_size, "batch_size": 8},
        "runs": rows,
        "kmeans_codec": km,
    }
    write_results(args.out or RESULTS, result)


def print_table(rows: list[dict], keys: tuple[str, ...]) -> None:
    """One column per key (the first left-aligned), floats with 2 decimals."""
    widths = [max(len(k), *(len(_cell(r[k])) for r in rows)) for k in keys]
    print(" ".join(k.ljust(w) if i == 0 else k.rjust(w)
                   for i, (k, w) in enumerate(zip(keys, widths, strict=True))))  # fmt: skip
    for r in rows:
        print(" ".join(_cell(r[k]).ljust(w) if i == 0 else _cell(r[k]).rjust(w)
                       for i, (k, w) in enumerate(zip(keys, widths, strict=True))))  # fmt: skip


def _cell(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def write_results(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
