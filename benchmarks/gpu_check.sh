#!/usr/bin/env bash
# The GPU check: one command that proves the product on every GPU it finds (never run by CI).
#
# Prepare here (CPU machine, package registry reachable):  make gpu-wheels
#   -> .whl/ holds the packages a bare GPU image (Python 3.12, its own CUDA torch and
#      transformers) lacks: torchtitan 0.2.2, torchdata, tyro, tensorboard (torchtitan's metrics
#      import it), soundfile, ... (the Makefile's GPU_WHEELS; if `datasets` still cannot import,
#      benchmarks/gpu_shims stands in for the names torchtitan imports from it).
# Run there, from the repo root, carrying .whl:   bash benchmarks/gpu_check.sh OUT
# The same steps on CPU at tiny shapes (gloo, 2 processes for "all ranks"), here:
#                                                  bash benchmarks/gpu_check.sh --dry-run OUT
# Further flags go to benchmarks/gpu_check.py (--steps a,b  --no-micro  --recipes DIR  --keep-work).
#
# Steps (benchmarks/gpu_check.py has the details), with their limits on one H200 in seconds:
#   assets 40 (random-init Mimi from MimiConfig, tone clips, Qwen3-0.6B/1.7B-keyed bf16 backbones
#   at real widths and vocabulary, layers cut to 8 / 4), prepare 35 (`torchtitan prepare` with the
#   Mimi on cuda, 8 streams, --dev-fraction), train_0.6b_1rank 70 and train_1.7b_1rank 70 (the
#   shipped recipes, FILL-IN paths and size overrides only: 12 steps of 4 x 4096 frames, compile,
#   AC, bf16 FSDP2 as shipped), export 15, generate_tts 20, generate_asr 20, serve 30 (one
#   request), and the micro-benchmarks at cut settings: bench_attention 25, bench_vs_llama3 40
#   (0.6B shape, eager, hf-qwen3 vs llama3; the trainings give the compiled MFU),
#   bench_loss_memory 20, bench_lora 25, bench_decode 30, bench_serve 35.
#   Sum on one GPU: 475 s (< 8 minutes). With N >= 2 GPUs these add: train_0.6b_all_ranks 75
#   and train_1.7b_all_ranks 75 (--nproc-per-node N), bench_pipeline 60, bench_expert_parallel 60,
#   bench_prepare_parts 120 (N parts of `torchtitan prepare` on N GPUs against 1 part)
#   (the last three also need espeak-ng and scipy, else they are skipped and said so).
# Output: OUT/summary.md + OUT/summary.json (one table: per step pass/fail, wall time; for
# training frames/s, MFU, peak memory, each step's time), OUT/logs/*.log, OUT/gpu.txt and each
# micro-benchmark's JSON. The runs' folders (OUT/work) are removed at the end unless --keep-work.
# Exit status: 1 if any step failed (the others still ran), 2 if no GPU (without --dry-run).
set -uo pipefail
dry=""
if [ "${1:-}" = "--dry-run" ]; then dry="--dry-run"; shift; fi
out=${1:-benchmarks/results/gpu}
shift || true
mkdir -p "$out"
: >"$out/gpu.txt"
export PYTHONUNBUFFERED=1
py=python3
if [ -n "$dry" ] && [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
if [ -z "$dry" ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# torchtitan imports `datasets` at module level (its llama3 model, its validator); without pyarrow
# and pandas (not in .whl: 55 MB) it cannot import, so a stand-in with those names goes first
if ! "$py" -c "import datasets" >/dev/null 2>&1; then
  export PYTHONPATH=$PWD/benchmarks/gpu_shims:$PYTHONPATH
  echo "datasets: not importable here; benchmarks/gpu_shims stands in" | tee -a "$out/gpu.txt"
fi
{ if [ -z "$dry" ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
  "$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"; } \
  2>&1 | tee -a "$out/gpu.txt"
"$py" benchmarks/gpu_check.py $dry "$out" "$@"
rc=$?
if [ -z "$dry" ]; then  # the session keeps the table under benchmarks/results/
  cp "$out/summary.md" benchmarks/results/gpu_check_summary.md 2>/dev/null
  cp "$out/summary.json" benchmarks/results/gpu_check_summary.json 2>/dev/null
fi
exit $rc
