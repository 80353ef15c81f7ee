"""Shared pieces of the benchmarks: models of a given shape, batches, timing, device names."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import torch


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    return f"cpu ({cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: that one survives
    fork + exec, so a child process would start at its parent's peak."""
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def amp_context(device: str):
    """bf16 autocast on a GPU (as training with mixed precision), fp32 on CPU."""
    if device == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_speechlm(
    device: str,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv: int,
    ffn: int,
    text: int,
    streams: int,
    codebook: int,
    backbone: str = "hf",
    attn: str = "sdpa_documents",
    family: str = "llama",
    **extra,
):
    """A randomly initialised SpeechLM of this shape over a transformers Llama (or Qwen3)
    config, built on the meta device and materialised like torchtitan does."""
    import transformers

    from torchtitan_speechlm.model.args import SpeechLMModelArgs
    from torchtitan_speechlm.model.model import SpeechLM
    from torchtitan_speechlm.model.vocab import VocabLayout

    config_cls = transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig
    cfg = config_cls(
        vocab_size=text,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,  # Qwen3Config's default is 128 whatever the width
        max_position_embeddings=max(16384, extra.pop("max_positions", 0)),
        tie_word_embeddings=False,
    )
    d = tempfile.mkdtemp()
    cfg.save_pretrained(d)
    layout = VocabLayout(text_size=text, num_streams=streams, codebook_size=codebook)
    args = SpeechLMModelArgs(
        hf_assets_path=d,
        backbone_config=cfg.to_dict(),
        vocab=layout.to_dict(),
        load_weights=False,
        backbone=backbone,
        attn_implementation=attn,
        **extra,
    )
    with torch.device("meta"):
        model = SpeechLM(args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=torch.device(device))
    return model, layout


def random_frames(layout, b: int, t: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = layout.num_streams
    return torch.stack(
        [torch.randint(*layout.stream_range(k), (b, t), generator=g) for k in range(n)], -1
    ).to(device)


def packed_positions(b: int, t: int, docs: int, device: str, seed: int = 0) -> torch.Tensor:
    """Position ids of rows holding ``docs`` documents of random lengths (each >= 16 frames),
    restarting at 0 at every document."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        cuts = torch.randperm(t // 16 - 1, generator=g)[: docs - 1].sort().values.add(1) * 16
        bounds = [0, *cuts.tolist(), t]
        rows.append(
            torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:], strict=True)])
        )
    return torch.stack(rows).to(device)


def train_step(model, frames, weights, positions, opt, amp) -> Callable[[], None]:
    """One SpeechLM training step on a fixed batch: forward with loss, backward, optimizer."""

    def step() -> None:
        with amp:
            out = model(
                frames[:, :-1], targets=frames[:, 1:], loss_weights=weights, position_ids=positions
            )
        (out.loss_sum / weights.shape[0]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def interleaved(
    steps: dict[str, Callable[[], None]], repeats: int, device: str, warmup: int = 2
) -> dict[str, list[float]]:
    """Seconds per call of each step, run A, B, C, A, B, C, ... after ``warmup`` rounds."""
    for _ in range(warmup):
        for s in steps.values():
            s()
    times: dict[str, list[float]] = {n: [] for n in steps}
    for _ in range(repeats):
        for name, s in steps.items():
            synchronize(device)
            t0 = time.perf_counter()
            s()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return times


def summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}
