"""Backbones that carry the conventions of the checkpoints users really bring.

``tests/real_configs/NAME.config.json`` and ``NAME.generation_config.json`` are the files of
the public model repositories as they ship (Qwen3-0.6B, Qwen3-1.7B as re-saved by transformers 5,
Qwen3-30B-A3B, Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-0.5B): ``torch_dtype``/``dtype``
``"bfloat16"``, Llama-3's ``rope_scaling``, Qwen's sliding-window keys, tied and untied heads,
151,936- and 128,256-word vocabularies, list-valued ``eos_token_id`` in generation configs.

``save_real_backbone`` cuts the layers (and, with ``shrink=True``, the widths, to what a CPU test
can train) and keeps everything else as shipped: it builds the model from that config with random
weights in the checkpoint's own dtype (bf16 safetensors, as downloaded), ``save_pretrained``s it,
then writes the shipped ``config.json`` (cut) and ``generation_config.json`` over transformers'
re-serialisation, so the loading code reads the keys users' files have, not ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "real_configs"
NAMES = tuple(sorted(p.name.split(".config.json")[0] for p in CONFIG_DIR.glob("*.config.json")))
# widths a CPU test trains in seconds (head_dim stays explicit where the family has the key)
SHRUNK = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
SHRUNK_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def real_config(name: str) -> dict:
    """The shipped config.json of ``name`` (one of NAMES)."""
    path = CONFIG_DIR / f"{name}.config.json"
    if not path.is_file():
        raise KeyError(f"no real config {name!r}; have {', '.join(NAMES)}")
    return json.loads(path.read_text())


def stored_dtype(config: dict) -> str | None:
    return config.get("torch_dtype") or config.get("dtype")


def cut_config(
    name: str, num_layers: int = 2, shrink: bool = False, vocab_size: int | None = None
) -> dict:
    """The shipped config with ``num_layers`` layers (and tiny widths if ``shrink``); the keys
    that count layers (``max_window_layers``, ``layer_types``, ``mlp_only_layers``) follow."""
    c = real_config(name)
    c["num_hidden_layers"] = num_layers
    if "max_window_layers" in c:
        c["max_window_layers"] = min(c["max_window_layers"], num_layers)
    if "layer_types" in c:
        c["layer_types"] = c["layer_types"][:num_layers]
    if "mlp_only_layers" in c:
        c["mlp_only_layers"] = [i for i in c["mlp_only_layers"] if i < num_layers]
    if shrink:
        c.update(SHRUNK)
        if "head_dim" in c:
            c["head_dim"] = SHRUNK["hidden_size"] // SHRUNK["num_attention_heads"]
        if "num_experts" in c:
            c.update(SHRUNK_MOE)
    if vocab_size is not None:
        c["vocab_size"] = vocab_size
    return c


def save_real_backbone(
    path,
    name: str = "qwen3_0.6b",
    num_layers: int = 2,
    shrink: bool = False,
    vocab_size: int | None = None,
    seed: int = 0,
    **overrides,
) -> dict:
    """Write a random-init checkpoint folder of ``name``'s conventions to ``path`` (see the
    module docstring); ``overrides`` replace config keys (after the cut). Returns the config
    written as config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shipped = cut_config(name, num_layers, shrink, vocab_size)
    shipped.update(overrides)
    kwargs = {k: v for k, v in shipped.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(shipped["model_type"], **kwargs)
    dtype = getattr(torch, stored_dtype(shipped) or "float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(shipped, indent=2) + "\n")
    generation = CONFIG_DIR / f"{name}.generation_config.json"
    (path / "generation_config.json").write_text(generation.read_text())
    return shipped


# the keys of a model's size and layout: the ones a tiny test model keeps of its own
SHAPE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
    "max_position_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "bos_token_id", "eos_token_id",
    "pad_token_id",
)  # fmt: skip
# the shipped checkpoint whose conventions each tiny test family wears
SHIPPED_AS = {
    "qwen3": "qwen3_0.6b",
    "llama": "llama3.2_1b",
    "qwen2": "qwen2.5_0.5b",
    "qwen3_moe": "qwen3_30b_a3b",
}


def dress_as_shipped(folder, name: str) -> dict:
    """Rewrite a ``save_pretrained`` folder as checkpoint ``name`` ships: its config.json becomes
    the shipped one with this model's sizes (SHAPE_KEYS; the counts of layers follow), its
    generation_config.json the shipped one, and its weights are stored in the shipped dtype
    (bf16). The model itself is unchanged but for that rounding. Returns the new config."""
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    saved = json.loads((folder / "config.json").read_text())
    shipped = cut_config(name, saved["num_hidden_layers"])
    shipped.update({k: saved[k] for k in SHAPE_KEYS if k in saved})
    if "num_local_experts" in saved:  # transformers 5 writes num_experts under this name
        shipped["num_experts"] = saved["num_local_experts"]
    (folder / "config.json").write_text(json.dumps(shipped, indent=2) + "\n")
    generation = CONFIG_DIR / f"{name}.generation_config.json"
    (folder / "generation_config.json").write_text(generation.read_text())
    dtype = getattr(torch, stored_dtype(shipped) or "float32")
    for f in folder.glob("*.safetensors"):
        tensors = load_file(str(f))
        cast = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
        save_file(cast, str(f), metadata={"format": "pt"})
    return shipped
