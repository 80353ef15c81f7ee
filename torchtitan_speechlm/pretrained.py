"""Exported SpeechLM folders: written by ``torchtitan export``, read by ``SpeechLM.from_pretrained``.

Layout (docs/checkpoints.md)::

    config.json      {"model_type": "speechlm", "model_args": {...}, "codec": {...},
                      "tokenizer": {...}, "source": {...}}: everything to rebuild the model
    model.safetensors  our parameter names (or model-0000i-of-0000n.safetensors + index)
    vocab.json       the vocabulary layout
    tokenizer files  copied from the tokenizer the data was made with
    codec/           the codec folder (copied), when it was found
    text/            the text LM inside, as a transformers causal-LM folder
"""

from __future__ import annotations

import json
import os

import torch

EXPORT_MODEL_TYPE = "speechlm"
EXPORT_VERSION = 1
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


class PretrainedError(ValueError):
    """An export or weights file cannot be used; the message names the file and the fix."""


def read_export_config(path: str) -> dict:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise PretrainedError(
            f"{path} has no config.json: not a folder made by `torchtitan export`"
        )
    with open(cfg_file) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != EXPORT_MODEL_TYPE:
        raise PretrainedError(
            f"{cfg_file}: model_type is {cfg.get('model_type')!r}, not {EXPORT_MODEL_TYPE!r} "
            "(for a transformers folder use AutoModelForCausalLM; for a SpeechLM, `torchtitan "
            "export` one of its checkpoints)"
        )
    return cfg


def args_from_record(model_args: dict, hf_assets_path: str = ""):
    from torchtitan_speechlm.model.args import SpeechLMModelArgs

    fields = SpeechLMModelArgs.__dataclass_fields__
    args = SpeechLMModelArgs(**{k: v for k, v in model_args.items() if k in fields})
    args.hf_assets_path, args.load_weights = hf_assets_path, False
    return args


def build_model(args, device: str = "cpu"):
    """A SpeechLM with ``args`` on ``device``, deterministic init (weights to be loaded)."""
    from torchtitan_speechlm.model.model import SpeechLM

    with torch.device("meta"):
        model = SpeechLM(args)
    model.to_empty(device=device)
    model.init_weights()
    return model


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's model.safetensors (or its shards)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, WEIGHTS)):
        files = [WEIGHTS]
    else:
        raise PretrainedError(f"{path} holds no {WEIGHTS} (nor {INDEX})")
    out = {}
    for name in files:
        try:
            out.update(load_file(os.path.join(path, name)))
        except (SafetensorError, OSError, ValueError) as e:
            raise PretrainedError(
                f"{os.path.join(path, name)} is unreadable or truncated ({e}); export again"
            ) from None
    return out


def write_safetensors(state: dict[str, torch.Tensor], path: str, max_shard_bytes: int) -> list[str]:
    """Save ``state`` as model.safetensors, or as shards of at most ``max_shard_bytes`` plus an
    index (transformers' layout). Returns the files written."""
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for name in sorted(state):
        t = state[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = t, size + nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, WEIGHTS), metadata={"format": "pt"})
        return [WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return [*names, INDEX]


def check_keys(model, state: dict, where: str, allow_missing=(), allow_unexpected=()) -> None:
    """Missing and unexpected parameter names are an error (naming them) unless a prefix in
    ``allow_missing`` / ``allow_unexpected`` covers them."""
    from torchtitan_speechlm.model.model import canonical_name

    expected = {canonical_name(n) for n, _ in model.named_parameters()}
    missing = sorted(k for k in expected - set(state) if not k.startswith(tuple(allow_missing)))
    unexpected = sorted(
        k for k in set(state) - expected if not k.startswith(tuple(allow_unexpected))
    )
    if missing or unexpected:
        raise PretrainedError(
            f"{where}: missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"({len(unexpected)}); is it a checkpoint of this model?"
        )
    params = dict(model.named_parameters())
    for name, value in state.items():
        if name in params and tuple(value.shape) != tuple(params[name].shape):
            raise PretrainedError(
                f"{where}: {name} has shape {tuple(value.shape)}, the model "
                f"{tuple(params[name].shape)}"
            )


def from_pretrained(path: str, device: str = "cpu", dtype: torch.dtype | None = None):
    """The SpeechLM of an exported folder, in eval mode (``SpeechLM.from_pretrained``)."""
    cfg = read_export_config(path)
    model = build_model(args_from_record(cfg["model_args"], path), device)
    state = read_safetensors(path)
    check_keys(model, state, path)
    model.load_state_dict(state, strict=False)  # checked above; buffers are not exported
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def load_checkpoint_state(step_dir: str, keys: set[str]) -> dict[str, torch.Tensor]:
    """Full tensors of ``keys`` from a DCP checkpoint, in this process, without a process
    group (DCP reassembles the shards every rank wrote)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if not os.path.isfile(os.path.join(step_dir, ".metadata")):
        raise PretrainedError(
            f"{step_dir} is not a complete checkpoint (no .metadata: missing, or a save that was "
            "interrupted); choose another step"
        )
    reader = FileSystemReader(step_dir)
    available = set(reader.read_metadata().state_dict_metadata)
    missing = sorted(keys - available)
    if missing:
        raise PretrainedError(
            f"{step_dir} has no {missing[:6]} ({len(missing)} missing): not a "
            "checkpoint of the model its run record describes"
        )
    state: dict = {}
    try:
        _load_state_dict(
            state,
            storage_reader=reader,
            no_dist=True,
            planner=_EmptyStateDictLoadPlanner(keys=keys),
        )
    except (Exception, CheckpointException) as e:  # (CheckpointException is a BaseException)
        raise PretrainedError(
            f"{step_dir} is unreadable ({type(e).__name__}: {str(e)[:300]}): a .distcp shard is "
            "missing or truncated; choose another step"
        ) from None
    return state
