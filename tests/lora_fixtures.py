"""LoRA settings and models of the LoRA tests (unit: model/lora.py against PEFT; integration:
`torchtitan train` with the lora converter, exports)."""

import copy

import torch

from tests.helpers import build_speechlm
from torchtitan_speechlm.model.lora import LoraSettings
from torchtitan_speechlm.model.model import SpeechLM, build_model

TARGETS = ["q_proj", "v_proj", "mlp.down_proj"]


def settings(**kw) -> LoraSettings:
    base = dict(
        rank=4,
        alpha=8.0,
        dropout=0.0,
        target_modules=list(TARGETS),
        train_audio_rows=False,
        train_head=False,
    )
    return LoraSettings(**{**base, **kw})


def lora_model(backbone_dir, **kw) -> SpeechLM:
    args = copy.copy(build_speechlm(backbone_dir).args)
    args.lora = settings(**kw)
    return build_model(args)


def peft_name(ours: str) -> str:
    """Our adapter parameter -> the same one in PEFT's model around the transformers LM."""
    return "base_model.model.model." + ours.removeprefix("backbone.")


def random_batch(layout, b: int, t: int, gen: torch.Generator):
    """Frames of text in stream 0 and codes in the others, every position carrying loss."""
    n = layout.num_streams
    ids = torch.empty(b, t + 1, n, dtype=torch.long)
    ids[..., 0] = layout.text_offset + torch.randint(0, layout.text_size, (b, t + 1), generator=gen)
    for k in range(1, n):
        ids[..., k] = torch.randint(
            layout.code(k, 0), layout.code(k, layout.codebook_size - 1) + 1, (b, t + 1)
        )
    return ids[:, :-1], ids[:, 1:], torch.ones(b, t, n)
