"""The SpeechLM's initial weights: deterministic, world-size-invariant, then loaded ones.

Every parameter's full value is computed on CPU from (init_seed, parameter name) and then
sharded like the parameter, so 1 process and N processes start from identical weights. The
audio encoder's parameters start from its own weights (model/audio/tower.py); the backbone
checkpoint's text tensors overwrite their parameters' values (only the text rows of the
embedding and head), and a starting point (``speechlm.init_from``, model/starting_point.py)
replaces the values it holds. ``SpeechLM.init_weights`` (model/model.py) runs these steps.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.audio.encoders import AudioEncoderError
from torchtitan_speechlm.model.audio.tower import AudioTower
from torchtitan_speechlm.model.backbones import STACKED, Backbone, stacked_keys
from torchtitan_speechlm.model.lora import is_lora_param, lora_init
from torchtitan_speechlm.model.starting_point import load_starting_point
from torchtitan_speechlm.model.state_dict_adapter import text_tensor_map


def audio_tower_state(
    tower: AudioTower,
    args: SpeechLMModelArgs,
    names: list[str],
    std: float,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The audio encoder's initial values under our parameter names (``audio_encoder.<...>``),
    after recomputing its buffers on ``device``; ``names`` (the model's parameters) must all be
    covered, else the encoder folder's weights do not match its config."""
    tower.reset_buffers(device)
    state = tower.initial_state(std, args.init_seed, args.load_weights)
    audio = {f"audio_encoder.{k}": v for k, v in state.items()}
    missing = [n for n in names if n.startswith("audio_encoder.") and n not in audio]
    if missing:
        raise AudioEncoderError(
            f"audio_encoder.path = {args.audio.path!r}: its weights lack {missing[:4]} "
            f"({len(missing)} tensors); is config.json from the same checkpoint?"
        )
    return audio


def initialise_parameters(
    named: list[tuple[str, torch.Tensor]],
    args: SpeechLMModelArgs,
    family: Backbone,
    std: float,
    audio: dict[str, torch.Tensor],
) -> str:
    """Give every parameter of ``named`` (canonical name, parameter) its initial value: the
    random init (or ``audio``'s value), the backbone checkpoint's text tensor where there is
    one, a starting point's tensor where ``args.init_from`` has one. Returns one line saying
    where the weights came from (what a user checks first: were my weights loaded?)."""
    start = {}
    if args.init_from:
        base = {n for n, _ in named if not is_lora_param(n)}  # adapters always start fresh
        start = load_starting_point(args, base)
    reader = family.weights(args.hf_assets_path) if args.load_weights else None
    # our parameter -> (its tensor in the backbone checkpoint, rows of ours it fills)
    text = (
        {
            name: (key, rows)
            for key, (name, rows) in text_tensor_map(
                args, [n for n, _ in named if not is_lora_param(n)]
            ).items()
        }
        if reader
        else {}
    )
    came = {"backbone": 0, "init_from": 0, "audio encoder": 0, "initialised": 0}
    with torch.no_grad():
        for name, param in named:
            full, source = audio.get(name), "audio encoder"
            if full is None:
                full, source = _random_init(name, param, std, args.init_seed), "initialised"
            if name in text:
                _load_pretrained(full, reader, *text[name], family, name, args.backbone_config)
                source = "backbone"
            if name in start:
                if tuple(start[name].shape) != tuple(full.shape):
                    raise ValueError(
                        f"speechlm.init_from: {name} has shape "
                        f"{tuple(start[name].shape)}, the model {tuple(full.shape)}"
                    )
                full, source = start[name].float(), "init_from"
            came[source] += 1
            _assign(param, full)
    return weights_line(args, came)


def weights_line(args: SpeechLMModelArgs, came: dict[str, int]) -> str:
    """Where the parameters' initial values came from (``came``: parameters per source), in
    one line."""
    where = {
        "backbone": f"loaded from the backbone {args.hf_assets_path} (the decoder; of the "
        "embedding and head only the text rows, their other rows initialised)",
        "init_from": f"loaded from speechlm.init_from = {args.init_from}",
        "audio encoder": f"loaded from the audio encoder {getattr(args.audio, 'path', '')}",
        "initialised": f"initialised (init_seed {args.init_seed})",
    }
    parts = [f"{n} {where[k]}" for k, n in came.items() if n]
    return f"weights of {sum(came.values())} parameters: " + "; ".join(parts)


def _random_init(name: str, param: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    shape = param.shape
    if is_lora_param(name):
        return lora_init(name, shape, gen)
    if name == "head.stream_emb.weight":
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _load_pretrained(
    full: torch.Tensor,
    reader: Any,
    key: str,
    rows: slice | None,
    family: Backbone,
    name: str,
    config: dict,
) -> None:
    """Copy checkpoint tensor ``key`` into parameter ``name``'s initial value (its text rows
    only for the embedding and head). A head missing from a tied checkpoint starts as the
    embedding. A stacked key (``{}``: e.g. one tensor per expert) stacks its tensors along
    dim 0."""
    if key == family.head_key and key not in reader and family.embed_key in reader:
        key = family.embed_key
    keys = stacked_keys(key, full.shape[0])
    for k in keys:
        if k not in reader:
            raise KeyError(
                f"pretrained backbone {reader.directory} has no tensor {k!r} (needed for "
                f"{name}); is config.json from the same checkpoint as the safetensors?"
            )
    tensors = [reader.get(k).float() for k in keys]
    stacked = torch.stack(tensors) if STACKED in key else tensors[0]
    src = family.from_checkpoint(name, stacked, config)
    target = full if rows is None else full[rows]
    if tuple(src.shape) != tuple(target.shape):
        raise ValueError(
            f"{key}: checkpoint shape {tuple(src.shape)} != model {tuple(target.shape)}"
        )
    target.copy_(src)


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        shard = distribute_tensor(
            full.to(param.device_mesh.device_type, param.dtype),
            param.device_mesh,
            param.placements,
            src_data_rank=None,
        )
        param.copy_(shard)
    else:
        param.copy_(full.to(param.device, param.dtype))
