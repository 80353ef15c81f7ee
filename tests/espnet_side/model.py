"""What ESPnet's ``job_template.build_model()`` hands a trainer, and ESPnet's checkpoints.

``build_parallel_model`` is written from espnet/espnet
``espnet2/speechlm/model/speechlm/lm/parallel.py`` (``ParallelHFModel`` /
``build_parallel_hf_class``, commit 008dd2dced1a): a subclass of the backbone's transformers class
named ``ParallelLLM``, loaded with ``from_pretrained``, whose ``model.embed_tokens`` and
``lm_head`` are rebuilt for the whole vocabulary (the pretrained text rows copied to the text
interval), with a zero-initialised ``stream_emb``, the ios in ``multimodal_io_dict``, a linear
``adaptor`` per continuous io, and ``vocab`` / ``vocab_intervals`` attributes. Its forward is
not reproduced (our trainer never calls it).

``save_espnet_checkpoint`` is written from ``espnet2/speechlm/trainer/titan_trainer.py``
(commit 0a9cbaa9b774): AdamW over two groups (weight decay on all but ``embed_tokens``), the
linear-warmup cosine LambdaLR, and ``dcp.save({"model", "optimizer", "lr_scheduler",
"global_step"})`` into ``OUTPUT/checkpoints/step_N``.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn


def build_parallel_model(model_hf_tag: str, multimodal_io: dict, vocab, vocab_intervals):
    import transformers
    from transformers import AutoConfig

    base = getattr(transformers, AutoConfig.from_pretrained(model_hf_tag).architectures[0])
    cls = type("ParallelLLM", (base,), {})
    model = cls.from_pretrained(model_hf_tag, dtype=torch.float32)
    size = max(end for ivs in vocab_intervals.values() for _, end in ivs)
    dim = model.config.hidden_size
    with torch.no_grad():
        embed, head = nn.Embedding(size, dim, padding_idx=0), nn.Linear(dim, size, bias=False)
        lo, hi = vocab_intervals["text"][0]
        old = model.model.embed_tokens.weight
        if hi - lo != old.shape[0]:
            raise ValueError(f"text_end - text_start ({hi - lo}) must equal {old.shape[0]}")
        embed.weight[lo:hi] = old
        head.weight[lo:hi] = model.lm_head.weight
        model.model.embed_tokens, model.lm_head = embed, head
    model.num_stream = max(io.num_stream() for io in multimodal_io.values() if io.is_discrete)
    model.stream_emb = nn.Embedding(model.num_stream, dim)
    nn.init.zeros_(model.stream_emb.weight)
    model.multimodal_io_dict = nn.ModuleDict(multimodal_io)
    model.adaptor = nn.ModuleDict(
        {
            n: nn.Linear(io.feature_dim(), dim)
            for n, io in multimodal_io.items()
            if not io.is_discrete
        }
    )
    model.vocab, model.vocab_intervals = vocab, vocab_intervals
    return model


def espnet_lr_lambda(warmup_steps: int, decay_end_step: int, min_lr_ratio: float = 0.0):
    def lr_lambda(step: int) -> float:
        if step < warmup_steps:
            return float(step) / float(max(1, warmup_steps))
        if step < decay_end_step:
            progress = (step - warmup_steps) / max(1, decay_end_step - warmup_steps)
            return min_lr_ratio + 0.5 * (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * progress))
        return min_lr_ratio

    return lr_lambda


def espnet_optimizer(model, lr: float = 1e-3, weight_decay: float = 0.1):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if "embed_tokens" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def save_espnet_checkpoint(model, optimizer, scheduler, step: int, output_dir: str) -> str:
    """ESPnet's ``_save_checkpoint`` in one process: ``OUTPUT/checkpoints/step_N``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    folder = os.path.join(output_dir, "checkpoints", f"step_{step}")
    os.makedirs(folder, exist_ok=True)
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=False)
        ),
        "lr_scheduler": scheduler.state_dict(),
        "global_step": step,
    }
    dcp.save(state, checkpoint_id=folder)
    return folder


def train_some_steps(model, steps: int, seed: int = 0, warmup: int = 2, total: int = 10):
    """A few AdamW steps of a stand-in loss on every trainable parameter (ESPnet's forward is
    not reproduced): enough for weights and both Adam moments to differ from their start."""
    gen = torch.Generator().manual_seed(seed)
    opt = espnet_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, espnet_lr_lambda(warmup, total))
    targets = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = sum(((p - targets[n]) ** 2).mean() for n, p in model.named_parameters()
                   if p.requires_grad and not n.startswith("multimodal_io_dict."))  # fmt: skip
        loss.backward()
        opt.step()
        sched.step()
    return opt, sched
