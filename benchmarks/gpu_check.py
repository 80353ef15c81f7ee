"""The GPU check: one command that runs the product on every GPU it finds, and the GPU
micro-benchmarks, and writes one summary table (benchmarks/gpu_check.sh is its entry point).

    python benchmarks/gpu_check.py OUT              # on a GPU machine (cuda, NCCL)
    python benchmarks/gpu_check.py --dry-run OUT    # the same steps on CPU at tiny shapes (gloo)

Steps (each its own process group with a time limit; a failed step never stops the next):

  assets            a random-init Mimi from transformers' MimiConfig (its default, kyutai/mimi's
                    shape, on GPU; the tests' tiny Mimi on --dry-run), its all-zero codebooks
                    calibrated as tests/tiny_codecs.py does; synthetic tone clips + manifest;
                    backbones with Qwen3-0.6B's and Qwen3-1.7B's shipped config.json keys and bf16
                    weights (tests/real_checkpoints.py: real widths and vocabulary, layers cut;
                    shrink=True widths on --dry-run), a BPE tokenizer saved into each backbone
  prepare           `torchtitan prepare --codec MIMI --num-streams K --dev-fraction 0.2
                    --tokenizer BACKBONE --device cuda` (cpu on --dry-run)
  train_*           `torchtitan train` on the SHIPPED train_configs/qwen3_0.6b_tts_asr.toml and
                    qwen3_1.7b_tts_asr.toml: FILL-IN paths filled (tests/recipes.py), sizes cut by
                    command-line overrides (steps, checkpoint/validation interval; on --dry-run
                    also seq_len and batch), the recipe's compile, activation checkpointing, bf16
                    mixed precision, FSDP2 and fused AdamW as shipped; on 1 rank and on all ranks
                    (--nproc-per-node = GPU count; 2 gloo processes on --dry-run; skipped with 1 GPU)
  export, generate_tts, generate_asr, serve
                    on the last 0.6B checkpoint trained (all ranks if that passed, else 1 rank)
  micro-benchmarks  the GPU figures of docs/performance.md at cut settings (MICRO below)

Budget (seconds, limit per step, on one H200): see LIMITS; the sum of the steps that run with one
GPU is printed in the summary and kept under 480 (tests check it). With N >= 2 GPUs the two
all-ranks trainings (2 x 75 s) and the pipeline/expert-parallel benchmarks (2 x 60 s) add.

Output: OUT/summary.md and OUT/summary.json (per step: status, wall seconds, limit, and for
training: tokens (frames)/s per rank and in all, MFU (GPU: torchtitan's figure from the model's
FLOPs per frame and the device's peak bf16 FLOPs; n/a on CPU), peak memory, each step's time),
OUT/logs/STEP.log; the runs under OUT/work/ (removed at the end unless --keep-work). Exit status 1 if any step failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# the per-step limits on one H200 (seconds); --dry-run uses DRY_LIMITS (2 CPU cores)
LIMITS = {
    "assets": 40,
    "prepare": 35,
    "train_0.6b_1rank": 70,
    "train_0.6b_all_ranks": 75,
    "train_1.7b_1rank": 70,
    "train_1.7b_all_ranks": 75,
    "export": 15,
    "generate_tts": 20,
    "generate_asr": 20,
    "serve": 30,
    "bench_attention": 25,
    "bench_vs_llama3": 40,
    "bench_loss_memory": 20,
    "bench_lora": 25,
    "bench_decode": 30,
    "bench_serve": 35,
    "bench_pipeline": 60,
    "bench_expert_parallel": 60,
    "bench_prepare_parts": 120,
}
ALL_RANKS_ONLY = ("train_0.6b_all_ranks", "train_1.7b_all_ranks", "bench_pipeline",
                  "bench_expert_parallel", "bench_prepare_parts")  # fmt: skip
DRY_LIMITS = {name: 240 for name in LIMITS}
ONE_GPU_BUDGET = 480

# backbones: the shipped config's name, layers on GPU (real widths, 151,936 words) / on --dry-run
BACKBONES = {"0.6b": ("qwen3_0.6b", 8), "1.7b": ("qwen3_1.7b", 4)}
DRY_LAYERS = 2
RECIPES = {"0.6b": "qwen3_0.6b_tts_asr.toml", "1.7b": "qwen3_1.7b_tts_asr.toml"}
GPU_STEPS, DRY_STEPS = 12, 4

# the micro-benchmarks (GPU argv, --dry-run argv); {o}: the output folder
MICRO = {
    "bench_attention": (
        "benchmarks/bench_attention.py --shapes 2048x8 --repeats 1 --out {o}/attention_cuda.json",
        "benchmarks/bench_attention.py --shapes 64x2 --repeats 1 --hidden 64 --layers 1 "
        "--out {o}/attention_cpu.json",
    ),
    "bench_vs_llama3": (
        "benchmarks/bench_vs_llama3.py --shape qwen3_0.6b --repeats 2 --configs speech "
        "--variants 'speechlm hf-qwen3' --results-dir {o}",
        "benchmarks/bench_vs_llama3.py --shape tiny --repeats 1 --configs speech "
        "--variants 'speechlm hf-llama' --results-dir {o}",
    ),
    "bench_loss_memory": (
        "benchmarks/bench_loss_memory.py --results {o}/loss_memory_cuda.json",
        "benchmarks/bench_loss_memory.py --frames 64 --hidden 16 --dtypes float32 "
        "--results {o}/loss_memory_cpu.json",
    ),
    "bench_lora": (
        "benchmarks/bench_lora.py --device cuda --shape qwen3_0.6b --repeats 2 "
        "--out {o}/lora_cuda.json",
        "benchmarks/bench_lora.py --shape tiny --repeats 1 --out {o}/lora_cpu.json",
    ),
    "bench_decode": (
        "benchmarks/bench_decode.py --suite backbones --shape qwen3_0.6b --frames 32 --repeats 1 "
        "--out {o}/decode_backbones_cuda.json",
        "benchmarks/bench_decode.py --suite backbones --shape tiny --frames 4 --repeats 1 "
        "--out {o}/decode_backbones_cpu.json",
    ),
    "bench_serve": (
        "benchmarks/bench_serve.py --hidden 512 --layers 4 --heads 8 --device cuda "
        "--frames 25 --requests 8 --concurrency 1,4 --cli-calls 1 --slow-clients 1 "
        "--slow-seconds 5 --burst 16x2 --work {o}/work/bench_serve --out {o}/serve_cuda.json",
        "benchmarks/bench_serve.py --frames 2 --requests 2 --cli-calls 1 --concurrency 1,2 "
        "--hidden 32 --layers 1 --slow-clients 1 --slow-seconds 2 --burst 4x2 "
        "--work {o}/work/bench_serve --out {o}/serve_cpu.json",
    ),
    "bench_pipeline": (
        "benchmarks/bench_pipeline.py --steps 4 --hidden 1024 --layers 8 --seq-len 2048 "
        "--schedules 1F1B --micro 2 --work {o}/work/pipeline --out {o}/pipeline_cuda.json",
        "benchmarks/bench_pipeline.py --steps 2 --micro 2 --hidden 32 --layers 4 --seq-len 512 "
        "--schedules 1F1B --work {o}/work/pipeline --out {o}/pipeline_cpu.json",
    ),
    "bench_expert_parallel": (
        "benchmarks/bench_expert_parallel.py --steps 4 --hidden 1024 --layers 4 --experts 16 "
        "--seq-len 2048 --work {o}/work/ep --out {o}/expert_parallel_cuda.json",
        "benchmarks/bench_expert_parallel.py --steps 2 --hidden 32 --experts 4 --seq-len 512 "
        "--work {o}/work/ep --out {o}/expert_parallel_cpu.json",
    ),
    # issue 38: N parts of `torchtitan prepare` on N GPUs (part i on cuda:i) against 1 part;
    # the joined dataset must equal the one-part one byte for byte
    "bench_prepare_parts": (
        "benchmarks/bench_prepare.py --n 40 --copies 100 --shard-size 100 --parts {n} "
        "--repeats 1 --device cuda --cache {o}/work/bench_prepare --out {o}/prepare_parts_cuda.json",
        "benchmarks/bench_prepare.py --n 8 --held-out 2 --copies 2 --shard-size 4 --parts 2 "
        "--repeats 1 --cache {o}/work/bench_prepare --out {o}/prepare_parts_cpu.json",
    ),
}


def one_gpu_budget() -> int:
    """The sum of the limits of the steps that run on a machine with one GPU."""
    return sum(v for k, v in LIMITS.items() if k not in ALL_RANKS_ONLY)


# ---- the steps' own work (run as `python benchmarks/gpu_check.py --do STEP ...`) ------------
def _tones(folder: Path, sentences: list[str], rate: int, scale: float, seed: int = 0) -> Path:
    import numpy as np
    import soundfile as sf

    rng = np.random.default_rng(seed)
    (folder / "wavs").mkdir(parents=True, exist_ok=True)
    manifest = folder / "manifest.jsonl"
    with open(manifest, "w") as f:
        for i, text in enumerate(sentences):
            dur = scale * (0.5 + 0.08 * len(text.split()))
            t = np.arange(int(rate * dur)) / rate
            f0 = 110 + 15 * (i % 11)
            wav = 0.3 * np.sin(2 * np.pi * f0 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
            wav = wav + 0.01 * rng.standard_normal(len(t))
            path = folder / "wavs" / f"u{i}.wav"
            sf.write(str(path), wav.astype(np.float32), rate)
            line = {"id": f"u{i}", "audio": str(path), "text": text, "speaker": f"s{i % 10}"}
            f.write(json.dumps(line) + "\n")
    return manifest


def do_assets(work: Path, dry: bool) -> None:
    import torch
    from transformers import MimiConfig, MimiModel

    from tests import tiny_codecs
    from tests.real_checkpoints import save_real_backbone, stored_dtype
    from torchtitan_speechlm.demo.assets import build_tokenizer, load_sentences

    sentences = load_sentences()
    codec = work / "mimi"
    if dry:
        tiny_codecs.build_codec(str(codec), kind="mimi", seed=0)
    else:  # kyutai/mimi's shape (24 kHz, 12.5 frames/s, 32 x 2048 codes), random init
        torch.manual_seed(0)
        model = MimiModel(MimiConfig()).eval()
        with torch.no_grad():
            tiny_codecs._calibrate(model, "mimi")  # Mimi's codebooks start all-zero
        model.save_pretrained(str(codec))
    rate = MimiConfig.from_pretrained(str(codec)).sampling_rate
    n = 24 if dry else 200
    sentences = (sentences * (n // len(sentences) + 1))[:n]
    scale = 1.0 if dry else 3.0  # on GPU about 4 s a clip: 50 Mimi frames, 40 documents a row
    manifest = _tones(work / "audio", sentences, rate, scale)
    print("manifest:", manifest, f"{n} clips at {rate} Hz")
    for key, (name, layers) in BACKBONES.items():
        folder = work / f"backbone_{key}"
        layers = DRY_LAYERS if dry else layers
        config = save_real_backbone(folder, name, num_layers=layers, shrink=dry)
        build_tokenizer(str(folder), load_sentences())  # `--tokenizer <backbone dir>`
        print(f"backbone {key}: {name}, {layers} layers, hidden {config['hidden_size']}, "
              f"vocab {config['vocab_size']}, stored {stored_dtype(config)}")  # fmt: skip


def do_serve(export: str, out: Path, device: str) -> None:
    """Start `torchtitan serve` on ``export``, send one TTS request, check a WAV comes back."""
    import urllib.request

    cmd = [sys.executable, "-m", "torchtitan_speechlm.cli", "serve", "--model", export,
           "--port", "0", "--max-frames", "20", "--device", device]  # fmt: skip
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, started = [], threading.Event()

    def read():
        for line in proc.stdout:
            print(line, end="", flush=True)
            if " on http://" in line and not url:
                url.append(line.split(" on ")[1].split()[0].rstrip("/"))
                started.set()
        started.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not (started.wait(600) and url):
            raise SystemExit("the server did not start")
        body = json.dumps({"model": "export", "voice": "alloy", "input": "hello there"})
        request = urllib.request.Request(
            url[0] + "/v1/audio/speech", data=body.encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as response:
            audio = response.read()
        took = time.perf_counter() - t0
        if audio[:4] != b"RIFF":
            raise SystemExit(f"no WAV came back: {audio[:80]!r}")
        out.write_bytes(audio)
        print(f"one /v1/audio/speech request: {len(audio)} bytes of WAV in {took:.2f}s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---- the driver ----------------------------------------------------------------------------
class Check:
    def __init__(self, out: Path, dry: bool, recipes: Path, only: list[str] | None):
        self.out, self.dry, self.recipes, self.only = out, dry, recipes, only
        self.work = out / "work"
        self.logs = out / "logs"
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        self.device = "cpu" if dry else "cuda"
        if dry:
            self.ngpu = 0
            self.nproc = 2
        else:
            import torch

            self.ngpu = torch.cuda.device_count()
            self.nproc = self.ngpu
        self.trained: dict[str, str] = {}  # "0.6b": the last step folder trained (all ranks last)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = os.pathsep.join(
            [p for p in [self.env.get("PYTHONPATH", ""), str(ROOT)] if p]
        )
        if dry:
            self.env["OMP_NUM_THREADS"] = "1"
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run never touches a GPU

    def limit(self, name: str) -> int:
        return (DRY_LIMITS if self.dry else LIMITS)[name]

    def wanted(self, name: str) -> bool:
        return self.only is None or name in self.only

    def skip(self, name: str, why: str) -> None:
        if self.wanted(name):
            print(f"== {name}: skipped ({why})", flush=True)
            self.rows.append({"step": name, "status": "skipped", "note": why,
                              "limit_s": self.limit(name)})  # fmt: skip

    def run(self, name: str, cmd: list[str], note: str = "") -> dict | None:
        """Run ``cmd`` in its own process group under the step's limit; log it; add a row."""
        if not self.wanted(name):
            return None
        limit = self.limit(name)
        log = self.logs / f"{name}.log"
        print(f"== {name} (limit {limit}s): {shlex.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        with open(log, "w") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            try:
                rc = proc.wait(limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                rc = None
            # the whole group: torchrun's workers, a server, compile workers
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        wall = time.perf_counter() - t0
        status = "pass" if rc == 0 else "fail"
        if timed_out:
            note = f"timed out after {limit}s" + (f"; {note}" if note else "")
        elif rc != 0:
            note = f"exit {rc}: {last_error(log)}" + (f"; {note}" if note else "")
        row = {"step": name, "status": status, "wall_s": round(wall, 1), "limit_s": limit,
               "note": note, "log": str(log.relative_to(self.out))}  # fmt: skip
        print(f"   {status} after {wall:.1f}s" + (f" ({note})" if note else ""), flush=True)
        self.rows.append(row)
        return row

    def py(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "torchtitan_speechlm.cli", *args]

    def me(self, *args: str) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), *args]

    # -- the product path --
    def main_path(self) -> None:
        work = self.work
        self.run("assets", self.me("--do", "assets", "--work", str(work),
                                   *(["--dry-run"] if self.dry else [])))  # fmt: skip
        prepared = work / "prepared"
        streams = "4" if self.dry else "8"  # the tiny Mimi has 4 codebooks; the recipes use 8
        self.run("prepare", self.cli(
            "prepare", "--manifest", str(work / "audio" / "manifest.jsonl"),
            "--codec", str(work / "mimi"), "--num-streams", streams, "--dev-fraction", "0.2",
            "--tokenizer", str(work / "backbone_0.6b"), "--out-dir", str(prepared),
            "--device", self.device, "--no-progress", "--overwrite",
        ), note=f"Mimi, {streams} streams, on {self.device}")  # fmt: skip
        for key in ("0.6b", "1.7b"):
            self.train(key, 1)
            if self.nproc >= 2:
                self.train(key, self.nproc)
            else:
                self.skip(f"train_{key}_all_ranks", "1 GPU: the all-ranks run is the 1-rank run")
        self.use_the_model()

    def train(self, key: str, nproc: int) -> None:
        from tests.recipes import cut_overrides, filled_recipe

        name = f"train_{key}_{'1rank' if nproc == 1 else 'all_ranks'}"
        if not self.wanted(name):
            return
        run_dir = self.work / name
        dump = run_dir / "dump"
        run_dir.mkdir(parents=True, exist_ok=True)
        prepared = self.work / "prepared"
        recipe = self.recipes / RECIPES[key]
        try:
            config = filled_recipe(str(recipe), run_dir / "recipe.toml",
                                   str(self.work / f"backbone_{key}"),
                                   {"train": str(prepared / "train"), "dev": str(prepared / "dev")},
                                   str(dump))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a broken recipe is a failed step
            config = str(recipe)
            print(f"   could not fill {recipe}: {e}")
        if self.dry:
            steps = DRY_STEPS
            cut = cut_overrides(nproc, steps=steps)
        else:  # the recipe's own rows (4 x 4096 frames per GPU), no accumulation
            steps = GPU_STEPS
            cut = cut_overrides(nproc, steps=steps, seq_len=4096, local=4)
            cut[cut.index("--checkpoint.interval") + 1] = str(steps)
            cut[cut.index("--validation.freq") + 1] = str(steps)
        cmd = self.cli("train", "--job.config_file", str(config), "--nproc-per-node", str(nproc),
                       *cut)  # fmt: skip
        row = self.run(name, cmd, note=f"{RECIPES[key]}, {nproc} rank(s), {steps} steps")
        if row is None:
            return
        row.update(training_figures(dump, nproc, self.dry))
        log_text = (self.out / row["log"]).read_text(errors="replace")
        row["compiled"] = "Compiled each decoder layer" in log_text
        step = dump / "checkpoint" / f"step-{steps}"
        if row["status"] == "pass" and not step.is_dir():
            row["status"], row["note"] = "fail", f"no checkpoint {step.name}; " + row["note"]
        if row["status"] == "pass":
            self.trained[key] = str(step)

    def use_the_model(self) -> None:
        source = self.trained.get("0.6b") or self.trained.get("1.7b")
        export = self.work / "export"
        if source is None:
            for name in ("export", "generate_tts", "generate_asr", "serve"):
                if self.wanted(name):
                    self.rows.append({"step": name, "status": "fail", "wall_s": 0.0,
                                      "limit_s": self.limit(name),
                                      "note": "no training run passed: nothing to export"})  # fmt: skip
            return
        note = f"from {Path(source).parent.parent.parent.name}"
        self.run("export", self.cli("export", "--checkpoint", source, "--out-dir", str(export),
                                    "--force"), note=note)  # fmt: skip
        wav = self.work / "tts.wav"
        self.run("generate_tts", self.cli(
            "generate", "--model", str(export), "--task", "tts", "--text", "hello there",
            "--out", str(wav), "--max-frames", "40", "--device", self.device))  # fmt: skip
        self.run("generate_asr", self.cli(
            "generate", "--model", str(export), "--task", "asr",
            "--audio", str(self.work / "audio" / "wavs" / "u0.wav"),
            "--out", str(self.work / "asr.txt"), "--max-frames", "40", "--device", self.device,
        ))  # fmt: skip
        self.run("serve", self.me("--do", "serve", "--work", str(export),
                                  "--serve-out", str(self.work / "served.wav"),
                                  "--device", self.device))  # fmt: skip

    # -- the micro-benchmarks --
    def micro(self) -> None:
        for name, (gpu, dry) in MICRO.items():
            if name in ("bench_pipeline", "bench_expert_parallel", "bench_prepare_parts"):
                if self.nproc < 2:
                    self.skip(name, f"{self.ngpu} GPU(s): needs 2")
                    continue
                # their corpus is espeak-ng speech, resampled with scipy (neither in a bare image)
                if shutil.which("espeak-ng") is None or importlib.util.find_spec("scipy") is None:
                    self.skip(name, "needs espeak-ng and scipy (its corpus is espeak-ng speech)")
                    continue
            argv = shlex.split((dry if self.dry else gpu).format(o=self.out, n=self.nproc))
            self.run(name, self.py(*argv))

    # -- the table --
    def summary(self) -> dict:
        head = {
            "mode": "dry-run (CPU, gloo, tiny shapes)" if self.dry else "GPU (cuda, NCCL)",
            "device": device_name(self.dry),
            "gpus": self.ngpu,
            "all_ranks": self.nproc,
            "one_gpu_budget_s": one_gpu_budget(),
            "failed": [r["step"] for r in self.rows if r["status"] == "fail"],
            "steps": self.rows,
        }
        (self.out / "summary.json").write_text(json.dumps(head, indent=2) + "\n")
        (self.out / "summary.md").write_text(markdown(head))
        return head


def last_error(log: Path) -> str:
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    for line in reversed(lines):
        if any(w in line for w in ("Error", "error", "Exception", "failed", "Traceback")):
            return line[:200]
    return lines[-1][:200] if lines else ""


def training_figures(dump: Path, nproc: int, dry: bool) -> dict:
    """tokens (frames)/s, MFU, peak memory and each step's time from the run's metrics.jsonl
    (torchtitan's figures: tps per rank, MFU from the FLOPs per frame and the peak bf16 FLOPs)."""
    path = dump / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    train = [r for r in rows if "throughput(tps)" in r]
    if not train:
        return {}
    warm = train[2:] or train[-1:]  # the first steps compile
    tps = statistics.median(r["throughput(tps)"] for r in warm)
    mem = [r.get("memory/max_reserved(GiB)") for r in train]
    mem = [m for m in mem if isinstance(m, (int, float))]
    mfu = None if dry else statistics.median(r.get("mfu(%)", 0.0) for r in warm)
    return {
        "frames_per_s_per_rank": round(tps, 1),
        "frames_per_s": round(tps * nproc, 1),
        "mfu_pct": None if mfu is None else round(mfu, 2),
        "peak_memory_gib": round(max(mem), 2) if mem and not dry else None,
        "step_times_s": [
            round(r.get("time_metrics/end_to_end(s)", float("nan")), 3) for r in train
        ],  # fmt: skip
        "final_loss": train[-1].get("loss_metrics/global_avg_loss"),
    }


def device_name(dry: bool) -> str:
    if dry:
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no cuda device"


def markdown(head: dict) -> str:
    def fmt(v, spec="{}"):
        return "n/a" if v is None else spec.format(v)

    lines = [
        f"# GPU check: {head['mode']}",
        "",
        f"Device: {head['device']}; GPUs: {head['gpus']}; all-ranks runs: {head['all_ranks']} "
        f"rank(s). Step limits on one GPU add to {head['one_gpu_budget_s']} s.",
        f"Failed: {', '.join(head['failed']) or 'none'}",
        "",
        "| step | status | wall s | limit s | frames/s (per rank) | MFU % | peak GiB "
        "| step times s | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in head["steps"]:
        train = "frames_per_s" in r
        rate = f"{r['frames_per_s']:.0f} ({r['frames_per_s_per_rank']:.0f})" if train else ""
        times = " ".join(f"{t:g}" for t in r.get("step_times_s", []))
        lines.append(
            f"| {r['step']} | {r['status']} | {fmt(r.get('wall_s'))} | {r['limit_s']} | {rate} "
            f"| {fmt(r.get('mfu_pct')) if train else ''} "
            f"| {fmt(r.get('peak_memory_gib')) if train else ''} | {times} "
            f"| {r.get('note', '').replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default="benchmarks/results/gpu")
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes")
    p.add_argument("--recipes", default=str(ROOT / "train_configs"),
                   help="the folder of the recipes to train (default: the shipped ones)")  # fmt: skip
    p.add_argument("--steps", help="comma-separated step names to run (default: all)")
    p.add_argument("--no-micro", action="store_true", help="skip the micro-benchmarks")
    p.add_argument("--keep-work", action="store_true",
                   help="keep OUT/work (data, backbones, checkpoints, export)")  # fmt: skip
    p.add_argument("--do", choices=("assets", "serve"), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--serve-out", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if a.do == "assets":
        do_assets(Path(a.work), a.dry_run)
        return 0
    if a.do == "serve":
        do_serve(a.work, Path(a.serve_out), a.device)
        return 0
    out = Path(a.out).resolve()
    only = a.steps.split(",") if a.steps else None
    check = Check(out, a.dry_run, Path(a.recipes).resolve(), only)
    if not a.dry_run and check.ngpu == 0:
        print("no CUDA device: run with --dry-run for the CPU form", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    check.main_path()
    if not a.no_micro:
        check.micro()
    head = check.summary()
    if not a.keep_work:
        shutil.rmtree(check.work, ignore_errors=True)
    print(f"\n{(out / 'summary.md').read_text()}\n{time.perf_counter() - t0:.0f}s in all")
    return 1 if head["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
