"""Exported SpeechLM folders on disk: written by ``torchtitan export``, read by
``SpeechLM.from_pretrained`` (model/model.py builds the model; this module reads and writes files).

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

from torchtitan_speechlm.model.args import SpeechLMModelArgs

EXPORT_MODEL_TYPE = "speechlm"
# 2: the codec named once (``codec``, model/codec_identity.py, with ``folder`` its copy here);
# version 1 also kept its hash in ``model_args.codec_hash`` (still read: run_record.py
# ``recorded_codec``, ``model_args_of``)
EXPORT_VERSION = 2
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


def args_from_record(model_args: dict, hf_assets_path: str = "") -> SpeechLMModelArgs:
    fields = SpeechLMModelArgs.__dataclass_fields__
    args = SpeechLMModelArgs(**{k: v for k, v in model_args.items() if k in fields})
    args.hf_assets_path, args.load_weights = hf_assets_path, False
    return args


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
