"""Where a new run's weights come from (``[speechlm] init_from``), before step 1.

- an exported folder (``torchtitan export``): its model.safetensors;
- a training checkpoint ``DUMP/checkpoint/step-N`` of another run: its weights only (fresh
  optimizer, LR schedule and data stream; torchtitan's ``checkpoint.initial_load_path`` with
  ``initial_load_model_only`` does the same through torchtitan's checkpointer);
- a single ``.pt`` / ``.pth`` state dict, also ESPnet's ``{"module": state_dict}``, its names
  rewritten by ``init_from_map`` (``SRC_PREFIX=DST_PREFIX`` entries).

Missing or unexpected parameters are listed and are an error unless ``init_from_allow_missing``
/ ``init_from_allow_unexpected`` name their prefixes. An export or checkpoint made with another
vocabulary layout, pattern or codec is refused naming the difference. Every rank reads the whole
source and takes its shard of each tensor, as for the pretrained backbone.
"""

from __future__ import annotations

import os

import torch

from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.model.pretrained import (
    PretrainedError,
    load_checkpoint_state,
    read_export_config,
    read_safetensors,
)
from torchtitan_speechlm.model.run_record import (
    comparable,
    model_args_of,
    record_for_checkpoint,
    recorded_codec,
)

# what must agree between the source's model and ours for its weights to mean the same
SAME = ("vocab", "pattern", "backbone", "backbone_config", "tie_embeddings")


def rename(state: dict, mapping: list[str]) -> dict:
    """Apply ``SRC_PREFIX=DST_PREFIX`` renames (first match wins) to the names of ``state``."""
    pairs = []
    for entry in mapping:
        src, sep, dst = entry.partition("=")
        if not sep:
            raise PretrainedError(f"speechlm.init_from_map entry {entry!r} must be SRC=DST")
        pairs.append((src, dst))
    out = {}
    for name, value in state.items():
        for src, dst in pairs:
            if name.startswith(src):
                name = dst + name[len(src) :]
                break
        out[name] = value
    return out


def check_same(source: dict | None, ours: dict, codec: CodecIdentity | None, where: str) -> None:
    """Refuse a source made for another vocabulary, pattern, backbone or codec (``ours``: the
    SAME keys we know, as JSON values; ``codec``: the data's, None: not compared)."""
    if source is None:
        return
    model_args = model_args_of(source)
    for key, value in ours.items():
        if key in model_args and comparable(key, model_args[key]) != comparable(key, _json(value)):
            raise PretrainedError(
                f"{where} was made with another {key} ({str(model_args[key])[:80]} vs "
                f"{str(_json(value))[:80]}); start from weights of a model with the same "
                "vocabulary, pattern, backbone and codec (or train from the backbone)"
            )
    theirs = recorded_codec(source)
    if codec is not None and theirs.same_codes(codec) is False:
        raise PretrainedError(
            f"{where} was trained on codes of another codec (config_hash "
            f"{theirs.config_hash} vs {codec.config_hash}); re-prepare the data with its codec"
        )


def _json(value):
    import json

    return json.loads(json.dumps(value))


def load_starting_point(args, names: set[str]) -> dict:
    """Full tensors by our parameter names from ``args.init_from``. The source's vocabulary,
    pattern and backbone are checked here (the model's own); its codec against the data's
    once, by the run before any rank builds a model (components/resume.py
    ``check_init_from``): the codec is the run's, not the model args'."""
    path = os.path.abspath(args.init_from)
    ours = {k: getattr(args, k) for k in SAME}
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        check_same(read_export_config(path), ours, None, path)
        state = read_safetensors(path)
    elif os.path.isdir(path):
        check_same(record_for_checkpoint(path), ours, None, path)
        state = load_checkpoint_state(path, names)
    elif os.path.isfile(path):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise PretrainedError(f"{path} is not a readable torch state dict ({e})") from None
        if isinstance(state, dict) and isinstance(state.get("module"), dict):
            state = state["module"]  # ESPnet's export
        if not isinstance(state, dict):
            raise PretrainedError(f"{path} holds a {type(state).__name__}, not a state dict")
    else:
        raise PretrainedError(f"speechlm.init_from = {args.init_from!r} does not exist")
    state = rename(state, args.init_from_map)
    missing = sorted(
        n for n in names - set(state) if not n.startswith(tuple(args.init_from_allow_missing))
    )
    unexpected = sorted(
        n for n in set(state) - names if not n.startswith(tuple(args.init_from_allow_unexpected))
    )
    if missing or unexpected:
        raise PretrainedError(
            f"speechlm.init_from = {path}: missing {_few(missing)}, unexpected {_few(unexpected)}; "
            "rename with speechlm.init_from_map (SRC_PREFIX=DST_PREFIX) or allow them with "
            "speechlm.init_from_allow_missing / init_from_allow_unexpected (name prefixes)"
        )
    return {n: v for n, v in state.items() if n in names}


def _few(names: list[str]) -> str:
    return f"{names[:6]}{' ...' if len(names) > 6 else ''} ({len(names)})"
