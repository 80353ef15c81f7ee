"""Behaviour fingerprint of training: batch hashes and logged numbers of fixed runs, so that a
restructuring can show it changed nothing (issue 27: "same batches, same losses").

    python tools/behaviour_fingerprint.py assets --out FP_ASSETS        # the varied corpus, once
    python tools/behaviour_fingerprint.py run --assets FP_ASSETS [--demo] --out A.json
    python tools/behaviour_fingerprint.py compare A.json B.json

``run`` trains only through the user's command (``torchtitan train``), so it measures the same
thing on any version of the package:

- ``demo``: the demo config (``train_configs/speechlm_debug.toml`` on ``make demo``'s data) for
  50 steps, every step logged (validation off: it does not change training);
- on a corpus unlike the demo's (espeak-ng speech of 0.4-6 s, Kaldi segments, a tiny Llama
  backbone, four tasks): pack and bucket batching on 1 and 2 ranks with accumulation, the
  ``parallel`` and ``flatten`` patterns, and resume mid-epoch (on the same layout and on
  another one); and ``speechlm_data.order``: the default (``auto``: ``keyed`` for a new run
  since stream version 2), ``keyed`` and ``permutation`` (the order before) on 1 and 2 ranks,
  each resumed, and a ``permutation`` run resumed by the default (it continues in its order).

Per run it records every rank's micro-batch hashes (``speechlm_data.log_batch_hashes``: the
content of inputs, targets, weights and positions, and of each sample), and every logged
number of ``metrics.jsonl`` except timings and memory. ``compare`` prints the first difference.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("time", "throughput", "memory", "mfu", "tps", "tflops", "wps", "elapsed")

VARIED_TOML = """
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
z_loss_weight = 1e-3
[speechlm_data]
datasets = ["var={prepared}"]
train = ["tts:var:0.4", "asr:var:0.3", "continuation:var:0.2", "text:var:0.1"]
window = 16
log_batch_hashes = true
[optimizer]
name = "AdamW"
lr = 3e-3
implementation = "foreach"
[lr_scheduler]
warmup_steps = 2
[training]
local_batch_size = 2
global_batch_size = 8
seq_len = 384
steps = 8
dtype = "float32"
mixed_precision_param = "float32"
mixed_precision_reduce = "float32"
[parallelism]
data_parallel_shard_degree = -1
[checkpoint]
enable = true
interval = 4
last_save_model_only = false
[activation_checkpoint]
mode = "none"
[metrics]
log_freq = 1
enable_tensorboard = false
[validation]
enable = false
"""

# name -> (nproc, extra overrides); "a+b" runs a, then b in the same dump folder (a resume)
VARIED_RUNS = {
    "pack_1": (1, []),
    "pack_2": (2, []),
    "bucket_1": (1, ["--speechlm_data.batching", "bucket", "--speechlm_data.max_tokens", "1024",
                     "--training.global_batch_size", "-1"]),
    "bucket_2": (2, ["--speechlm_data.batching", "bucket", "--speechlm_data.max_tokens", "1024",
                     "--training.global_batch_size", "-1"]),
    "parallel_1": (1, ["--speechlm.pattern", "parallel", "--training.steps", "4"]),
    "flatten_1": (1, ["--speechlm.pattern", "flatten", "--training.seq_len", "1536",
                      "--training.steps", "4"]),
    # speechlm_data.order (data/keyed_order.py): "auto" (the default) starts "keyed" since
    # stream version 2; "permutation" is the order of every run before it (its batches must
    # equal the older fingerprints' pack_1 / pack_2)
    "keyed_1": (1, ["--speechlm_data.order", "keyed"]),
    "keyed_2": (2, ["--speechlm_data.order", "keyed"]),
    "permutation_1": (1, ["--speechlm_data.order", "permutation"]),
    "permutation_2": (2, ["--speechlm_data.order", "permutation"]),
}  # fmt: skip
# resumes: (first part, second part) run in one dump folder
RESUMES = {
    "resume_pack_2_2": ((2, ["--training.steps", "4"]), (2, [])),
    "resume_bucket_2_1": (
        (2, ["--training.steps", "4", "--speechlm_data.batching", "bucket",
             "--speechlm_data.max_tokens", "1024", "--training.global_batch_size", "8"]),
        (1, ["--speechlm_data.batching", "bucket", "--speechlm_data.max_tokens", "1024",
             "--training.global_batch_size", "8"]),
    ),
    "resume_keyed_2_1": ((2, ["--training.steps", "4", "--speechlm_data.order", "keyed"]),
                         (1, ["--speechlm_data.order", "keyed"])),
    # a run of stream version 1 (permutation) resumed by the default ("auto"): continues it
    "resume_permutation_2_auto_2": (
        (2, ["--training.steps", "4", "--speechlm_data.order", "permutation"]), (2, [])),
}  # fmt: skip


def torchtitan(*args: str) -> list[str]:
    return [sys.executable, "-m", "torchtitan_speechlm.cli", *args]


def train(config: str, nproc: int, extra: list[str]) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = torchtitan("train", "--job.config_file", config, "--nproc-per-node", str(nproc), *extra)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def read_run(dump: str) -> dict:
    hashes = {}
    for path in sorted(glob.glob(os.path.join(dump, "batch_hashes", "rank*.jsonl"))):
        with open(path) as f:
            hashes[os.path.basename(path)] = [json.loads(line) for line in f]
    metrics = []
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            metrics.append(
                {k: v for k, v in row.items() if not any(t in k.lower() for t in TIMING)}
            )
    return {"hashes": hashes, "metrics": metrics}


def prepared_hashes(prepared: str) -> dict:
    """The prepared dataset's recorded shard checksums (what `torchtitan prepare` wrote)."""
    with open(os.path.join(prepared, "metadata.json")) as f:
        meta = json.load(f)
    return {k: v for k, v in meta.items() if k in ("shards", "codec", "tokenizer", "num_items")}


def cmd_assets(args) -> int:
    sys.path.insert(0, REPO)
    from tests.helpers import make_varied_kaldi_assets

    os.makedirs(args.out, exist_ok=True)
    paths = make_varied_kaldi_assets(args.out, n_utts=args.utts, seed=0)
    with open(os.path.join(args.out, "paths.json"), "w") as f:
        json.dump(paths, f, indent=1)
    print(json.dumps(paths, indent=1))
    return 0


def cmd_run(args) -> int:
    with open(os.path.join(args.assets, "paths.json")) as f:
        assets = json.load(f)
    out: dict = {"prepared": prepared_hashes(assets["prepared"])}
    work = tempfile.mkdtemp(prefix="fingerprint-")
    try:
        if args.demo:
            dump = os.path.join(work, "demo")
            train(
                os.path.join(REPO, "train_configs", "speechlm_debug.toml"),
                1,
                ["--job.dump_folder", dump, "--training.steps", "50", "--metrics.log_freq", "1",
                 "--validation.enable", "false", "--checkpoint.enable", "false",
                 "--metrics.enable_tensorboard", "false", "--metrics.enable_wandb", "false",
                 "--speechlm_data.log_batch_hashes", "true"],
            )  # fmt: skip
            out["demo"] = read_run(dump)
            print("demo done", flush=True)
        for name, (nproc, extra) in VARIED_RUNS.items():
            if args.only and name not in args.only:
                continue
            dump = os.path.join(work, name)
            config = os.path.join(work, f"{name}.toml")
            with open(config, "w") as f:
                f.write(VARIED_TOML.format(dump=dump, **assets))
            train(config, nproc, extra)
            out[name] = read_run(dump)
            print(f"{name} done", flush=True)
        for name, parts in RESUMES.items():
            if args.only and name not in args.only:
                continue
            dump = os.path.join(work, name)
            config = os.path.join(work, f"{name}.toml")
            with open(config, "w") as f:
                f.write(VARIED_TOML.format(dump=dump, **assets))
            for nproc, extra in parts:
                train(config, nproc, extra)
            out[name] = read_run(dump)
            print(f"{name} done", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    return 0


def first_difference(a, b, where: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{where}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{where}.{k}: only in {'second' if k not in a else 'first'}"
            d = first_difference(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} != {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{where}: {a!r} != {b!r}"


def cmd_compare(args) -> int:
    with open(args.a) as f:
        a = json.load(f)
    with open(args.b) as f:
        b = json.load(f)
    runs = sorted(set(a) | set(b))
    bad = 0
    for run in runs:
        if run not in a or run not in b:
            print(f"{run}: only in {'first' if run in a else 'second'}")
            bad += 1
            continue
        d = first_difference(a[run], b[run], run)
        batches = sum(len(v) for v in a[run].get("hashes", {}).values()) if run != "prepared" else 0
        steps = len(a[run].get("metrics", [])) if run != "prepared" else 0
        print(f"{run}: {'identical' if d is None else 'DIFFERS at ' + d}"
              + (f" ({batches} micro-batch hashes, {steps} logged steps)" if batches else ""))  # fmt: skip
        bad += d is not None
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("assets")
    a.add_argument("--out", required=True)
    a.add_argument("--utts", type=int, default=40)
    r = sub.add_parser("run")
    r.add_argument("--assets", required=True)
    r.add_argument(
        "--demo",
        action="store_true",
        help="also the demo config (run where make demo's demo_work/ is)",
    )
    r.add_argument("--only", nargs="*", default=[])
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    return {"assets": cmd_assets, "run": cmd_run, "compare": cmd_compare}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
