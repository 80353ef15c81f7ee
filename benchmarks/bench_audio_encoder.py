# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""Audio into the LM as continuous features vs as codec tokens: step time and peak memory.

The same backbone and the same audio duration (``--utterances`` x ``--seconds``, packed in one
row with ``--text`` text tokens each) three ways, each in a fresh process (so peak memory is its
own): ``frozen``: a random-init Whisper-shaped encoder (its 30 s windows, log-mel on the
device) with the adaptor training and the encoder frozen; ``trained``: the encoder trains too;
``codec_tokens``: the audio as 8 codebooks at 50 frames/s in the delay pattern (no encoder: a
4x longer LM sequence at ``stack = 4``). One step = forward with loss, backward, AdamW. Peak
memory is the process's peak RSS on CPU (VmHWM) and ``torch.cuda.max_memory_allocated`` on a
GPU (bf16 autocast).

    python benchmarks/bench_audio_encoder.py [--device cpu|cuda] [--shape small] [--repeats 3]

Writes benchmarks/results/audio_encoder_{device}.json (``--out``). Smallest setting (a smoke
test of the script): ``--shape tiny --repeats 1 --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    amp_context,
    build_speechlm,
    device_name,
    interleaved,
    peak_rss_bytes,
    summary,
)

# backbone (hidden, layers, heads, kv, ffn, text vocab); encoder (d_model, layers, heads, ffn,
# window in s); utterances, seconds each, text tokens each
SHAPES = {
    "tiny": ((64, 1, 4, 2, 192, 512), (32, 1, 2, 64, 2), 1, 1.0, 8),
    "small": ((512, 4, 8, 4, 1536, 16_384), (384, 4, 6, 1536, 30), 2, 10.0, 40),  # Whisper-tiny
}
MODES = ("frozen", "trained", "codec_tokens")
SR, CODEC_RATE, STREAMS, STACK = 16000, 50, 8, 4


def encoder_folder(d_model: int, layers: int, heads: int, ffn: int, window_s: int) -> str:
    """A Whisper config alone (random init, no weights), saved here."""
    from transformers import WhisperConfig

    d = tempfile.mkdtemp()
    WhisperConfig(
        d_model=d_model,
        encoder_layers=layers,
        encoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_layers=1,
        decoder_attention_heads=heads,
        decoder_ffn_dim=ffn,
        max_source_positions=window_s * 50,
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    ).save_pretrained(d)
    return d


def batch(layout, mode: str, shape: str, audio, device: str) -> dict:
    """One packed row: per utterance, its text tokens and its audio (continuous or codes)."""
    _, _, utts, seconds, n_text = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    samples = int(seconds * SR)
    audio_frames = (
        int(audio.frames_of(samples)) if audio else int(seconds * CODEC_RATE) + STREAMS - 1
    )
    doc = n_text + audio_frames
    t = utts * doc
    frames = torch.stack(
        [torch.randint(*layout.stream_range(k), (1, t + 1), generator=g) for k in range(STREAMS)],
        -1,
    )
    weights = torch.ones(1, t, STREAMS)
    positions = torch.arange(doc).repeat(utts)[None]
    extra = {}
    if audio:
        index = torch.full((1, t), -1)
        for u in range(utts):
            start = u * doc + n_text
            index[0, start : start + audio_frames] = u * audio_frames + torch.arange(audio_frames)
        weights[0, index[0] >= 0] = 0.0  # continuous frames carry no loss
        extra = {
            "audio_wave": (0.1 * torch.randn(utts, samples, generator=g)).to(device),
            "audio_lengths": torch.full((utts,), samples, device=device),
            "audio_index": index.to(device),
        }
    return {
        "inputs": frames[:, :-1].to(device),
        "targets": frames[:, 1:].to(device),
        "loss_weights": weights.to(device),
        "position_ids": positions.to(device),
        **extra,
    }


def measure(mode: str, shape: str, device: str, repeats: int) -> dict:
    """One mode's step time and peak memory (run in a fresh process)."""
    import torchtitan_speechlm  # noqa: F401  (selects the CPU device before torchtitan)
    from torchtitan_speechlm.model.audio.tower import AudioEncoderArgs

    (h, layers, heads, kv, ffn, text), enc, *_ = SHAPES[shape]
    audio = None
    if mode != "codec_tokens":
        audio = AudioEncoderArgs.from_folder(
            encoder_folder(*enc), stack=STACK, freeze_encoder=mode == "frozen"
        )
    torch.manual_seed(0)
    model, layout = build_speechlm(
        device, hidden=h, layers=layers, heads=heads, kv=kv, ffn=ffn, text=text,
        streams=STREAMS, codebook=1024, family="qwen3",
        **({"audio_encoder": audio.to_dict()} if audio else {}),
    )  # fmt: skip
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4, foreach=True)
    b = batch(layout, mode, shape, audio, device)
    amp = amp_context(device)

    def step() -> None:
        with amp:
            out = model(b["inputs"], **{k: v for k, v in b.items() if k != "inputs"})
        out.loss_sum.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = interleaved({mode: step}, repeats, device, warmup=1)[mode]
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else peak_rss_bytes()
    return {
        "step_s": summary(times),
        "peak_memory_bytes": peak,
        "lm_frames": int(b["inputs"].shape[1]),
        "parameters": sum(p.numel() for p in model.parameters()),
        "trained_parameters": sum(p.numel() for p in trained),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--out", help="results file (default benchmarks/results/audio_encoder_{device}.json)"
    )
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # run in a child process
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one, a.shape, a.device, a.repeats)))
        return 0
    rows = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--device", a.device, "--shape", a.shape,
               "--repeats", str(a.repeats), "--one", mode]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows[mode] = r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{mode:>13}: step {r['step_s']['median'] * 1e3:9.1f} ms, peak "
            f"{r['peak_memory_bytes'] / 2**20:8.1f} MiB, {r['lm_frames']} LM frames, trains "
            f"{r['trained_parameters']:,} of {r['parameters']:,} parameters"
        )
    (h, layers, _, _, ffn, text), enc, utts, seconds, n_text = SHAPES[a.shape]
    result = {
        "device": device_name(a.device),
        "torch": torch.__version__,
        "dtype": "bfloat16 autocast" if a.device == "cuda" else "float32",
        "threads": torch.get_num_threads(),
        "shape": a.shape,
        "backbone": {"hidden": h, "layers": layers, "ffn": ffn, "text_vocab": text},
        "encoder": {"d_model": enc[0], "layers": enc[1], "window_s": enc[4], "stack": STACK},
        "audio": {"utterances": utts, "seconds_each": seconds, "text_tokens_each": n_text},
        "codec_tokens": {"frame_rate": CODEC_RATE, "streams": STREAMS, "pattern": "delay"},
        "command": f"python benchmarks/bench_audio_encoder.py --device {a.device} --shape "
        f"{a.shape} --repeats {a.repeats}",
        "modes": rows,
    }
    out = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"audio_encoder_{a.device}.json"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
