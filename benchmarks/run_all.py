"""`make bench`: every benchmark, results in benchmarks/results/ (never run by CI)."""

import subprocess
import sys

BENCHES = [  # each writes its JSON under benchmarks/results/ (docs/performance.md quotes them)
    ["benchmarks/bench_vs_llama3.py"],  # the representative one: packed, chunked head, no-loss
    ["benchmarks/bench_attention.py"],
    ["benchmarks/bench_loss_memory.py"],
    ["benchmarks/bench_loader.py"],
    ["benchmarks/bench_scale.py"],  # 10^5..10^7-item datasets: open, first batch, memory, fds
    ["benchmarks/bench_checkpoint_manifest.py"],  # the checkpoint manifest's cost in a save
    ["benchmarks/bench_step_overhead.py"],
    ["benchmarks/bench_prepare.py"],
    ["benchmarks/bench_decode.py"],
    ["benchmarks/bench_decode.py", "--suite", "backbones", "--frames", "512"],  # native vs hf
    ["benchmarks/bench_codec_decode.py"],  # k-means decode: WER/DNSMOS vs GL iterations, RTF
    ["benchmarks/bench_serve.py"],  # `torchtitan serve` at 1/4/16 clients vs sequential CLI calls
    ["benchmarks/bench_serve_abuse.py"],  # issue 51's attacks beside normal clients: p95, memory
    ["benchmarks/bench_generate.py"],  # after make demo: batching, RTF, first audio, start-up
    ["benchmarks/bench_wave_store.py"],  # prepared forms for a continuous audio encoder
    ["benchmarks/bench_audio_encoder.py"],  # continuous audio vs codec tokens: step, memory
    ["benchmarks/bench_lora.py"],  # LoRA vs full fine-tuning: step time, peak memory
    ["benchmarks/bench_pipeline.py"],  # PP bubble per schedule vs theory, per-stage memory
    ["benchmarks/bench_expert_parallel.py"],  # the EP step vs EP=1 at equal global batch
    ["benchmarks/bench_memory_model.py"],  # activation memory per frame and layer (performance.md)
    ["benchmarks/voice_table.py"],  # espeak-ng voices told apart by Resemblyzer (quality.md)
    ["benchmarks/bench_speaker_prompt.py"],  # prompted TTS: speaker-ID, SIM, WER (~40 min)
    ["benchmarks/codec_floor.py"],  # the codec's WER floor on many voices (~10 min)
    ["benchmarks/bench_learning.py", "--sweep"],  # ~30 min alone on 2 cores (docs/quality.md)
    ["benchmarks/bench_espnet_data.py"],  # ESPnet's data side vs prepared data (~30 min)
    ["benchmarks/bench_preference.py", "--demo", "."],  # after make demo: DPO (preference.md)
    ["benchmarks/bench_preference_ceiling.py", "--demo", "."],  # best-of-K by judge (~6 min)
]

if __name__ == "__main__":
    failed = [b[0] for b in BENCHES if subprocess.call([sys.executable, *b]) != 0]
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    sys.exit(1 if failed else 0)
