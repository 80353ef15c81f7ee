"""Reading corpora of 10^5..10^7 utterances (issue 38): what one rank of dp 8 pays to open a
prepared dataset and reach its first batch, in time, memory and open files.

    python benchmarks/bench_scale.py --work /tmp/scale --out benchmarks/results/scale_cpu.json
    python benchmarks/bench_scale.py --work /tmp/scale --scales 100000:100 --no-prepare  # quick

``--repeats K``: K rank and resume runs per scale, the median reported (each run's beside it).
``--order permutation``: the runs with ``speechlm_data.order = "permutation"`` (the order of
stream version 1; the default, ``auto``, is ``keyed`` for a new run: data/keyed_order.py).

A real small prepared dataset (``tests/helpers.make_tiny_run_assets``: tones through the real
``torchtitan prepare``) is replicated into N items in S shards in the real format: new ids in
each shard's ``items.jsonl`` and ``columns.npy``, the arrays hard-linked, a valid
``metadata.json`` (sizes and sha256s). Each measurement is a fresh process under ``ulimit -n
1024`` that goes through the product's own path (``trainer/run.py: prepare_run``,
``data/catalog.py: open_prepared``, ``trainer/builders.py: stream``) with the 1.7B recipe's
batch layout (pack, local batch 4, global batch 128 = dp 8 x accumulation 4, seq_len 4096,
``tts:0.7`` + ``asr:0.3``) as rank 3 of dp 8:

- ``launcher``: ``torchtitan train``'s pre-start data checks (``check_data``: the training
  stream and the validation set built once; ``check_training_data``: the tokenizer round trip
  of sampled items), first on a dataset never opened (it builds the mapped index and verifies
  every byte once, ``verify_shards = "full"``), then again;
- ``rank``: with the launcher's checked index keys in its environment, as ``torchtitan train``
  starts its ranks (data/index_store.py: ``CHECKED_ENV``): open (``open_prepared``), start -> first micro-batch (after the torch and
  transformers imports, which are timed apart), memory (``RssAnon``: private, anonymous; ``RssFile``: file pages,
  the page cache the ranks of a node share), open descriptors, per-batch time;
- ``resume``: a fresh rank loading a position deep into an epoch (90% through every shard's
  share, epoch 3), start -> its first micro-batch;
- prepare's planning (reading a JSONL manifest and ``build_plan``), per item.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

NOFILE = 1024
SEED_ITEMS = 200
DP, RANK = 8, 3
TOML = """
[job]
dump_folder = "{dump}"
custom_config_module = "torchtitan_speechlm.config"
[experimental]
custom_import = "torchtitan_speechlm"
[model]
name = "speechlm"
flavor = "hf"
hf_assets_path = "{backbone}"
[speechlm]
pattern = "delay"
[speechlm_data]
datasets = ["train={prepared}", "dev={dev}"]
train = ["tts:train:0.7", "asr:train:0.3"]
valid = ["asr:dev"]
seed = 0
order = "{order}"
[training]
local_batch_size = 4
global_batch_size = 128
seq_len = 4096
steps = 10
[validation]
enable = true
local_batch_size = 4
seq_len = 4096
[checkpoint]
enable = false
"""


# ---- the synthetic datasets -------------------------------------------------------------------
def seed_assets(work: str) -> dict:
    """Tokenizer, codec, backbone and a real prepared dataset of SEED_ITEMS items (made once)."""
    root = os.path.join(work, "assets")
    paths = {k: os.path.join(root, k) for k in ("tokenizer", "codec", "backbone", "prepared")}
    if not os.path.isfile(os.path.join(paths["prepared"], "metadata.json")):
        from tests.helpers import make_tiny_run_assets

        shutil.rmtree(root, ignore_errors=True)
        make_tiny_run_assets(root, n_items=SEED_ITEMS)
    return paths


def synthesise(seed: str, out: str, n_items: int, n_shards: int) -> float:
    """``seed`` replicated into ``n_items`` items in ``n_shards`` shards at ``out`` (the real
    format, arrays hard-linked); returns the seconds it took (0 if it exists)."""
    if os.path.isfile(os.path.join(out, "metadata.json")):
        return 0.0
    from torchtitan_speechlm.data.format import COLUMN_DTYPE, id_hash

    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    meta = json.load(open(os.path.join(seed, "metadata.json")))
    (s0,) = meta["shards"]
    sdir0 = os.path.join(seed, "shards", s0["name"])
    lines = open(os.path.join(sdir0, "items.jsonl"), "rb").read().splitlines(keepends=True)
    cols0 = np.load(os.path.join(sdir0, "columns.npy"))
    smeta = json.load(open(os.path.join(sdir0, "shard.json")))
    tails = []  # each seed line after its id's value
    for line in lines:
        head = b'{"id": "'
        assert line.startswith(head)
        end = line.index(b'"', len(head))
        tails.append(line[end:])
    per = n_items // n_shards
    assert per * n_shards == n_items
    pick = np.arange(per) % len(lines)  # shard item k is seed item k % SEED_ITEMS
    shards = []
    os.makedirs(os.path.join(out, "shards"))
    for s in range(n_shards):
        name = f"{s:05d}"
        sdir = os.path.join(out, "shards", name)
        os.makedirs(sdir)
        for f in ("text_tokens.npy", "audio_codes.npy"):
            os.link(os.path.join(sdir0, f), os.path.join(sdir, f))
        ids = [f"syn{s:06d}i{k:05d}" for k in range(per)]
        body = [
            b'{"id": "' + i.encode() + tails[j] for i, j in zip(ids, pick.tolist(), strict=True)
        ]
        items = b"".join(body)
        cols = cols0[pick].copy()
        cols["line"] = np.concatenate([[0], np.cumsum([len(b) for b in body])[:-1]])
        cols["id_hash"] = [id_hash(i) for i in ids]
        with open(os.path.join(sdir, "items.jsonl"), "wb") as f:
            f.write(items)
        with open(os.path.join(sdir, "columns.npy"), "wb") as f:
            np.save(f, cols.astype(COLUMN_DTYPE))
        sm = dict(smeta, num_items=per)
        with open(os.path.join(sdir, "shard.json"), "w") as f:
            json.dump(sm, f)
        files = dict(s0["files"])
        files["items.jsonl"] = {"bytes": len(items), "sha256": hashlib.sha256(items).hexdigest()}
        cbytes = open(os.path.join(sdir, "columns.npy"), "rb").read()
        files["columns.npy"] = {"bytes": len(cbytes), "sha256": hashlib.sha256(cbytes).hexdigest()}
        shards.append(dict(s0, name=name, num_items=per, files=files))
    meta = dict(meta, shards=shards, num_items=n_items)
    with open(os.path.join(out, "metadata.json"), "w") as f:
        json.dump(meta, f)
    return time.perf_counter() - t0


# ---- measurements (each in a fresh process) ---------------------------------------------------
def memory() -> dict:
    st = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssFile", "RssShmem", "VmHWM", "VmRSS"):
            st[k] = int(v.split()[0]) * 1024
    return st


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def job(toml: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", toml])


def child(kind: str, toml: str, state_path: str) -> dict:
    t_imp = time.perf_counter()
    import torch  # noqa: F401  (timed apart: the target is without it)
    import transformers  # noqa: F401  (a library import too: prepare_run reads an HF config)

    from torchtitan_speechlm.data.catalog import open_prepared
    from torchtitan_speechlm.data.index_store import CHECKED_ENV, export_checked_indexes
    from torchtitan_speechlm.trainer.builders import check_data, train_stream
    from torchtitan_speechlm.trainer.preflight import check_training_data
    from torchtitan_speechlm.trainer.run import prepare_run

    out = {"import_s": time.perf_counter() - t_imp}
    base = memory()
    out["base_memory"] = base
    t0, c0 = time.perf_counter(), time.process_time()
    jc = job(toml)
    if kind == "launcher":
        plan = prepare_run(jc)[0]
        check_data(jc, plan)
        check_training_data(jc, plan)
        export_checked_indexes()  # as commands/train.py does before it starts the ranks
        out["check_s"], out["check_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        out["checked_env"] = os.environ.get(CHECKED_ENV, "")
        ds = open_prepared(os.path.abspath(plan.data.datasets["train"]), plan.data.verify_shards)
        info = ds.index_info
        out["index"] = {"built": info.built, "verified_full": info.verified_full,
                        "build_s": info.build_s, "verify_s": info.verify_s}  # fmt: skip
        out["memory"] = memory()
        return out
    plan = prepare_run(jc)[0]
    t1, c1 = time.perf_counter(), time.process_time()
    ds = open_prepared(os.path.abspath(plan.data.datasets["train"]), plan.data.verify_shards)
    out["open_s"], out["open_cpu_s"] = time.perf_counter() - t1, time.process_time() - c1
    out["index"] = {"built": ds.index_info.built, "verified_full": ds.index_info.verified_full}
    st = train_stream(jc, plan, dp_rank=RANK, dp_world_size=DP)
    if kind == "resume":
        with open(state_path, "rb") as f:
            st.load_state_dict(pickle.load(f))
    it = iter(st)
    next(it)
    out["start_to_first_batch_s"] = time.perf_counter() - t0
    out["start_to_first_batch_cpu_s"] = time.process_time() - c0
    out["memory"], out["fds"] = memory(), fds()
    out["shards_open"] = len(ds.shards)
    if kind == "rank":
        t2, c2, n = time.perf_counter(), time.process_time(), 40
        for _ in range(n):
            next(it)
        out["per_batch_ms"] = 1000 * (time.perf_counter() - t2) / n
        out["per_batch_cpu_ms"] = 1000 * (time.process_time() - c2) / n
        out["memory_after_batches"], out["fds_after_batches"] = memory(), fds()
        state = st.state_dict()
        for cursor in state["position"]["shards"].values():  # deep into epoch 3
            w = cursor["window"]
            w["epoch"] = [3] * len(w["epoch"])
            w["pos"] = [int(0.9 * (len(s.indices) // st.step_pieces)) for s in st.sources]
        with open(state_path, "wb") as f:
            pickle.dump(state, f)
    out["items"] = len(ds)
    return out


def run_child(kind: str, toml: str, state_path: str, checked: str = "") -> dict:
    """``checked``: the launcher's checked index keys, which the ranks inherit
    (data/index_store.py: ``CHECKED_ENV``)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env["TORCHTITAN_SPEECHLM_CHECKED_INDEXES"] = checked
    p = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--toml", toml, "--state", state_path],
        capture_output=True, text=True, env=env, preexec_fn=limit, cwd=REPO,
    )  # fmt: skip
    if p.returncode != 0:
        raise SystemExit(f"bench_scale: {kind} child failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def prepare_planning(work: str, n: int) -> dict:
    """Seconds per item of prepare's planning: reading a JSONL manifest, ``build_plan``."""
    from types import SimpleNamespace

    from torchtitan_speechlm.prepare.plan import build_plan
    from torchtitan_speechlm.prepare.sources import read_source

    wav = os.path.join(work, "assets", "wavs", "u0.wav")
    manifest = os.path.join(work, f"manifest_{n}.jsonl")
    with open(manifest, "w") as f:
        f.writelines(
            json.dumps({"id": f"m{i}", "audio": wav, "text": "a short sentence here"}) + "\n"
            for i in range(n)
        )
    codec = SimpleNamespace(name="k", path="p", class_name="c", sample_rate=16000, frame_rate=25,
                            num_streams=4, total_streams=4, codebook_size=256,
                            config_hash="0")  # fmt: skip
    t0 = time.perf_counter()
    items = read_source("manifest", manifest, {}).items
    t1 = time.perf_counter()
    build_plan(items, {"type": "manifest"}, codec, {"hash": "0"}, 1000, False)
    t2 = time.perf_counter()
    os.remove(manifest)
    return {"items": n, "read_us_per_item": 1e6 * (t1 - t0) / n,
            "plan_us_per_item": 1e6 * (t2 - t1) / n}  # fmt: skip


def median_run(runs: list[dict]) -> dict:
    """The run of median start -> first batch, with every run's figure beside it (``repeats``):
    a shared VM's noise is larger than a start-up of a second."""
    ranked = sorted(runs, key=lambda r: r["start_to_first_batch_s"])
    out = dict(ranked[len(ranked) // 2])
    out["repeats"] = {k: [round(r[k], 3) for r in runs]
                      for k in ("start_to_first_batch_s", "start_to_first_batch_cpu_s")}  # fmt: skip
    return out


def scale(work: str, paths: dict, n_items: int, n_shards: int, repeats: int = 1,
          order: str = "auto") -> dict:  # fmt: skip
    data = os.path.join(work, f"syn_{n_items}_{n_shards}")
    synth_s = synthesise(paths["prepared"], data, n_items, n_shards)
    shutil.rmtree(os.path.join(data, "index"), ignore_errors=True)  # measure the first open
    toml = os.path.join(work, f"scale_{n_items}.toml")
    dump = os.path.join(work, f"dump_{n_items}")
    with open(toml, "w") as f:
        f.write(TOML.format(dump=dump, backbone=paths["backbone"], prepared=data,
                            dev=paths["prepared"], order=order))  # fmt: skip
    state = os.path.join(work, f"state_{n_items}.pkl")
    res = {"items": n_items, "shards": n_shards, "synthesis_s": synth_s}
    res["launcher_first"] = run_child("launcher", toml, state)
    res["launcher"] = run_child("launcher", toml, state)
    checked = res["launcher"].pop("checked_env")
    res["launcher_first"].pop("checked_env")
    res["rank"] = median_run([run_child("rank", toml, state, checked) for _ in range(repeats)])
    res["resume"] = median_run([run_child("resume", toml, state, checked) for _ in range(repeats)])
    r = res["rank"]
    private = r["memory"]["RssAnon"] - r["base_memory"]["RssAnon"]
    res["summary"] = {
        "open_s": r["open_s"],
        "open_cpu_s": r["open_cpu_s"],
        "start_to_first_batch_s": r["start_to_first_batch_s"],
        "start_to_first_batch_cpu_s": r["start_to_first_batch_cpu_s"],
        "import_s": r["import_s"],
        "private_bytes": r["memory"]["RssAnon"],
        "private_bytes_over_import": private,
        "private_bytes_per_item_over_import": private / n_items,
        "file_backed_bytes": r["memory"]["RssFile"],
        "peak_rss_bytes": r["memory"]["VmHWM"],
        "fds": r["fds"],
        "fds_after_batches": r["fds_after_batches"],
        "per_batch_ms": r["per_batch_ms"],
        "per_batch_cpu_ms": r["per_batch_cpu_ms"],
        "resume_deep_s": res["resume"]["start_to_first_batch_s"],
        "resume_deep_cpu_s": res["resume"]["start_to_first_batch_cpu_s"],
        "launcher_check_first_s": res["launcher_first"]["check_s"],
        "launcher_check_first_cpu_s": res["launcher_first"]["check_cpu_s"],
        "launcher_first_index_build_s": res["launcher_first"]["index"]["build_s"],
        "launcher_first_full_verify_s": res["launcher_first"]["index"]["verify_s"],
        "launcher_check_s": res["launcher"]["check_s"],
        "launcher_check_cpu_s": res["launcher"]["check_cpu_s"],
        "loadavg_1min": os.getloadavg()[0],
    }
    print(json.dumps({n_items: res["summary"]}), flush=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/bench_scale")
    p.add_argument("--scales", default="100000:100,1000000:1000,10000000:10000",
                   help="ITEMS:SHARDS,...")  # fmt: skip
    p.add_argument("--out", default=None)
    p.add_argument("--no-prepare", action="store_true", help="skip prepare's planning cost")
    p.add_argument("--keep", action="store_true", help="keep the synthetic datasets")
    p.add_argument("--order", default="auto", choices=("auto", "permutation", "keyed"),
                   help="speechlm_data.order of the runs")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="rank and resume runs per scale (the median is reported)")  # fmt: skip
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--toml", default=None, help=argparse.SUPPRESS)
    p.add_argument("--state", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.toml, a.state)))
        return 0
    os.makedirs(a.work, exist_ok=True)
    paths = seed_assets(a.work)
    results = {"cpus": os.cpu_count(), "dp": DP, "rank": RANK, "ulimit_n": NOFILE, "seed_items": SEED_ITEMS, "order": a.order,
               "layout": "pack, local batch 4, global 128 (accumulation 4), seq_len 4096, "
                         "tts:0.7 + asr:0.3 (the 1.7B recipe's)", "scales": []}  # fmt: skip
    for spec in a.scales.split(","):
        n, s = (int(float(x)) for x in spec.split(":"))
        results["scales"].append(scale(a.work, paths, n, s, a.repeats, a.order))
        if not a.keep:
            shutil.rmtree(os.path.join(a.work, f"syn_{n}_{s}"), ignore_errors=True)
    first = results["scales"][0]["summary"]["start_to_first_batch_s"]
    for sc in results["scales"]:  # the target: the largest within 2x of the smallest
        sc["summary"]["start_over_smallest"] = round(
            sc["summary"]["start_to_first_batch_s"] / first, 2
        )
    if not a.no_prepare:
        results["prepare_planning"] = prepare_planning(a.work, 200_000)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
