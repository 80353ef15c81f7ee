"""Which prepared form carries audio for a continuous audio encoder: bytes per hour of audio and
the loader's cost to turn it into what the model reads (docs/audio-encoder.md).

Forms: *int16*: 16 kHz mono samples in one flat array per shard (memory-mapped, sliced, scaled
to float32); *flac*: each utterance a FLAC blob (soundfile decodes it); *logmel16*: Whisper's
80-bin log-mel, float16, [80, samples / 160] per utterance (encoder-specific). The waveform
forms leave the log-mel to the model's device (``LogMel``); its CPU cost is measured too, for
scale. Audio: espeak-ng sentences (clean synthetic speech: FLAC's best case) and the same with
noise 40 dB below the speech (a closer stand-in for recordings).

    python benchmarks/bench_wave_store.py [--n 200] [--repeats 3]
Writes benchmarks/results/wave_store.json (``--out``). Smallest setting (a smoke test of the
script, not a measurement): ``--n 4 --repeats 1 --work DIR --out FILE``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time

import numpy as np
import soundfile as sf
import torch

from torchtitan_speechlm.demo.assets import load_sentences, synthesize_corpus
from torchtitan_speechlm.model.audio.hf_encoder import LogMel

SR = 16000
FE = {"sampling_rate": SR, "n_fft": 400, "hop_length": 160, "feature_size": 80}


def read_corpus(manifest: str) -> list[np.ndarray]:
    base = os.path.dirname(manifest)
    out = []
    with open(manifest) as f:
        for line in f:
            wav, sr = sf.read(os.path.join(base, json.loads(line)["audio"]), dtype="float32")
            assert sr == SR, sr
            out.append(wav)
    return out


def forms(waves: list[np.ndarray], mel: LogMel) -> dict[str, tuple[int, object]]:
    """form -> (bytes stored, a function reading every utterance back as the model's input)."""
    pcm = [np.clip(np.round(w * 32767), -32768, 32767).astype("<i2") for w in waves]
    flat, offsets = np.concatenate(pcm), np.cumsum([0] + [len(p) for p in pcm])
    flacs = []
    for p in pcm:
        buf = io.BytesIO()
        sf.write(buf, p, SR, format="FLAC", subtype="PCM_16")
        flacs.append(buf.getvalue())
    feats = []
    with torch.no_grad():
        for w in waves:
            frames = -(-len(w) // 160)
            feats.append(mel(torch.from_numpy(w)[None])[0, :, :frames].half().numpy())

    def read_int16():
        return [
            flat[a:b].astype(np.float32) / 32768.0
            for a, b in zip(offsets[:-1], offsets[1:], strict=True)
        ]

    def read_flac():
        return [sf.read(io.BytesIO(b), dtype="float32")[0] for b in flacs]

    def read_logmel():
        return [f.astype(np.float32) for f in feats]

    return {
        "int16": (flat.nbytes + 8 * len(offsets), read_int16),
        "flac": (sum(map(len, flacs)), read_flac),
        "logmel16": (sum(f.nbytes for f in feats), read_logmel),
    }


def measure(waves: list[np.ndarray], repeats: int) -> dict:
    hours = sum(map(len, waves)) / SR / 3600
    window = max(map(len, waves))
    mel = LogMel({**FE, "n_samples": window})
    out = {"hours": hours, "utterances": len(waves)}
    for name, (nbytes, read) in forms(waves, mel).items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            read()
            times.append(time.perf_counter() - t0)
        out[name] = {
            "mb_per_hour": nbytes / hours / 1e6,
            "read_s_per_hour": statistics.median(times) / hours,
        }
    times = []
    with torch.no_grad():
        batch = torch.zeros(len(waves), window)
        for i, w in enumerate(waves):
            batch[i, : len(w)] = torch.from_numpy(w)
        for _ in range(repeats):
            t0 = time.perf_counter()
            mel(batch)
            times.append(time.perf_counter() - t0)
    padded_hours = batch.numel() / SR / 3600
    out["logmel_in_torch_cpu_s_per_hour"] = statistics.median(times) / padded_hours
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=200, help="espeak-ng utterances")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default="benchmarks/work/wave_store")
    p.add_argument("--out", default="benchmarks/results/wave_store.json")
    a = p.parse_args()
    torch.set_num_threads(1)
    manifest = synthesize_corpus(os.path.join(a.work, f"n{a.n}"), load_sentences(), n=a.n)
    clean = read_corpus(manifest)
    rng = np.random.default_rng(0)
    noisy = [
        np.clip(w + rng.standard_normal(len(w)).astype(np.float32) * 0.01 * np.std(w), -1, 1)
        for w in clean
    ]
    result = {
        "command": f"python benchmarks/bench_wave_store.py --n {a.n} --repeats {a.repeats}",
        "threads": 1,
        "clean": measure(clean, a.repeats),
        "noisy_40db": measure(noisy, a.repeats),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
