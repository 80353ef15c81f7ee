# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""SpeechLM vs torchtitan's native llama3 of the same size, in the same run.

Same hidden size, layers, heads, FFN width and vocabulary rows; same [B, T] batch; one training
step = forward + loss + backward + AdamW. The SpeechLM adds N summed stream embeddings, the HF
decoder stack (instead of torchtitan's own), and per-stream heads over vocabulary slices. Reports
frames/s of both and the ratio. On CPU by default; on a GPU it uses CUDA and bf16 autocast.

    python benchmarks/bench_vs_llama3.py [--sizes debug,small] [--steps 10]
Writes benchmarks/results/vs_llama3.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import torchtitan_speechlm  # noqa: F401
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer

from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.model import SpeechLM
from torchtitan_speechlm.model.vocab import VocabLayout

SIZES = {  # hidden, layers, heads, kv heads, ffn, text vocab, streams, codebook, batch, seq
    "debug": (128, 4, 4, 2, 384, 259, 4, 64, 2, 1024),
    "small": (512, 8, 8, 4, 1536, 4096, 8, 1024, 2, 1024),
}


def speechlm(size, device, backbone="hf"):
    import transformers

    h, layers, heads, kv, ffn, text, n, c, _, _ = SIZES[size]
    d = tempfile.mkdtemp()
    cfg = transformers.LlamaConfig(
        vocab_size=text,
        hidden_size=h,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
    )
    cfg.save_pretrained(d)
    layout = VocabLayout(text_size=text, num_streams=n, codebook_size=c)
    args = SpeechLMModelArgs(
        hf_assets_path=d,
        backbone_config=cfg.to_dict(),
        vocab=layout.to_dict(),
        load_weights=False,
        backbone=backbone,
    )
    with torch.device("meta"):
        model = SpeechLM(args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=torch.device(device))
    return model, layout


def llama(size, vocab, device):
    h, layers, heads, kv, ffn, *_ = SIZES[size]
    args = TransformerModelArgs(
        dim=h,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        vocab_size=vocab,
        multiple_of=ffn,
        ffn_dim_multiplier=None,
        max_seq_len=4096,
    )
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model


def timed(step, n):
    for _ in range(2):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def bench(size, steps, device):
    *_, n, c, b, t = SIZES[size]
    model, layout = speechlm(size, device)
    native, _ = speechlm(size, device, "native")
    ref = llama(size, layout.size, device)
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    g = torch.Generator().manual_seed(0)
    frames = torch.stack(
        [torch.randint(*layout.stream_range(k), (b, t + 1), generator=g) for k in range(n)], -1
    ).to(device)
    weights = torch.full((b, t, n), 1.0 / n, device=device)
    tokens = frames[..., 0]
    opt_s = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt_n = torch.optim.AdamW(native.parameters(), lr=1e-4)
    opt_l = torch.optim.AdamW(ref.parameters(), lr=1e-4)

    def speech_step(m, opt):
        def step():
            with amp:
                out = m(frames[:, :-1], targets=frames[:, 1:], loss_weights=weights)
            (out.loss_sum / (b * t)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    step_speech, step_native = speech_step(model, opt_s), speech_step(native, opt_n)

    def step_llama():
        with amp:
            logits = ref(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt_l.step()
        opt_l.zero_grad(set_to_none=True)

    ts, tn, tl = timed(step_speech, steps), timed(step_native, steps), timed(step_llama, steps)
    return {
        "size": size,
        "hidden": SIZES[size][0],
        "layers": SIZES[size][1],
        "streams": n,
        "batch": [b, t],
        "params": {
            "speechlm": sum(p.numel() for p in model.parameters()),
            "llama3": sum(p.numel() for p in ref.parameters()),
        },
        "frames_per_s": {
            "speechlm": b * t / ts,
            "speechlm_native": b * t / tn,
            "llama3": b * t / tl,
        },
        "speechlm_over_llama3": tl / ts,
        "speechlm_native_over_llama3": tl / tn,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="debug,small")
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [bench(s, a.steps, device) for s in a.sizes.split(",")]
    result = {
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else f"cpu ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "results": rows,
    }
    print(json.dumps(result, indent=2))
    os.makedirs("benchmarks/results", exist_ok=True)
    name = "vs_llama3_gpu.json" if device == "cuda" else "vs_llama3_cpu.json"
    with open(os.path.join("benchmarks/results", name), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
