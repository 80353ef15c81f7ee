#!/usr/bin/env bash
# One prepared script for a session that is lent a GPU (never run by CI).
# Usage on the GPU machine, from the repo root:  bash benchmarks/gpu_check.sh "$OUT"
# It installs into a fresh venv with the machine's CUDA torch, then:
#   1. SpeechLM vs llama3 of the same size (bf16 autocast), frames/s and ratio;
#   2. the debug demo config on CUDA with bf16 params and per-layer torch.compile, 50 steps;
#   3. decode speed of a Qwen3-0.6B-shaped SpeechLM, KV cache vs none (bf16).
# Results go to $1 (default benchmarks/results/gpu).
set -euo pipefail
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
python3 -m venv .venv-gpu
. .venv-gpu/bin/activate
pip install -q torch >/dev/null 2>&1 || true
pip install -q -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python benchmarks/bench_vs_llama3.py --sizes debug,small --steps 20 | tee "$out/vs_llama3.json"
python -m torchtitan_speechlm.demo --utterances 240 -- \
  --training.steps 50 --training.mixed_precision_param bfloat16 --compile.enable true \
  --job.dump_folder outputs/gpu_debug 2>&1 | tail -40 | tee "$out/demo_gpu.log"
cp outputs/gpu_debug/metrics.jsonl "$out/" || true
python benchmarks/bench_decode.py --shape qwen3_0.6b --frames 64 --repeats 3 | tee "$out/decode.log"
cp benchmarks/results/decode_cuda.json "$out/" || true
