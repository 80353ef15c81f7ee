#!/usr/bin/env bash
# The GPU checks and benchmarks, as one script for a session lent a GPU (never run by CI).
#
# Prepare here (CPU machine, package registry reachable):  make gpu-wheels
#   -> .whl/ holds the pure-Python packages a bare GPU image lacks (torchtitan 0.2.2,
#      torchdata, tyro, datasets, ...); the image brings its own CUDA torch and transformers.
# Run there, from the repo root, carrying .whl:  bash benchmarks/gpu_check.sh "$OUT"
#
# Budget: under 8 minutes on one H100/H200. Each step has its own time limit and a failed step
# does not stop the next; the results land in $1 (default benchmarks/results/gpu): gpu.txt,
# steps.log (every step's output) and each benchmark's JSON (8 files, lora_cuda.json among them):
#   1. attention paths at T=8192, 16 documents per row (plain, sdpa_documents, dense mask,
#      flex_attention, native flex, native grouped SDPA), packed/plain step-time ratios;
#   2. SpeechLM (hf-llama, hf-qwen3, native) vs torchtitan's llama3 with its own flex
#      block-causal attention, Qwen3-0.6B shape, bf16, eager and torch.compile, speech and
#      text-only configs: frames/s, MFU, peak memory, ratios;
#   3. the same at the Qwen3-1.7B shape (speech, compiled);
#   4. loss-side memory at a 151,936-word vocabulary x 8 streams x 8k frames vs naive logits;
#   5. LoRA vs full fine-tuning at the Qwen3-0.6B shape: step time, peak memory (lora_cuda.json);
#   8. the decode step compiled and as CUDA graphs (Qwen3-0.6B shape); 9. the server (hidden 1024);
#   6-7. with 2 GPUs or more: a pipeline step per schedule and an expert-parallel step.
set -uo pipefail
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, torchtitan; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'torchtitan', torchtitan.__version__ \
if hasattr(torchtitan, '__version__') else '0.2.2')"; } 2>&1 | tee "$out/gpu.txt"

step() {  # step NAME SECONDS COMMAND...: run with a limit, log it, never stop the script
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*" | tee -a "$out/steps.log"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$out/steps.log" 2>&1
  echo "   exit $? after $((SECONDS - t0))s" | tee -a "$out/steps.log"
}

step attention 100 python3 benchmarks/bench_attention.py --shapes 8192x16 --repeats 3
step vs_llama3_0.6b 100 python3 benchmarks/bench_vs_llama3.py --shape qwen3_0.6b --repeats 5
step vs_llama3_0.6b_compile 150 python3 benchmarks/bench_vs_llama3.py --shape qwen3_0.6b \
  --repeats 5 --compile
step vs_llama3_1.7b_compile 110 python3 benchmarks/bench_vs_llama3.py --shape qwen3_1.7b \
  --repeats 3 --compile --configs speech
step loss_memory 40 python3 benchmarks/bench_loss_memory.py
step lora 90 python3 benchmarks/bench_lora.py --device cuda --shape qwen3_0.6b --repeats 5
# 8. the decode step at the Qwen3-0.6B shape: native cached eager vs compiled vs compiled and
# replayed as CUDA graphs (DecodeConfig.compile on / graphs), vs hf cached, batch 1 and 8
step decode_compile 150 python3 benchmarks/bench_decode.py --suite backbones --shape qwen3_0.6b \
  --frames 256 --repeats 3 --out "$out/decode_backbones_cuda.json"
# 9. torchtitan serve at a Qwen3-0.6B-like size (hidden 1024, 28 layers; a briefly trained
# export): 1/4/16 concurrent clients vs sequential CLI calls
step serve 150 python3 benchmarks/bench_serve.py --hidden 1024 --layers 28 --heads 16 \
  --device cuda --cli-calls 4 --out "$out/serve_cuda.json"
# 6-7. pipeline (bubble per schedule vs theory, per-rank memory) and expert parallelism (EP step
# vs EP=1 at equal global batch): 2 ranks each, and NCCL takes one GPU per rank, so they run only
# on a machine with 2 GPUs or more (their corpus is espeak-ng speech: the image needs espeak-ng)
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$ngpu" -ge 2 ] && command -v espeak-ng >/dev/null; then
  step pipeline 150 python3 benchmarks/bench_pipeline.py --steps 8 --hidden 1024 --layers 16 \
    --seq-len 2048 --schedules 1F1B,Interleaved1F1B --micro 2,1 --out "$out/pipeline_cuda.json"
  step expert_parallel 120 python3 benchmarks/bench_expert_parallel.py --steps 8 --hidden 1024 \
    --layers 8 --experts 16 --seq-len 2048 --out "$out/expert_parallel_cuda.json"
else
  echo "== pipeline, expert_parallel: skipped ($ngpu GPU(s); each needs 2, and espeak-ng)" \
    | tee -a "$out/steps.log"
fi
cp benchmarks/results/*gpu*.json "$out/" 2>/dev/null
ls -la "$out"
